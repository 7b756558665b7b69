// infllmv2_dense_decode_kvcache: dense causal attention of few queries a sequence over a KV
// cache, split over the keys (split-KV decoding), for caches of any length.
#include <cstdint>

#include "registry.h"
#include "runtime.h"
#include "split_decode.h"

using namespace infllmv2;
using namespace infllmv2::split_decode;

namespace {

constexpr const char* kOp = "infllmv2_dense_decode_kvcache";
constexpr int kMaxSplits = 128;  // dsl/dense_decode.py MAX_SPLITS
// A split walks at least this many key blocks: fewer would spend more on the query tile's load
// and the partial results than they save.
constexpr int kMinBlocksPerSplit = 4;
// The most splits the library picks itself. H200, one token a sequence, G = 16, Hk = 2, forced
// counts 2-128 (bench_dense_decode_kvcache.py): the rule below picks the fastest count at every
// batch >= 8 and up to 8K keys at batch 1, but 128 at 32K and 128K x 1, where 64 was 21% and 5%
// faster (the combine's loop over the splits and the partial results grow with them).
constexpr int kMaxAutoSplits = 64;

}  // namespace

extern "C" INFLLMV2_API int32_t infllmv2_dense_decode_kvcache_splits(int32_t batch, int32_t max_seqlen_q,
                                                                     int32_t heads, int32_t heads_k,
                                                                     int32_t max_seqlen_k, int32_t num_splits) {
  if (num_splits < 0 || max_seqlen_k < 0) return 0;
  int sms = 0;
  if (num_splits == 0 && device_sms("infllmv2_dense_decode_kvcache_splits", &sms) != INFLLMV2_OK) return 0;
  const int64_t blocks = ((int64_t)max_seqlen_k + kBlock - 1) / kBlock;
  return resolve_splits(num_splits, ctas_of(batch, max_seqlen_q, heads, heads_k),
                        (blocks + kMinBlocksPerSplit - 1) / kMinBlocksPerSplit, sms,
                        num_splits > 0 ? kMaxSplits : kMaxAutoSplits);
}

extern "C" INFLLMV2_API size_t infllmv2_dense_decode_kvcache_workspace_size(int64_t total_q, int32_t heads,
                                                                            int32_t head_dim, int32_t splits) {
  if (total_q <= 0 || heads <= 0 || head_dim <= 0 || splits < 1) return 0;
  return partial_bytes(splits, total_q, heads, head_dim);
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_dense_decode_kvcache(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table, const int32_t* cache_seqlens,
    const int32_t* cu_seqlens_q, void* out, float* lse, void* workspace, size_t workspace_size, int32_t batch,
    int64_t total_q, int32_t max_seqlen_q, int64_t num_pages, int32_t page_size, int32_t pages_per_seq,
    int32_t heads, int32_t heads_k, int32_t head_dim, int32_t splits, infllmv2_dtype dtype, float softmax_scale,
    cudaStream_t stream) {
  clear_error();
  infllmv2_status st =
      check_cache_layout(kOp, block_table != nullptr, batch, num_pages, page_size, pages_per_seq, kBlock);
  if (st == INFLLMV2_OK) st = check_group_layout(kOp, dtype, head_dim, batch, heads, heads_k);
  if (st != INFLLMV2_OK) return st;
  const int64_t cache_rows = num_pages * page_size;
  if ((st = check_split_sizes(kOp, "infllmv2_dense_decode_kvcache_splits", splits, kMaxSplits, total_q, cache_rows,
                              max_seqlen_q, softmax_scale)) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_workspace(kOp, "infllmv2_dense_decode_kvcache_workspace_size", workspace_size,
                                           partial_bytes(splits, total_q, heads, head_dim))) != INFLLMV2_OK)
    return st;
  Device dev;
  if ((st = current_device(kOp, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_cache_call_pointers(kOp, dev, total_q, q, k_cache, v_cache, block_table, cache_seqlens,
                                      cu_seqlens_q, false, nullptr, out, lse, workspace)) != INFLLMV2_OK)
    return st;

  SplitCall<infllmv2_dense_decode_kvcache_unit> c;
  if ((st = prepare_split_call(kOp, infllmv2_dense_decode_kvcache_units, dev, dtype, head_dim, splits, heads, heads_k,
                               max_seqlen_q, total_q, workspace, &c)) != INFLLMV2_OK)
    return st;
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;
  const CacheTable t = cache_table(block_table, cache_seqlens, batch, pages_per_seq);
  int rc = c.fwd->call(const_cast<void*>(q), const_cast<void*>(k_cache), const_cast<void*>(v_cache),
                       const_cast<int32_t*>(cu_seqlens_q), t.table, const_cast<int32_t*>(cache_seqlens), c.part.o,
                       c.part.lse, c.tiles, c.groups, c.tokens, attn_scale_log2(softmax_scale, head_dim), splits,
                       page_size, pages_per_seq, (int)num_pages, (int)total_q, heads, (int)cache_rows, heads_k,
                       batch + 1, t.len, batch, c.part.rows, stream);
  if ((st = launch_result(kOp, c.fwd->name, rc, c.fwd->last_error)) != INFLLMV2_OK) return st;
  return run_combine(kOp, c.comb, c.part, cu_seqlens_q, out, lse, batch, splits, heads, total_q, stream);
}
