// infllmv2_sparse_decode: stage 2's forward split over the selected blocks (split-KV decoding).
#include <cstdint>
#include <string>

#include "registry.h"
#include "runtime.h"
#include "split_decode.h"

using namespace infllmv2;
using namespace infllmv2::split_decode;

namespace {

constexpr int kMaxTopk = 128;  // as infllmv2_sparse_attn_fwd
constexpr int kMaxSplits = 64;  // dsl/sparse_decode.py MAX_SPLITS
// A split walks at least this many blocks of its tile's union: fewer would spend more on the
// union prologue and the partial results than they save.
constexpr int kMinBlocksPerSplit = 4;

// The split rule is resolve_splits' (runtime.h) with at least kMinBlocksPerSplit blocks a split.
// 1 means the call is infllmv2_sparse_attn_fwd's, with no workspace. (H100, one token a
// sequence, K = 96, G = 16, CUDA graphs: batch 1, 8, 32 ran fastest at 24-32, 16 and 4 splits,
// what this picks, within 5%: 24, 16, 4; rounding up instead had picked 17 and 5, 11% and 4%
// slower; benchmarks/NOTES.md.)
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
  return check_split_sizes(op, "infllmv2_sparse_decode_splits", splits, kMaxSplits, total_q, total_k, max_seqlen_q,
                           softmax_scale);
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
  if ((st = check_cache_call_pointers(op, dev, total_q, q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q,
                                      true, topk_idx, out, lse, workspace)) != INFLLMV2_OK)
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
