// Stage 0 as stage 1 needs it from the raw keys: the compression that
// infllmv2_select_blocks_from_keys and infllmv2_select_decode run before their selection.
#pragma once

#include <cstddef>
#include <cstdint>

#include "infllmv2.h"

namespace infllmv2 {

// The stage-1 kernels' DSL build parameters (dsl/select_blocks.py).
constexpr int kFineW = 32, kFineS = 16, kBlock = 64;

// Compressed keys of `len` keys with window w and stride s.
inline int64_t windows(int64_t len, int w, int s) { return len >= w ? (len - w) / s + 1 : 0; }

// A compressed cache (batch, capacity_c, ...) must hold the compressed keys (window w, stride s)
// of a full KV cache of `capacity` keys, so that no length is read on the host, and its rows
// must be indexable in int32. `name` is the C argument (capacity_c, capacity_n).
infllmv2_status check_compressed_capacity(const char* op, const char* name, int32_t capacity_c, int64_t capacity,
                                          int w, int s, int32_t batch);

// One compressed cache that compress_kvcache_levels brings up to date, and the C argument names
// its errors use.
struct CompressedLevel {
  void* cache;
  int32_t capacity_c, window, stride;
  const char *cache_name, *capacity_name, *window_name, *stride_name;
};

// infllmv2_compress_keys_kvcache for one or two compressed caches of the same KV cache in one
// launch (a decoding step's fine and normaliser keys; each level's update is a chain of dependent
// loads that a second launch would only repeat after the first), with PHSA for both where
// punct_cache is not NULL. Checks every argument.
infllmv2_status compress_kvcache_levels(const char* op, const void* k_cache, const int32_t* block_table,
                                        const int32_t* cache_seqlens, const uint8_t* punct_cache, float phsa_lambda,
                                        const CompressedLevel* levels, int n_levels,
                                        int32_t batch, int64_t num_pages, int32_t page_size, int32_t pages_per_seq,
                                        int32_t new_keys, int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype,
                                        cudaStream_t stream);

template <class T>
T* at(void* base, size_t offset) { return reinterpret_cast<T*>(static_cast<char*>(base) + offset); }

// Where compress_for_selection left the keys (in the workspace), sized by the bounds total_c / total_n.
struct CompressedKeys {
  const void* ck;
  const void* nk;  // NULL for the exact normaliser
  const int32_t* cu_c;
  const int32_t* cu_n;
  int64_t total_c, total_n;
};

// Bytes at the start of the workspace that compress_for_selection uses.
size_t select_from_keys_bytes(int32_t batch, int64_t total_k, int32_t heads_k, int32_t head_dim, bool approx_lse,
                              int32_t norm_kernel_stride);

// Checks what sizes the workspace (which must hold select_from_keys_bytes() + extra_bytes, the
// caller's own part; `size_fn` names the query an error points to), then runs the offsets and
// the compression of the fine keys and, with approx_lse, of the normaliser keys.
infllmv2_status compress_for_selection(const char* op, const char* size_fn, const void* q, const void* k,
                                       const int32_t* cu_seqlens_k, const uint8_t* punct_mask, float phsa_lambda,
                                       void* workspace, size_t workspace_size, size_t extra_bytes, int32_t batch,
                                       int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads_k,
                                       int32_t head_dim, int32_t approx_lse, int32_t norm_kernel_size,
                                       int32_t norm_kernel_stride, infllmv2_dtype dtype, cudaStream_t stream,
                                       CompressedKeys* out);

}  // namespace infllmv2
