// The split-KV machinery infllmv2_sparse_decode(_kvcache) and infllmv2_dense_decode_kvcache
// share: the partial buffers in the workspace, the unit checks, and the combine launch.
#pragma once
#include <cstdint>
#include <string>

#include "registry.h"
#include "runtime.h"

namespace infllmv2 {
namespace split_decode {

constexpr int kTileRows = 64;   // dsl BLOCK_M: a tile is min(64 / G, kTileTokens) tokens x G heads
constexpr int kTileTokens = 4;  // dsl T_MAX, checked against the unit at launch
constexpr int kBlock = 64;      // keys a block (dsl BLOCK_N): a page must not split one

// Workspace: O partials fp32 (splits x total_q, heads, head_dim), then at a 256-byte boundary
// the LSE partials fp32 (heads, splits x total_q).
inline size_t o_part_bytes(int splits, int64_t total_q, int32_t heads, int32_t head_dim) {
  return (size_t)splits * (size_t)total_q * (size_t)heads * (size_t)head_dim * sizeof(float);
}
inline size_t partial_bytes(int splits, int64_t total_q, int32_t heads, int32_t head_dim) {
  return align256(o_part_bytes(splits, total_q, heads, head_dim)) +
         (size_t)splits * (size_t)total_q * (size_t)heads * sizeof(float);
}
inline size_t decode_bytes(int splits, int64_t total_q, int32_t heads, int32_t head_dim) {
  return splits <= 1 ? 0 : partial_bytes(splits, total_q, heads, head_dim);
}

// Thread blocks of query tiles a call has before it splits: tiles x batch x heads_k (0 for a bad
// head layout, which the op's checks report).
inline int64_t ctas_of(int32_t batch, int32_t max_seqlen_q, int32_t heads, int32_t heads_k) {
  if (heads_k <= 0 || heads % heads_k != 0) return 0;
  const int groups = heads / heads_k;
  if (groups < 1 || groups > 64) return 0;
  const int T = tile_tokens(kTileRows, kTileTokens, groups);
  return (int64_t)((max_seqlen_q + T - 1) / T) * batch * heads_k;
}

// The split count a call runs (1 .. max_splits; splits_fn: the entry point that picks it), the
// token counts, and the partial rows splits x total_q within the units' int32 indices.
inline infllmv2_status check_split_sizes(const char* op, const char* splits_fn, int32_t splits, int max_splits,
                                         int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
                                         float softmax_scale) {
  if (splits < 1 || splits > max_splits)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: splits must be in [1, %d] (%s() picks it), got %d", op,
                max_splits, splits_fn, splits);
  infllmv2_status st = check_attn_sizes(op, total_q, total_k, max_seqlen_q, 0, softmax_scale);
  if (st != INFLLMV2_OK) return st;
  if (splits * total_q > INT32_MAX)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: splits * total_q must be at most %d, got %lld", op, INT32_MAX,
                (long long)(splits * total_q));
  return INFLLMV2_OK;
}

// The device pointers a split call over a KV cache takes, and the alignment of those TMA and the
// vector loads read; topk_idx only with `selection` (sparse_decode_kvcache's).
inline infllmv2_status check_cache_call_pointers(const char* op, const Device& dev, int64_t total_q, const void* q,
                                                 const void* k_cache, const void* v_cache,
                                                 const int32_t* block_table, const int32_t* cache_seqlens,
                                                 const int32_t* cu_seqlens_q, bool selection,
                                                 const int32_t* topk_idx, const void* out, const float* lse,
                                                 const void* workspace) {
  infllmv2_status st = check_device_pointers(
      op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cache_seqlens", cache_seqlens}, {"k_cache", k_cache},
                {"v_cache", v_cache}});
  if (st == INFLLMV2_OK && block_table != nullptr)
    st = check_device_pointers(op, dev, {{"block_table", block_table}});
  if (st == INFLLMV2_OK && total_q > 0) {
    st = check_device_pointers(op, dev, {{"q", q}});
    if (st == INFLLMV2_OK && selection) st = check_device_pointers(op, dev, {{"topk_idx", topk_idx}});
    if (st == INFLLMV2_OK)
      st = check_device_pointers(op, dev, {{"out", out}, {"lse", lse}, {"workspace", workspace}});
  }
  if (st == INFLLMV2_OK)
    st = check_aligned(op, {{"q", q}, {"k_cache", k_cache}, {"v_cache", v_cache}, {"out", out},
                            {"workspace", workspace}});
  return st;
}

inline infllmv2_status check_workspace(const char* op, const char* size_fn, size_t workspace_size, size_t need) {
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

inline infllmv2_status run_combine(const char* op, const infllmv2_sparse_decode_combine_unit* comb, const Partials& part,
                            const int32_t* cu_seqlens_q, void* out, float* lse, int32_t batch, int32_t splits,
                            int32_t heads, int64_t total_q, cudaStream_t stream) {
  int rc = comb->call(part.o, part.lse, const_cast<int32_t*>(cu_seqlens_q), out, lse, batch, splits, part.rows, heads,
                      batch + 1, (int)total_q, stream);
  return launch_result(op, comb->name, rc, comb->last_error);
}

}  // namespace split_decode
}  // namespace infllmv2
