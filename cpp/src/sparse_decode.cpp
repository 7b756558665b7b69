// infllmv2_sparse_decode: stage 2's forward split over the selected blocks (split-KV decoding).
#include <cstdint>
#include <string>

#include "registry.h"
#include "runtime.h"

using namespace infllmv2;

namespace {

constexpr int kMaxTopk = 128;  // as infllmv2_sparse_attn_fwd
constexpr int kMaxSplits = 64;  // dsl/sparse_decode.py MAX_SPLITS
// A split walks at least this many blocks of its tile's union: fewer would spend more on the
// union prologue and the partial results than they save.
constexpr int kMinBlocksPerSplit = 4;
constexpr int kTileRows = 64;   // dsl BLOCK_M: a tile is min(64 / G, kTileTokens) tokens x G heads
constexpr int kTileTokens = 4;  // dsl T_MAX, checked against the unit at launch
constexpr int kBlock = 64;      // keys a selected block (dsl BLOCK_N): a page must not split one

// The split rule is resolve_splits' (runtime.h) with at least kMinBlocksPerSplit blocks a split.
// 1 means the call is infllmv2_sparse_attn_fwd's, with no workspace. (H100, one token a
// sequence, K = 96, G = 16, CUDA graphs: batch 1, 8, 32 ran fastest at 24-32, 16 and 4 splits,
// what this picks, within 5%: 24, 16, 4; rounding up instead had picked 17 and 5, 11% and 4%
// slower; benchmarks/NOTES.md.)

// Workspace: O partials fp32 (splits x total_q, heads, head_dim), then at a 256-byte boundary
// the LSE partials fp32 (heads, splits x total_q).
size_t o_part_bytes(int splits, int64_t total_q, int32_t heads, int32_t head_dim) {
  return (size_t)splits * (size_t)total_q * (size_t)heads * (size_t)head_dim * sizeof(float);
}
size_t partial_bytes(int splits, int64_t total_q, int32_t heads, int32_t head_dim) {
  return align256(o_part_bytes(splits, total_q, heads, head_dim)) +
         (size_t)splits * (size_t)total_q * (size_t)heads * sizeof(float);
}
size_t decode_bytes(int splits, int64_t total_q, int32_t heads, int32_t head_dim) {
  return splits <= 1 ? 0 : partial_bytes(splits, total_q, heads, head_dim);
}

int64_t ctas_of(int32_t batch, int32_t max_seqlen_q, int32_t heads, int32_t heads_k) {
  if (heads_k <= 0 || heads % heads_k != 0) return 0;
  const int groups = heads / heads_k;
  if (groups < 1 || groups > 64) return 0;
  const int T = tile_tokens(kTileRows, kTileTokens, groups);
  return (int64_t)((max_seqlen_q + T - 1) / T) * batch * heads_k;
}

}  // namespace

extern "C" INFLLMV2_API int32_t infllmv2_sparse_decode_splits(int32_t batch, int32_t max_seqlen_q, int32_t heads,
                                                              int32_t heads_k, int32_t topk, int32_t num_splits) {
  if (num_splits < 0 || topk < 1) return 0;
  int sms = 0;
  if (num_splits == 0 && device_sms("infllmv2_sparse_decode_splits", &sms) != INFLLMV2_OK) return 0;
  return resolve_splits(num_splits, ctas_of(batch, max_seqlen_q, heads, heads_k),
                        (topk + kMinBlocksPerSplit - 1) / kMinBlocksPerSplit, sms, kMaxSplits);
}

extern "C" INFLLMV2_API size_t infllmv2_sparse_decode_workspace_size(int64_t total_q, int32_t heads, int32_t head_dim,
                                                                     int32_t splits) {
  if (total_q <= 0 || heads <= 0 || head_dim <= 0) return 0;
  return decode_bytes(splits, total_q, heads, head_dim);
}

namespace {

// The argument checks both split entry points make before touching the device.
infllmv2_status check_split_args(const char* op, infllmv2_dtype dtype, int32_t head_dim, int32_t batch,
                                 int32_t heads, int32_t heads_k, int32_t topk, int32_t splits, int64_t total_q,
                                 int64_t total_k, int32_t max_seqlen_q, float softmax_scale) {
  infllmv2_status st = check_group_layout(op, dtype, head_dim, batch, heads, heads_k);
  if (st != INFLLMV2_OK) return st;
  if (topk < 1 || topk > kMaxTopk)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: topk must be in [1, %d], got %d", op, kMaxTopk, topk);
  if (splits < 1 || splits > kMaxSplits)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: splits must be in [1, %d] (infllmv2_sparse_decode_splits() picks it), got %d", op, kMaxSplits,
                splits);
  if ((st = check_attn_sizes(op, total_q, total_k, max_seqlen_q, 0, softmax_scale)) != INFLLMV2_OK) return st;
  if (splits * total_q > INT32_MAX)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: splits * total_q must be at most %d, got %lld", op, INT32_MAX,
                (long long)(splits * total_q));
  return INFLLMV2_OK;
}

infllmv2_status check_workspace(const char* op, const char* size_fn, size_t workspace_size, size_t need) {
  if (workspace_size < need)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: workspace_size is %zu bytes, %s() asks for %zu", op,
                workspace_size, size_fn, need);
  return INFLLMV2_OK;
}

struct Partials {
  float* o;
  float* lse;
  int rows;  // splits x total_q
};

// What a split call launches: its forward unit (of `units`: fwd or kvcache), the combine unit,
// the grid and the partial buffers in the workspace.
template <class Unit>
struct SplitCall {
  const Unit* fwd = nullptr;
  const infllmv2_sparse_decode_combine_unit* comb = nullptr;
  int groups = 0, tokens = 0, tiles = 0;
  Partials part{};
};

template <class Unit, size_t N>
infllmv2_status prepare_split_call(const char* op, const Unit (&units)[N], const Device& dev, infllmv2_dtype dtype,
                                   int32_t head_dim, int32_t splits, int32_t heads, int32_t heads_k,
                                   int32_t max_seqlen_q, int64_t total_q, void* workspace, SplitCall<Unit>* call) {
  const std::string desc = config_desc(dtype, head_dim);
  auto match = [&](const auto& u) { return u.dtype == dtype && u.head_dim == head_dim; };
  infllmv2_status st;
  if ((st = pick_unit(op, units, dev, match, desc, &call->fwd)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_sparse_decode_combine_units, dev, match, desc, &call->comb)) != INFLLMV2_OK)
    return st;
  const Unit* fwd = call->fwd;
  if (fwd->max_splits < splits)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s runs at most %d splits, got %d", op, fwd->name, fwd->max_splits,
                splits);
  if (fwd->block_m != kTileRows || fwd->t_max != kTileTokens)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: %s has tiles of %d rows and %d tokens, this library expects %d, %d", op,
                fwd->name, fwd->block_m, fwd->t_max, kTileRows, kTileTokens);
  call->groups = heads / heads_k;
  call->tokens = tile_tokens(fwd->block_m, fwd->t_max, call->groups);
  call->tiles = (max_seqlen_q + call->tokens - 1) / call->tokens;
  call->part = {static_cast<float*>(workspace),
                reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                         align256(o_part_bytes(splits, total_q, heads, head_dim))),
                (int)(splits * total_q)};
  return INFLLMV2_OK;
}

infllmv2_status run_combine(const char* op, const infllmv2_sparse_decode_combine_unit* comb, const Partials& part,
                            const int32_t* cu_seqlens_q, void* out, float* lse, int32_t batch, int32_t splits,
                            int32_t heads, int64_t total_q, cudaStream_t stream) {
  int rc = comb->call(part.o, part.lse, const_cast<int32_t*>(cu_seqlens_q), out, lse, batch, splits, part.rows, heads,
                      batch + 1, (int)total_q, stream);
  return launch_result(op, comb->name, rc, comb->last_error);
}

}  // namespace

extern "C" INFLLMV2_API infllmv2_status infllmv2_sparse_decode(
    const void* q, const void* k, const void* v, const int32_t* topk_idx, const int32_t* cu_seqlens_q,
    const int32_t* cu_seqlens_k, void* out, float* lse, void* workspace, size_t workspace_size, int32_t batch,
    int64_t total_q, int64_t total_k, int32_t max_seqlen_q, int32_t heads, int32_t heads_k, int32_t head_dim,
    int32_t topk, int32_t splits, infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream) {
  static const char* op = "infllmv2_sparse_decode";
  clear_error();
  infllmv2_status st = check_split_args(op, dtype, head_dim, batch, heads, heads_k, topk, splits, total_q, total_k,
                                        max_seqlen_q, softmax_scale);
  if (st != INFLLMV2_OK) return st;
  if (splits == 1)  // one range per tile: the forward itself, no workspace
    return infllmv2_sparse_attn_fwd(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, out, lse, batch, total_q, total_k,
                                    max_seqlen_q, heads, heads_k, head_dim, topk, dtype, softmax_scale, stream);
  if (total_q > 0 && (st = check_workspace(op, "infllmv2_sparse_decode_workspace_size", workspace_size,
                                           decode_bytes(splits, total_q, heads, head_dim))) != INFLLMV2_OK)
    return st;
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(op, dev, {{"q", q}, {"topk_idx", topk_idx}, {"out", out}, {"lse", lse},
                                                           {"workspace", workspace}})) != INFLLMV2_OK)
    return st;
  if (total_k > 0 && (st = check_device_pointers(op, dev, {{"k", k}, {"v", v}})) != INFLLMV2_OK) return st;
  if ((st = check_aligned(op, {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"workspace", workspace}})) != INFLLMV2_OK)
    return st;

  SplitCall<infllmv2_sparse_decode_fwd_unit> c;
  if ((st = prepare_split_call(op, infllmv2_sparse_decode_fwd_units, dev, dtype, head_dim, splits, heads, heads_k,
                               max_seqlen_q, total_q, workspace, &c)) != INFLLMV2_OK)
    return st;
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;
  int rc = c.fwd->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<int32_t*>(topk_idx),
                       const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k), c.part.o, c.part.lse,
                       batch, c.tiles, c.groups, c.tokens, attn_scale_log2(softmax_scale, head_dim), splits,
                       (int)total_q, heads, (int)total_k, heads_k, topk, batch + 1, c.part.rows, stream);
  if ((st = launch_result(op, c.fwd->name, rc, c.fwd->last_error)) != INFLLMV2_OK) return st;
  return run_combine(op, c.comb, c.part, cu_seqlens_q, out, lse, batch, splits, heads, total_q, stream);
}

extern "C" INFLLMV2_API size_t infllmv2_sparse_decode_kvcache_workspace_size(int64_t total_q, int32_t heads,
                                                                             int32_t head_dim, int32_t splits) {
  if (total_q <= 0 || heads <= 0 || head_dim <= 0 || splits < 1) return 0;
  return partial_bytes(splits, total_q, heads, head_dim);
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_sparse_decode_kvcache(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table, const int32_t* cache_seqlens,
    const int32_t* topk_idx, const int32_t* cu_seqlens_q, void* out, float* lse, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int32_t max_seqlen_q, int64_t num_pages, int32_t page_size,
    int32_t pages_per_seq, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t topk, int32_t splits,
    infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream) {
  static const char* op = "infllmv2_sparse_decode_kvcache";
  clear_error();
  infllmv2_status st =
      check_cache_layout(op, block_table != nullptr, batch, num_pages, page_size, pages_per_seq, kBlock);
  if (st != INFLLMV2_OK) return st;
  const int64_t cache_rows = num_pages * page_size;
  if ((st = check_split_args(op, dtype, head_dim, batch, heads, heads_k, topk, splits, total_q, cache_rows,
                             max_seqlen_q, softmax_scale)) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_workspace(op, "infllmv2_sparse_decode_kvcache_workspace_size", workspace_size,
                                           partial_bytes(splits, total_q, heads, head_dim))) != INFLLMV2_OK)
    return st;
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cache_seqlens", cache_seqlens},
                                            {"k_cache", k_cache}, {"v_cache", v_cache}})) != INFLLMV2_OK)
    return st;
  if (block_table != nullptr && (st = check_device_pointers(op, dev, {{"block_table", block_table}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(op, dev, {{"q", q}, {"topk_idx", topk_idx}, {"out", out}, {"lse", lse},
                                                           {"workspace", workspace}})) != INFLLMV2_OK)
    return st;
  if ((st = check_aligned(op, {{"q", q}, {"k_cache", k_cache}, {"v_cache", v_cache}, {"out", out},
                               {"workspace", workspace}})) != INFLLMV2_OK)
    return st;

  SplitCall<infllmv2_sparse_decode_kvcache_unit> c;
  if ((st = prepare_split_call(op, infllmv2_sparse_decode_kvcache_units, dev, dtype, head_dim, splits, heads, heads_k,
                               max_seqlen_q, total_q, workspace, &c)) != INFLLMV2_OK)
    return st;
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;
  const CacheTable t = cache_table(block_table, cache_seqlens, batch, pages_per_seq);
  int rc = c.fwd->call(const_cast<void*>(q), const_cast<void*>(k_cache), const_cast<void*>(v_cache),
                       const_cast<int32_t*>(topk_idx), const_cast<int32_t*>(cu_seqlens_q), t.table,
                       const_cast<int32_t*>(cache_seqlens), c.part.o, c.part.lse, c.tiles, c.groups, c.tokens,
                       attn_scale_log2(softmax_scale, head_dim), splits, page_size, pages_per_seq, (int)num_pages,
                       (int)total_q, heads, (int)cache_rows, heads_k, topk, batch + 1, t.len, batch, c.part.rows,
                       stream);
  if ((st = launch_result(op, c.fwd->name, rc, c.fwd->last_error)) != INFLLMV2_OK) return st;
  return run_combine(op, c.comb, c.part, cu_seqlens_q, out, lse, batch, splits, heads, total_q, stream);
}
