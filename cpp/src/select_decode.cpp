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

namespace {

// The checks and unit picks both split selections share (from the raw keys, from compressed
// caches). max_seqlen_k is the longest (or largest possible) key sequence.
struct SplitUnits {
  const infllmv2_select_decode_lse_unit* lse = nullptr;
  const infllmv2_select_decode_scores_unit* scores = nullptr;
  const infllmv2_select_decode_topk_unit* top = nullptr;
};

infllmv2_status check_split_selection(const char* op, infllmv2_dtype dtype, int32_t head_dim, int32_t batch,
                                      int32_t heads, int32_t heads_k, int32_t topk, int32_t init_blocks,
                                      int32_t local_blocks, int64_t total_q, int32_t max_seqlen_q,
                                      int32_t max_seqlen_k, float softmax_scale) {
  infllmv2_status st = check_group_layout(op, dtype, head_dim, batch, heads, heads_k);
  if (st != INFLLMV2_OK) return st;
  if (topk < 1 || topk > kMaxTopk)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: topk must be in [1, %d], got %d", op, kMaxTopk, topk);
  if (init_blocks < 0 || local_blocks < 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: init_blocks and local_blocks must be >= 0, got %d and %d", op,
                init_blocks, local_blocks);
  if (total_q < 0 || total_q > INT_MAX || max_seqlen_q < 0 || max_seqlen_q > total_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: total_q must be in [0, 2^31) and max_seqlen_q in [0, total_q], got %lld and %d",
                op, (long long)total_q, max_seqlen_q);
  if (!(softmax_scale >= 0.0f) || !std::isfinite(softmax_scale))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: softmax_scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got %g",
                op, (double)softmax_scale);
  if (max_seqlen_k < 0 || max_seqlen_k < max_seqlen_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_k must be >= max_seqlen_q (%d) and >= 0, got %d", op,
                max_seqlen_q, max_seqlen_k);
  const int n_blocks = n_blocks_of(max_seqlen_k);
  if ((int64_t)heads_k * total_q * n_blocks > INT_MAX)
    return fail(INFLLMV2_ERR_UNSUPPORTED,
                "%s: heads_k * total_q * ceil(max_seqlen_k / 64) block scores must be at most %d, got %lld (split "
                "selection is for few queries a sequence; infllmv2_select_blocks_from_keys takes the others)",
                op, INT_MAX, (long long)heads_k * total_q * n_blocks);
  return INFLLMV2_OK;
}

infllmv2_status pick_split_units(const char* op, const Device& dev, infllmv2_dtype dtype, int32_t head_dim,
                                 int32_t max_seqlen_k, int32_t splits, SplitUnits* u) {
  infllmv2_status st;
  const int n_blocks = n_blocks_of(max_seqlen_k);
  const std::string desc = config_desc(dtype, head_dim);
  if ((st = pick_unit(op, infllmv2_select_decode_lse_units, dev,
                      [&](const infllmv2_select_decode_lse_unit& x) { return x.dtype == dtype && x.head_dim == head_dim; },
                      desc, &u->lse)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_select_decode_scores_units, dev,
                      [&](const infllmv2_select_decode_scores_unit& x) {
                        return x.dtype == dtype && x.head_dim == head_dim;
                      },
                      desc, &u->scores)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_select_decode_topk_units, dev,
                      [](const infllmv2_select_decode_topk_unit&) { return true; }, "block top-K", &u->top)) !=
          INFLLMV2_OK)
    return st;
  if (u->lse->max_splits < splits)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s runs at most %d splits, got %d", op, u->lse->name, u->lse->max_splits,
                splits);
  if (u->lse->block_m != kTileRows || u->lse->t_max != kTileTokens || u->lse->block != kBlock ||
      u->top->block != kBlock)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s has tiles of %d rows and %d tokens, this library expects %d, %d", op,
                u->lse->name, u->lse->block_m, u->lse->t_max, kTileRows, kTileTokens);
  if (n_blocks > u->top->score_cap)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: max_seqlen_k = %d is %d blocks of %d; this build selects over at most %d",
                op, max_seqlen_k, n_blocks, kBlock, u->top->score_cap);
  return INFLLMV2_OK;
}

// The three split kernels over compressed keys ck (offsets cu_c) normalised over nk (cu_n; the
// fine keys themselves for the exact normaliser), with the partials and block scores at
// workspace + base.
infllmv2_status run_split_selection(const char* op, const SplitUnits& u, const void* q, const void* ck,
                                    const void* nk, const int32_t* cu_q, const int32_t* cu_k, const int32_t* cu_c,
                                    const int32_t* cu_n, int64_t total_c, int64_t total_n, int32_t* topk_idx,
                                    void* workspace, size_t base, int32_t batch, int64_t total_q,
                                    int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k,
                                    int32_t topk, int32_t init_blocks, int32_t local_blocks, int32_t approx_lse,
                                    int32_t norm_kernel_size, int32_t norm_kernel_stride, float softmax_scale,
                                    int32_t head_dim, int32_t splits, cudaStream_t stream) {
  const int n_blocks = n_blocks_of(max_seqlen_k);
  const DecodeLayout d = decode_layout(batch, total_q, max_seqlen_q, max_seqlen_k, heads, heads_k, splits);
  const int groups = heads / heads_k;
  const int T = tile_T(groups, n_blocks, u.top->score_cap);
  const int max_tiles = (max_seqlen_q + T - 1) / T;
  const int tile_rows = batch * max_tiles;
  float* m_part = at<float>(workspace, base + d.m_part);
  float* l_part = at<float>(workspace, base + d.l_part);
  float* m_fine = at<float>(workspace, base + d.m_fine);
  float* l_fine = at<float>(workspace, base + d.l_fine);
  float* sc = at<float>(workspace, base + d.scores);
  const int norm_w = approx_lse ? norm_kernel_size : kFineW, norm_s = approx_lse ? norm_kernel_stride : kFineS;
  const float scale_log2 = attn_scale_log2(softmax_scale, head_dim);
  void* qp = const_cast<void*>(q);
  void* ckp = const_cast<void*>(ck);
  void* nkp = const_cast<void*>(nk);
  int32_t* cq = const_cast<int32_t*>(cu_q);
  int32_t* ckk = const_cast<int32_t*>(cu_k);
  int32_t* cc = const_cast<int32_t*>(cu_c);
  int32_t* cn = const_cast<int32_t*>(cu_n);
  int rc = u.lse->call(qp, ckp, nkp, cq, ckk, cc, cn, m_part, l_part, m_fine, l_fine, batch, max_tiles, splits, groups, T,
                       norm_w, norm_s, approx_lse, scale_log2, (int)total_q, heads, (int)total_c, heads_k,
                       (int)total_n, batch + 1, tile_rows * splits, tile_rows, stream);
  infllmv2_status st = launch_result(op, u.lse->name, rc, u.lse->last_error);
  if (st != INFLLMV2_OK) return st;
  rc = u.scores->call(qp, ckp, cq, ckk, cc, m_part, l_part, m_fine, l_fine, sc, batch, max_tiles, splits, groups, T,
                      local_blocks, norm_w, approx_lse, scale_log2, (int)total_q, heads, (int)total_c, heads_k,
                      batch + 1, tile_rows * splits, tile_rows, n_blocks, stream);
  if ((st = launch_result(op, u.scores->name, rc, u.scores->last_error)) != INFLLMV2_OK) return st;
  rc = u.top->call(sc, cq, ckk, cc, topk_idx, batch, max_tiles, T, init_blocks, local_blocks, heads_k, (int)total_q,
                   n_blocks, batch + 1, topk, stream);
  return launch_result(op, u.top->name, rc, u.top->last_error);
}

// Workspace of infllmv2_select_decode_kvcache: the three offsets arrays, then (splits > 1) the
// split selection's partials and block scores.
size_t cache_offsets_bytes(int32_t batch) { return 3 * align256((size_t)(batch + 1) * sizeof(int32_t)); }

}  // namespace

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
  infllmv2_status st = check_split_selection(kOp, dtype, head_dim, batch, heads, heads_k, topk, init_blocks,
                                             local_blocks, total_q, max_seqlen_q, max_seqlen_k, softmax_scale);
  if (st != INFLLMV2_OK) return st;
  Device dev;
  if ((st = current_device(kOp, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(kOp, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}})) !=
      INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(kOp, dev, {{"q", q}, {"topk_idx", topk_idx}})) != INFLLMV2_OK)
    return st;
  if (total_k > 0 && (st = check_device_pointers(kOp, dev, {{"k", k}})) != INFLLMV2_OK) return st;
  SplitUnits u;
  if ((st = pick_split_units(kOp, dev, dtype, head_dim, max_seqlen_k, splits, &u)) != INFLLMV2_OK) return st;

  const DecodeLayout d = decode_layout(batch, total_q, max_seqlen_q, max_seqlen_k, heads, heads_k, splits);
  const size_t base = select_from_keys_bytes(batch, total_k, heads_k, head_dim, approx_lse != 0, norm_kernel_stride);
  CompressedKeys c;
  if ((st = compress_for_selection(kOp, kSizeFn, q, k, cu_seqlens_k, punct_mask, phsa_lambda, workspace,
                                   workspace_size, d.total, batch, total_k, max_seqlen_q, max_seqlen_k, heads_k,
                                   head_dim, approx_lse, norm_kernel_size, norm_kernel_stride, dtype, stream, &c)) !=
      INFLLMV2_OK)
    return st;
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;
  // the normaliser: the coarse keys, or the fine keys themselves (exact)
  return run_split_selection(kOp, u, q, c.ck, approx_lse ? c.nk : c.ck, cu_seqlens_q, cu_seqlens_k, c.cu_c,
                             approx_lse ? c.cu_n : c.cu_c, c.total_c, approx_lse ? c.total_n : c.total_c, topk_idx,
                             workspace, base, batch, total_q, max_seqlen_q, max_seqlen_k, heads, heads_k, topk,
                             init_blocks, local_blocks, approx_lse, norm_kernel_size, norm_kernel_stride,
                             softmax_scale, head_dim, splits, stream);
}

extern "C" INFLLMV2_API size_t infllmv2_select_decode_kvcache_workspace_size(int32_t batch, int64_t total_q,
                                                                             int32_t max_seqlen_q, int32_t capacity,
                                                                             int32_t heads, int32_t heads_k,
                                                                             int32_t splits) {
  if (!layout_ok(batch, max_seqlen_q, capacity, heads, heads_k) || total_q < 0 || splits < 1) return 0;
  const size_t offsets = cache_offsets_bytes(batch);
  if (splits == 1) return offsets;
  return offsets + decode_layout(batch, total_q, max_seqlen_q, capacity, heads, heads_k, splits).total;
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_select_decode_kvcache(
    const void* q, const void* ck_cache, const void* nk_cache, const int32_t* cache_seqlens,
    const int32_t* cu_seqlens_q, int32_t* topk_idx, void* workspace, size_t workspace_size, int32_t batch,
    int64_t total_q, int32_t max_seqlen_q, int32_t capacity, int32_t capacity_c, int32_t capacity_n, int32_t heads,
    int32_t heads_k, int32_t head_dim, int32_t topk, int32_t init_blocks, int32_t local_blocks,
    int32_t norm_kernel_size, int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, int32_t splits,
    cudaStream_t stream) {
  static const char* op = "infllmv2_select_decode_kvcache";
  clear_error();
  if (splits < 1 || splits > kMaxSplits)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: splits must be in [1, %d] (infllmv2_select_decode_splits() picks it), got %d", op, kMaxSplits,
                splits);
  const int approx_lse = nk_cache != nullptr;
  if (approx_lse && (norm_kernel_size < 1 || norm_kernel_stride < 1))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: norm_kernel_size and norm_kernel_stride must be >= 1, got %d and %d",
                op, norm_kernel_size, norm_kernel_stride);
  if (capacity < 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: capacity must be >= 0, got %d", op, capacity);
  // every compressed key of a full cache has its row: the kernels read row j only where key j is
  // visible, so only below n(capacity)
  infllmv2_status st = check_compressed_capacity(op, "capacity_c", capacity_c, capacity, kFineW, kFineS, batch);
  if (st == INFLLMV2_OK && approx_lse)
    st = check_compressed_capacity(op, "capacity_n", capacity_n, capacity, norm_kernel_size, norm_kernel_stride, batch);
  if (st != INFLLMV2_OK) return st;
  if ((st = check_split_selection(op, dtype, head_dim, batch, heads, heads_k, topk, init_blocks, local_blocks,
                                  total_q, max_seqlen_q, capacity, softmax_scale)) != INFLLMV2_OK)
    return st;
  const size_t need = infllmv2_select_decode_kvcache_workspace_size(batch, total_q, max_seqlen_q, capacity, heads,
                                                                     heads_k, splits);
  if (workspace_size < need)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: workspace_size is %zu bytes, infllmv2_select_decode_kvcache_workspace_size() asks %zu", op,
                workspace_size, need);
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cache_seqlens", cache_seqlens}, {"cu_seqlens_q", cu_seqlens_q},
                                            {"ck_cache", ck_cache}, {"workspace", workspace}})) != INFLLMV2_OK)
    return st;
  if (approx_lse && (st = check_device_pointers(op, dev, {{"nk_cache", nk_cache}})) != INFLLMV2_OK) return st;
  if (total_q > 0 && (st = check_device_pointers(op, dev, {{"q", q}, {"topk_idx", topk_idx}})) != INFLLMV2_OK)
    return st;
  if ((st = check_aligned(op, {{"q", q}, {"ck_cache", ck_cache}, {"nk_cache", nk_cache}, {"workspace", workspace}})) !=
      INFLLMV2_OK)
    return st;
  SplitUnits u;
  if (splits > 1 && (st = pick_split_units(op, dev, dtype, head_dim, capacity, splits, &u)) != INFLLMV2_OK) return st;
  const infllmv2_attention_cache_offsets_unit* offs = nullptr;
  if ((st = pick_unit(op, infllmv2_attention_cache_offsets_units, dev,
                      [](const infllmv2_attention_cache_offsets_unit&) { return true; }, "cache offsets", &offs)) !=
      INFLLMV2_OK)
    return st;
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;

  // the kernels read sequence b's compressed keys from row b * capacity of its cache and its key
  // length from cu_seqlens_k's differences: offsets of that shape, made on the device
  const size_t arr = align256((size_t)(batch + 1) * sizeof(int32_t));
  int32_t* cu_k = at<int32_t>(workspace, 0);
  int32_t* cu_c = at<int32_t>(workspace, arr);
  int32_t* cu_n = at<int32_t>(workspace, 2 * arr);
  const int cap_n = approx_lse ? capacity_n : capacity_c;
  int rc = offs->call(const_cast<int32_t*>(cache_seqlens), cu_k, cu_c, cu_n, capacity, capacity_c, cap_n, batch,
                      batch + 1, stream);
  if ((st = launch_result(op, offs->name, rc, offs->last_error)) != INFLLMV2_OK) return st;
  const int64_t total_c = (int64_t)batch * capacity_c;
  if (splits == 1)
    return infllmv2_select_blocks(q, ck_cache, nk_cache, cu_seqlens_q, cu_k, cu_c, cu_n, topk_idx, batch, total_q,
                                  total_c, approx_lse ? (int64_t)batch * capacity_n : 0, max_seqlen_q, capacity,
                                  heads, heads_k, head_dim, topk, init_blocks, local_blocks, norm_kernel_size,
                                  norm_kernel_stride, dtype, softmax_scale, stream);
  return run_split_selection(op, u, q, ck_cache, approx_lse ? nk_cache : ck_cache, cu_seqlens_q, cu_k, cu_c, cu_n,
                             total_c, approx_lse ? (int64_t)batch * capacity_n : total_c, topk_idx, workspace,
                             cache_offsets_bytes(batch), batch, total_q, max_seqlen_q, capacity, heads, heads_k, topk,
                             init_blocks, local_blocks, approx_lse, norm_kernel_size, norm_kernel_stride,
                             softmax_scale, head_dim, splits, stream);
}
