// infllmv2_select_decode: stages 0 and 1 from the raw keys with the selection split over the
// compressed keys, for calls whose query tiles leave the GPU idle (decoding).
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "registry.h"
#include "runtime.h"
#include "stage1.h"

using namespace infllmv2;

namespace {

constexpr const char* kOp = "infllmv2_select_decode";
constexpr const char* kSizeFn = "infllmv2_select_decode_workspace_size";
constexpr int kMaxSplits = 64;  // dsl/select_decode.py MAX_SPLITS
constexpr int kMaxTopk = 8192;  // as infllmv2_select_blocks
constexpr int kTileRows = 64;   // dsl select_blocks BLOCK_M
constexpr int kTileTokens = 16;  // dsl select_blocks T_MAX, checked against the unit at launch
// The smallest block-score capacity of the topk units (sm_80/sm_89; sm_90a holds 8192): the
// workspace is sized with it, so one size serves every arch.
constexpr int kMinScoreCap = 6144;
// A split scores at least this many 64-key chunks (plus the one before its range, for the pool).
constexpr int kMinChunksPerSplit = 2;

int n_blocks_of(int32_t max_seqlen_k) { return (max_seqlen_k + kBlock - 1) / kBlock; }

// Tokens a tile: as infllmv2_select_blocks, min(64 / G, 16), lowered until T * n_blocks block
// scores fit the top-K's shared memory.
int tile_T(int groups, int n_blocks, int score_cap) {
  int T = tile_tokens(kTileRows, kTileTokens, groups);
  if (n_blocks > 0 && (int64_t)T * n_blocks > score_cap) T = std::max(1, score_cap / n_blocks);
  return T;
}

// Workspace after the compressed keys: M and L partials fp32 (heads_k, batch x tiles x splits,
// 64), the exact fallback's M and L (heads_k, batch x tiles, 64), then the block scores fp32
// (heads_k, total_q, n_blocks); each at a 256-byte boundary.
struct DecodeLayout {
  size_t m_part = 0, l_part = 0, m_fine = 0, l_fine = 0, scores = 0, total = 0;
};

DecodeLayout decode_layout(int32_t batch, int64_t total_q, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads,
                           int32_t heads_k, int32_t splits) {
  DecodeLayout l;
  const int groups = heads / heads_k;
  const int T = tile_T(groups, n_blocks_of(max_seqlen_k), kMinScoreCap);
  const size_t tiles = (size_t)batch * (size_t)((max_seqlen_q + T - 1) / T);
  const size_t part = align256((size_t)heads_k * tiles * (size_t)splits * kTileRows * sizeof(float));
  const size_t fine = align256((size_t)heads_k * tiles * kTileRows * sizeof(float));
  size_t at = 0;
  l.m_part = at, at += part;
  l.l_part = at, at += part;
  l.m_fine = at, at += fine;
  l.l_fine = at, at += fine;
  l.scores = at, at += align256((size_t)heads_k * (size_t)total_q * (size_t)n_blocks_of(max_seqlen_k) * sizeof(float));
  l.total = at;
  return l;
}

bool layout_ok(int32_t batch, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k) {
  return batch >= 1 && max_seqlen_q >= 0 && max_seqlen_k >= 0 && heads_k >= 1 && heads >= heads_k &&
         heads % heads_k == 0 && heads / heads_k <= kTileRows;
}

}  // namespace

extern "C" INFLLMV2_API int32_t infllmv2_select_decode_splits(int32_t batch, int32_t max_seqlen_q,
                                                              int32_t max_seqlen_k, int32_t heads, int32_t heads_k,
                                                              int32_t num_splits) {
  if (num_splits < 0 || !layout_ok(batch, max_seqlen_q, max_seqlen_k, heads, heads_k)) return 0;
  int sms = 0;
  if (num_splits == 0 && device_sms("infllmv2_select_decode_splits", &sms) != INFLLMV2_OK) return 0;
  const int T = tile_T(heads / heads_k, n_blocks_of(max_seqlen_k), kMinScoreCap);
  const int64_t ctas = (int64_t)batch * ((max_seqlen_q + T - 1) / T) * heads_k;
  const int64_t chunks = (windows(max_seqlen_k, kFineW, kFineS) + 63) / 64;
  // at least kMinChunksPerSplit chunks a split
  return resolve_splits(num_splits, ctas, (chunks + kMinChunksPerSplit - 1) / kMinChunksPerSplit, sms, kMaxSplits);
}

extern "C" INFLLMV2_API size_t infllmv2_select_decode_workspace_size(int32_t batch, int64_t total_q, int64_t total_k,
                                                                     int32_t max_seqlen_q, int32_t max_seqlen_k,
                                                                     int32_t heads, int32_t heads_k, int32_t head_dim,
                                                                     int32_t approx_lse, int32_t norm_kernel_stride,
                                                                     int32_t splits) {
  if (!layout_ok(batch, max_seqlen_q, max_seqlen_k, heads, heads_k) || total_q < 0 || total_k < 0 || head_dim < 1 ||
      splits < 1 || (approx_lse != 0 && approx_lse != 1) || (approx_lse && norm_kernel_stride < 1))
    return 0;
  const size_t select = select_from_keys_bytes(batch, total_k, heads_k, head_dim, approx_lse != 0, norm_kernel_stride);
  if (splits == 1) return select;
  return select + decode_layout(batch, total_q, max_seqlen_q, max_seqlen_k, heads, heads_k, splits).total;
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_select_decode(
    const void* q, const void* k, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, const uint8_t* punct_mask,
    float phsa_lambda, int32_t* topk_idx, void* workspace, size_t workspace_size, int32_t batch, int64_t total_q,
    int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim,
    int32_t topk, int32_t init_blocks, int32_t local_blocks, int32_t approx_lse, int32_t norm_kernel_size,
    int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, int32_t splits, cudaStream_t stream) {
  clear_error();
  if (splits < 1 || splits > kMaxSplits)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: splits must be in [1, %d] (infllmv2_select_decode_splits() picks it), got %d", kOp, kMaxSplits,
                splits);
  if (splits == 1)  // one range per tile: the fused selection itself
    return infllmv2_select_blocks_from_keys(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk_idx,
                                            workspace, workspace_size, batch, total_q, total_k, max_seqlen_q,
                                            max_seqlen_k, heads, heads_k, head_dim, topk, init_blocks, local_blocks,
                                            approx_lse, norm_kernel_size, norm_kernel_stride, dtype, softmax_scale,
                                            stream);
  infllmv2_status st = check_group_layout(kOp, dtype, head_dim, batch, heads, heads_k);
  if (st != INFLLMV2_OK) return st;
  if (topk < 1 || topk > kMaxTopk)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: topk must be in [1, %d], got %d", kOp, kMaxTopk, topk);
  if (init_blocks < 0 || local_blocks < 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: init_blocks and local_blocks must be >= 0, got %d and %d", kOp,
                init_blocks, local_blocks);
  if (total_q < 0 || total_q > INT_MAX || max_seqlen_q < 0 || max_seqlen_q > total_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: total_q must be in [0, 2^31) and max_seqlen_q in [0, total_q], got %lld and %d",
                kOp, (long long)total_q, max_seqlen_q);
  if (!(softmax_scale >= 0.0f) || !std::isfinite(softmax_scale))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: softmax_scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got %g",
                kOp, (double)softmax_scale);
  if (max_seqlen_k < 0 || max_seqlen_k < max_seqlen_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_k must be >= max_seqlen_q (%d) and >= 0, got %d", kOp,
                max_seqlen_q, max_seqlen_k);
  const int n_blocks = n_blocks_of(max_seqlen_k);
  if ((int64_t)heads_k * total_q * n_blocks > INT_MAX)
    return fail(INFLLMV2_ERR_UNSUPPORTED,
                "%s: heads_k * total_q * ceil(max_seqlen_k / 64) block scores must be at most %d, got %lld (split "
                "selection is for few queries a sequence; infllmv2_select_blocks_from_keys takes the others)",
                kOp, INT_MAX, (long long)heads_k * total_q * n_blocks);

  Device dev;
  if ((st = current_device(kOp, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(kOp, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}})) !=
      INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(kOp, dev, {{"q", q}, {"topk_idx", topk_idx}})) != INFLLMV2_OK)
    return st;
  if (total_k > 0 && (st = check_device_pointers(kOp, dev, {{"k", k}})) != INFLLMV2_OK) return st;

  const std::string desc = config_desc(dtype, head_dim);
  const infllmv2_select_decode_lse_unit* lse = nullptr;
  const infllmv2_select_decode_scores_unit* scores = nullptr;
  const infllmv2_select_decode_topk_unit* top = nullptr;
  if ((st = pick_unit(kOp, infllmv2_select_decode_lse_units, dev,
                      [&](const infllmv2_select_decode_lse_unit& u) { return u.dtype == dtype && u.head_dim == head_dim; },
                      desc, &lse)) != INFLLMV2_OK ||
      (st = pick_unit(kOp, infllmv2_select_decode_scores_units, dev,
                      [&](const infllmv2_select_decode_scores_unit& u) {
                        return u.dtype == dtype && u.head_dim == head_dim;
                      },
                      desc, &scores)) != INFLLMV2_OK ||
      (st = pick_unit(kOp, infllmv2_select_decode_topk_units, dev,
                      [](const infllmv2_select_decode_topk_unit&) { return true; }, "block top-K", &top)) !=
          INFLLMV2_OK)
    return st;
  if (lse->max_splits < splits)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s runs at most %d splits, got %d", kOp, lse->name, lse->max_splits, splits);
  if (lse->block_m != kTileRows || lse->t_max != kTileTokens || lse->block != kBlock || top->block != kBlock)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s has tiles of %d rows and %d tokens, this library expects %d, %d", kOp,
                lse->name, lse->block_m, lse->t_max, kTileRows, kTileTokens);
  if (n_blocks > top->score_cap)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: max_seqlen_k = %d is %d blocks of %d; this build selects over at most %d",
                kOp, max_seqlen_k, n_blocks, kBlock, top->score_cap);

  const DecodeLayout d = decode_layout(batch, total_q, max_seqlen_q, max_seqlen_k, heads, heads_k, splits);
  const size_t base = select_from_keys_bytes(batch, total_k, heads_k, head_dim, approx_lse != 0, norm_kernel_stride);
  CompressedKeys c;
  if ((st = compress_for_selection(kOp, kSizeFn, q, k, cu_seqlens_k, punct_mask, phsa_lambda, workspace,
                                   workspace_size, d.total, batch, total_k, max_seqlen_q, max_seqlen_k, heads_k,
                                   head_dim, approx_lse, norm_kernel_size, norm_kernel_stride, dtype, stream, &c)) !=
      INFLLMV2_OK)
    return st;
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;

  const int groups = heads / heads_k;
  const int T = tile_T(groups, n_blocks, top->score_cap);
  const int max_tiles = (max_seqlen_q + T - 1) / T;
  const int tile_rows = batch * max_tiles;
  float* m_part = at<float>(workspace, base + d.m_part);
  float* l_part = at<float>(workspace, base + d.l_part);
  float* m_fine = at<float>(workspace, base + d.m_fine);
  float* l_fine = at<float>(workspace, base + d.l_fine);
  float* sc = at<float>(workspace, base + d.scores);
  // the normaliser: the coarse keys, or the fine keys themselves (exact)
  void* nk = const_cast<void*>(approx_lse ? c.nk : c.ck);
  int32_t* cu_n = const_cast<int32_t*>(approx_lse ? c.cu_n : c.cu_c);
  const int total_n = (int)(approx_lse ? c.total_n : c.total_c);
  const int norm_w = approx_lse ? norm_kernel_size : kFineW, norm_s = approx_lse ? norm_kernel_stride : kFineS;
  const float scale_log2 = attn_scale_log2(softmax_scale, head_dim);
  void* ck = const_cast<void*>(c.ck);
  int32_t* cu_c = const_cast<int32_t*>(c.cu_c);
  int32_t* cu_q = const_cast<int32_t*>(cu_seqlens_q);
  int32_t* cu_k = const_cast<int32_t*>(cu_seqlens_k);

  int rc = lse->call(const_cast<void*>(q), ck, nk, cu_q, cu_k, cu_c, cu_n, m_part, l_part, m_fine, l_fine, batch,
                     max_tiles, splits, groups, T, norm_w, norm_s, approx_lse, scale_log2, (int)total_q, heads,
                     (int)c.total_c, heads_k, total_n, batch + 1, tile_rows * splits, tile_rows, stream);
  if ((st = launch_result(kOp, lse->name, rc, lse->last_error)) != INFLLMV2_OK) return st;
  rc = scores->call(const_cast<void*>(q), ck, cu_q, cu_k, cu_c, m_part, l_part, m_fine, l_fine, sc, batch, max_tiles,
                    splits, groups, T, local_blocks, norm_w, approx_lse, scale_log2, (int)total_q, heads,
                    (int)c.total_c, heads_k, batch + 1, tile_rows * splits, tile_rows, n_blocks, stream);
  if ((st = launch_result(kOp, scores->name, rc, scores->last_error)) != INFLLMV2_OK) return st;
  rc = top->call(sc, cu_q, cu_k, cu_c, topk_idx, batch, max_tiles, T, init_blocks, local_blocks, heads_k, (int)total_q,
                 n_blocks, batch + 1, topk, stream);
  return launch_result(kOp, top->name, rc, top->last_error);
}
