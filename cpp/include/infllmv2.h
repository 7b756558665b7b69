/*
 * infllmv2.h: the C ABI of the InfLLM-V2 sparse attention kernels.
 *
 * The library needs neither PyTorch nor TileLang at run time: only the CUDA driver (the CUDA
 * runtime is linked in statically). Every function returns an infllmv2_status; on failure
 * infllmv2_last_error() (per thread) holds a message naming the argument and what was
 * expected. No function synchronises the host with the device, and all work is ordered on the
 * stream the caller passes: two calls also run part of it on a second stream of the calling
 * thread, forked from the caller's stream and joined back into it before they return
 * (infllmv2_sparse_attn_bwd's member lists, infllmv2_attention_kvcache's compressed-cache
 * update), which in a captured CUDA graph becomes a parallel branch. A thread makes that stream
 * at its first such call outside a capture; a capture in a thread that has none keeps the work
 * on the caller's stream (same results).
 *
 * Conventions (see SPEC.md of the project for the full contract):
 *   - Packed variable-length ("varlen") layout, as in FlashAttention: a batch of B sequences
 *     is stored back to back; cu_seqlens_x is an int32 device array of B+1 offsets
 *     (cu_seqlens_x[0] = 0, non-decreasing, cu_seqlens_x[B] = total_x).
 *   - Offsets, lengths, block tables and selections are read on the device only, so no call
 *     can check them against the sizes it is given. Values that disagree with those sizes give
 *     wrong results, never an access outside the buffers (tests/test_sanitizer.py, memcheck).
 *     Each kernel clamps the spans it reads into its tensors (a start into [0, total], an end
 *     into [start, total]), so a call's work is bounded by the tensor sizes, not by the lengths
 *     the offsets claim: offsets near 2^31 return as quickly as offsets that give every
 *     sequence the whole tensor. Lengths the call is given (max_seqlen_*) size the grids.
 *   - Keys k: (total_k, heads_k, head_dim), contiguous, row-major, in device memory of the
 *     current device.
 *   - dtype: bf16 or fp16 inputs, fp32 accumulation.
 *
 * Arch dispatch: the library holds kernel variants per GPU arch (build_info lists them). A
 * call picks the best variant for the current device: sm_90a code on compute capability 9.0
 * only, otherwise the newest arch <= the device's (sm_89 on 8.9, sm_80 on 8.0/8.6/8.7), whose
 * embedded PTX is compiled by the driver on newer GPUs; a variant whose shared memory exceeds
 * the device's per-block limit is never picked. infllmv2_set_arch_override() (or the
 * environment variable INFLLMV2_FORCE_ARCH, read at load) forces one arch, to check the
 * sm_80 and sm_89 variants on a Hopper GPU through their PTX.
 *
 * Support matrix of this version:
 *   op               dtype      head_dim  heads                    archs
 *   compress_keys    bf16,fp16  64,128    any heads_k <= 65535     sm_80, sm_89, sm_90a (+PTX)
 *   sparse_attn_fwd  bf16,fp16  64,128    G = heads/heads_k <= 64  sm_80, sm_89, sm_90a (+PTX)
 *   sparse_attn_bwd  bf16,fp16  64,128    G <= 64, deterministic   sm_80, sm_89, sm_90a (+PTX)
 *   sparse_decode    bf16,fp16  64,128    G <= 64, split-KV        sm_80, sm_89, sm_90a (+PTX)
 *     _kvcache       bf16,fp16  64,128    G <= 64, padded or paged sm_80, sm_89, sm_90a (+PTX)
 *   select_blocks    bf16,fp16  64,128    G <= 64                  sm_80, sm_89, sm_90a (+PTX)
 *   select_decode    bf16,fp16  64,128    G <= 64, split keys      sm_80, sm_89, sm_90a (+PTX)
 *   group_scores     bf16,fp16  64,128    G <= 64                  sm_80, sm_89, sm_90a (+PTX)
 *   max_pool_blocks  fp32       -         any heads_k <= 65535     sm_80, sm_89, sm_90a (+PTX)
 *   dense_attn_fwd   bf16,fp16  64,128    G <= 64                  sm_80, sm_89, sm_90a (+PTX)
 *   dense_attn_bwd   bf16,fp16  64,128    G <= 64, deterministic   sm_80, sm_89, sm_90a (+PTX)
 *   attention_fwd    bf16,fp16  64,128    G <= 64, K <= 128        sm_80, sm_89, sm_90a (+PTX)
 *   attention_bwd    bf16,fp16  64,128    G <= 64, K <= 128        sm_80, sm_89, sm_90a (+PTX)
 */
#ifndef INFLLMV2_H_
#define INFLLMV2_H_

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define INFLLMV2_API __declspec(dllexport)
#else
#define INFLLMV2_API __attribute__((visibility("default")))
#endif

/* Bumped on any incompatible change of a signature or of a struct/enum value. */
#define INFLLMV2_ABI_VERSION 5

typedef enum {
  INFLLMV2_OK = 0,
  INFLLMV2_ERR_INVALID_ARGUMENT = 1, /* a null pointer, a bad size, a host pointer, ...      */
  INFLLMV2_ERR_UNSUPPORTED = 2,      /* a valid request this build has no kernel for        */
  INFLLMV2_ERR_UNSUPPORTED_ARCH = 3, /* the current GPU's arch is not compiled in           */
  INFLLMV2_ERR_CUDA = 4              /* the CUDA runtime reported an error                  */
} infllmv2_status;

typedef enum {
  INFLLMV2_DTYPE_BF16 = 0,
  INFLLMV2_DTYPE_FP16 = 1,
  INFLLMV2_DTYPE_FP32 = 2  /* scores and block scores only */
} infllmv2_dtype;

/* INFLLMV2_ABI_VERSION of the library actually loaded; compare with the header's. */
INFLLMV2_API int infllmv2_abi_version(void);

/* The library's version string, e.g. "0.1.0". */
INFLLMV2_API const char* infllmv2_version(void);

/* A JSON object: version, abi_version, cuda_runtime, tilelang, archs compiled in, and every
 * kernel unit (name, arch, threads, dynamic shared memory). Static storage; works without a GPU. */
INFLLMV2_API const char* infllmv2_build_info(void);

/* The message of the last failed call on this thread ("" if none). */
INFLLMV2_API const char* infllmv2_last_error(void);

/* Forces every later call (all threads) to use the variants of one arch, e.g. "sm_80";
 * NULL or "" restores automatic dispatch. INFLLMV2_ERR_UNSUPPORTED_ARCH if the arch is not
 * compiled in. For testing: the forced variant must be able to run on the device. */
INFLLMV2_API infllmv2_status infllmv2_set_arch_override(const char* arch);

/* The arch that a call on the current device would use now (e.g. "sm_90a"), or NULL with
 * the reason in infllmv2_last_error(). */
INFLLMV2_API const char* infllmv2_selected_arch(void);

/*
 * infllmv2_compress_keys: stage 0, mean-pooled compressed keys ("semantic kernels").
 *
 *   For each sequence b (length L = cu_seqlens_k[b+1] - cu_seqlens_k[b]) and KV head h:
 *     ck[cu_seqlens_c[b] + j, h] = mean(k[cu_seqlens_k[b] + j*s + t, h], t = 0 .. w-1)
 *     for j = 0 .. n_b - 1, n_b = (L - w) / s + 1 if L >= w else 0,
 *   with w = kernel_size, s = kernel_stride. With punct_mask (PHSA):
 *     ck = lam * mean(window) + (1 - lam) * mean(punctuation tokens of the window),
 *   the plain mean where the window holds no punctuation token.
 *
 *   [in]  k             (total_k, heads_k, head_dim), dtype
 *   [in]  cu_seqlens_k  int32 (batch + 1)
 *   [in]  cu_seqlens_c  int32 (batch + 1): offsets of the n_b above (the caller computes them)
 *   [in]  punct_mask    uint8 (total_k), nonzero = punctuation; NULL for the plain mean
 *   [in]  phsa_lambda   weight lam in [0, 1] (ignored without punct_mask)
 *   [out] ck            (total_c, heads_k, head_dim), dtype
 *   [in]  batch         B >= 1 (<= 65535)
 *   [in]  total_k, total_c  row counts of k and ck (< 2^31)
 *   [in]  max_nc        max over b of n_b (sizes the grid)
 *   [in]  heads_k       >= 1 (<= 65535); head_dim 64 or 128
 *   [in]  kernel_size, kernel_stride  w >= 1, s >= 1 (32/16 fine, 128/64 coarse)
 *   [in]  stream        the stream to run on
 *   k and ck 16-byte aligned (rows move by 16-byte vector loads and stores).
 *   No workspace. Rows are bounds-checked against total_k / total_c on the device, so
 *   inconsistent cu_seqlens give wrong values, never an out-of-bounds access.
 */
INFLLMV2_API infllmv2_status infllmv2_compress_keys(
    const void* k, const int32_t* cu_seqlens_k, const int32_t* cu_seqlens_c,
    const uint8_t* punct_mask, float phsa_lambda, void* ck,
    int32_t batch, int64_t total_k, int64_t total_c, int32_t max_nc,
    int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype,
    int32_t kernel_size, int32_t kernel_stride, cudaStream_t stream);

/*
 * infllmv2_attention_compressed_offsets: the cu_seqlens_c that infllmv2_compress_keys takes,
 * computed on the device (no host synchronisation):
 *   cu_seqlens_c[0] = 0, cu_seqlens_c[b + 1] = cu_seqlens_c[b] + n_b,
 *   n_b = (L_b - w) / s + 1 if L_b >= w else 0, L_b = cu_seqlens_k[b + 1] - cu_seqlens_k[b].
 *
 *   [in]  cu_seqlens_k  int32 (batch + 1), device
 *   [out] cu_seqlens_c  int32 (batch + 1), device
 *   [in]  batch         B >= 1 (<= 65535)
 *   [in]  kernel_size, kernel_stride  w >= 1, s >= 1
 *   [in]  stream        the stream to run on
 * The sum is bounded by total_k / s + batch, which sizes ck when the lengths are not read.
 */
INFLLMV2_API infllmv2_status infllmv2_attention_compressed_offsets(
    const int32_t* cu_seqlens_k, int32_t* cu_seqlens_c, int32_t batch, int32_t kernel_size,
    int32_t kernel_stride, cudaStream_t stream);

/*
 * infllmv2_compress_keys_kvcache: stage 0 kept up to date over a KV cache (SPEC.md, Decode). For
 * each sequence b (L = cache_seqlens[b] keys, clamped to the capacity) and KV head h, writes
 *     ck_cache[b, j, h] = mean(k of keys j*s .. j*s + w - 1 of sequence b, h)
 * for the entries j in [n(max(L - new_keys, 0)), n(L)) that the last new_keys keys completed
 * (n(x) = (x - w) / s + 1 if x >= w else 0), and leaves every other entry as it is. A decoding
 * step that appended one key a sequence passes new_keys = 1 (at most one entry a sequence and
 * level); a prefill into an empty cache passes its length and writes them all; recomputing an
 * entry gives the same bits. For w = 32, s = 16 and w = 128, s = 64 (and any w, s whose gcd is
 * 1) the entries are bitwise those infllmv2_compress_keys writes from the same keys packed.
 *
 *   [in]  k_cache       (num_pages, page_size, heads_k, head_dim), dtype, contiguous; key t of
 *                       sequence b as for infllmv2_sparse_decode_kvcache (padded: block_table
 *                       NULL, pages_per_seq 0, row t of page b; paged: row t % page_size of page
 *                       block_table[b * pages_per_seq + t / page_size], page numbers clamped into
 *                       the cache, page_size a multiple of 64 with several pages a sequence)
 *   [in]  cache_seqlens int32 (batch), device memory, the lengths after the new keys
 *   [out] ck_cache      (batch, capacity_c, heads_k, head_dim), dtype, contiguous
 *   [in]  capacity_c    at least n(capacity), the capacity being page_size (padded) or
 *                       pages_per_seq x page_size; batch x capacity_c < 2^31
 *   [in]  new_keys      >= 0: keys each sequence gained since ck_cache was last brought up to
 *                       date (an upper bound; 0 does nothing)
 *   [in]  punct_cache   uint8 (num_pages, page_size), device memory: each cached key's
 *                       punctuation flag (nonzero = punctuation), laid out as k_cache's rows;
 *                       NULL for the plain mean. With it (PHSA) an entry is
 *                       lam * mean(window) + (1 - lam) * mean(punctuation keys of the window),
 *                       the plain mean where the window holds none: bitwise the entry
 *                       infllmv2_compress_keys writes with punct_mask from the same keys and flags
 *                       packed (every w, s).
 *   [in]  phsa_lambda   lam in [0, 1] (ignored without punct_cache)
 *   [in]  kernel_size, kernel_stride  w >= 1, s >= 1 (32/16 fine, 128/64 coarse)
 *   k_cache and ck_cache 16-byte aligned. No workspace, no host synchronisation: usable inside
 *   CUDA graphs. (ABI 4 added punct_cache and phsa_lambda.)
 */
INFLLMV2_API infllmv2_status infllmv2_compress_keys_kvcache(
    const void* k_cache, const int32_t* block_table, const int32_t* cache_seqlens, const uint8_t* punct_cache,
    float phsa_lambda, void* ck_cache, int32_t batch,
    int64_t num_pages, int32_t page_size, int32_t pages_per_seq, int32_t capacity_c, int32_t new_keys,
    int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype, int32_t kernel_size, int32_t kernel_stride,
    cudaStream_t stream);

/*
 * infllmv2_sparse_attn_fwd: stage 2, block-sparse attention over selected 64-key blocks.
 *
 *   For query i of sequence b (Lq queries, Lk keys; position p = Lk - Lq + i) and query head
 *   h of KV head g = h / G (G = heads / heads_k):
 *     out[i, h] = sum_t softmax_t(scale * q[i, h] . k[t, g]) v[t, g]
 *     lse[h, i] = log sum_t exp(scale * q[i, h] . k[t, g])            (natural log)
 *   over keys t (per-sequence index) with t / 64 in topk_idx[g, i, :] and t <= p. An empty
 *   set gives out = 0 and lse = -inf.
 *
 *   [in]  q            (total_q, heads, head_dim), dtype
 *   [in]  k, v         (total_k, heads_k, head_dim), dtype
 *   [in]  topk_idx     int32 (heads_k, total_q, topk): per-sequence block indices, each row
 *                      ASCENDING over its valid entries with -1 padding after them (the format
 *                      selection writes). Entries beyond the query's own block are ignored.
 *   [in]  cu_seqlens_q, cu_seqlens_k  int32 (batch + 1)
 *   [out] out          (total_q, heads, head_dim), dtype
 *   [out] lse          fp32 (heads, total_q)
 *   [in]  max_seqlen_q the longest query sequence (sizes the grid)
 *   [in]  topk         1 .. 128; head_dim 64 or 128; heads % heads_k == 0, G <= 64
 *   [in]  softmax_scale  0 for 1/sqrt(head_dim)
 *   q, k, v and out must be 16-byte aligned (INFLLMV2_ERR_INVALID_ARGUMENT otherwise).
 *   No workspace. No host synchronisation: usable inside CUDA graphs.
 */
INFLLMV2_API infllmv2_status infllmv2_sparse_attn_fwd(
    const void* q, const void* k, const void* v, const int32_t* topk_idx, const int32_t* cu_seqlens_q,
    const int32_t* cu_seqlens_k, void* out, float* lse, int32_t batch, int64_t total_q, int64_t total_k,
    int32_t max_seqlen_q, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t topk,
    infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/* Bytes of device workspace infllmv2_sparse_attn_bwd needs: fp32 rowsum(dout * out), heads x
 * total_q, and the same with each row's lse beside it, total_q x heads x 2 (the layout the dk/dv
 * kernel reads: a token's heads adjacent); the inverse index of topk_idx that the dk/dv kernel
 * walks (int32: per KV head, each key block's list of the queries that picked it, heads_k x
 * total_q x topk entries; the lists' offsets, heads_k x (total_k / 64 + batch + 1); and the
 * counts they are built from, heads_k x 64 x (total_k / 64 + batch)) and, when total_q > 8192,
 * fp32 partial dK/dV of the first 4 key blocks of sequences of more than 8192 queries (4 x
 * heads_k x ceil(total_q / 8192) x 2 x 2 x 64 x 128 floats; these blocks, which every query's
 * init block lands in, are shared among several thread blocks). 0 for a non-positive size. (ABI 2
 * added heads_k and max_seqlen_k; ABI 3 replaced max_seqlen_k with total_k, batch and topk.) */
INFLLMV2_API size_t infllmv2_sparse_attn_bwd_workspace_size(int64_t total_q, int64_t total_k, int32_t batch,
                                                            int32_t heads, int32_t heads_k, int32_t topk);

/*
 * infllmv2_sparse_attn_bwd: gradients of infllmv2_sparse_attn_fwd with the selection held
 * constant: dq (total_q, heads, head_dim), dk and dv (total_k, heads_k, head_dim) summed over
 * the G query heads of each group, all in dtype. Keys no query selected get exactly zero.
 *
 *   [in]  out, lse     what infllmv2_sparse_attn_fwd returned for these inputs
 *   [in]  dout         (total_q, heads, head_dim), dtype
 *   [in]  workspace    device memory of at least infllmv2_sparse_attn_bwd_workspace_size()
 *   [in]  max_seqlen_k the longest key sequence (sizes the key-block grid)
 *   Other arguments as for the forward; q, k, v, out, dout, dq, dk and dv 16-byte aligned.
 *   Deterministic: no atomics, every gradient element is summed in a fixed order (by one thread
 *   block, or for the first key blocks of long sequences from fixed pieces in piece order), so
 *   repeated calls are bitwise identical.
 */
INFLLMV2_API infllmv2_status infllmv2_sparse_attn_bwd(
    const void* q, const void* k, const void* v, const void* out, const void* dout, const float* lse,
    const int32_t* topk_idx, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, void* dq, void* dk,
    void* dv, void* workspace, size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k,
    int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim,
    int32_t topk, infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/*
 * infllmv2_sparse_decode: infllmv2_sparse_attn_fwd's result (out, lse) for calls whose query
 * tiles alone leave the GPU idle, above all decoding (one or a few queries a sequence against a
 * long key cache): each tile's selected blocks are cut into `splits` contiguous ranges run by
 * their own thread blocks, whose partial results a second kernel merges (split-KV decoding).
 * Arguments as for infllmv2_sparse_attn_fwd, plus:
 *   [in]  splits       1 .. 64, from infllmv2_sparse_decode_splits(); 1 runs
 *                      infllmv2_sparse_attn_fwd itself (no workspace, its result bitwise)
 *   [in]  workspace    device memory of at least infllmv2_sparse_decode_workspace_size()
 *                      bytes (may be NULL when that is 0), 16-byte aligned
 *   With splits > 1 the sums run in another order than the forward's (not bitwise equal to it)
 *   but in a fixed one: repeated calls are bitwise identical. No host synchronisation: usable
 *   inside CUDA graphs. Forward only (infllmv2_sparse_attn_bwd takes the forward's out and lse,
 *   or these).
 */
INFLLMV2_API infllmv2_status infllmv2_sparse_decode(
    const void* q, const void* k, const void* v, const int32_t* topk_idx, const int32_t* cu_seqlens_q,
    const int32_t* cu_seqlens_k, void* out, float* lse, void* workspace, size_t workspace_size, int32_t batch,
    int64_t total_q, int64_t total_k, int32_t max_seqlen_q, int32_t heads, int32_t heads_k, int32_t head_dim,
    int32_t topk, int32_t splits, infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/* The splits infllmv2_sparse_decode should run for this call on the current device: num_splits
 * itself (at most 64) when > 0; when 0, 1 if the query tiles (ceil(max_seqlen_q / min(64 / G,
 * 4)) a sequence and KV head) alone fill the device's multiprocessors, else the most that keep
 * tiles x splits within twice the multiprocessors, each split keeping at least 4 of the K
 * selected blocks. 0 on a bad argument (num_splits < 0, topk < 1) or when no device can be
 * queried. */
INFLLMV2_API int32_t infllmv2_sparse_decode_splits(int32_t batch, int32_t max_seqlen_q, int32_t heads,
                                                   int32_t heads_k, int32_t topk, int32_t num_splits);

/* Bytes of device workspace infllmv2_sparse_decode needs with `splits`: 0 for splits <= 1;
 * else fp32 partial outputs (splits x total_q, heads, head_dim) and, from the next 256-byte
 * boundary, fp32 partial LSEs (heads, splits x total_q). */
INFLLMV2_API size_t infllmv2_sparse_decode_workspace_size(int64_t total_q, int32_t heads, int32_t head_dim,
                                                          int32_t splits);

/*
 * infllmv2_sparse_decode_kvcache: infllmv2_sparse_decode with the keys and values in a KV cache
 * (FlashAttention's with_kvcache layouts), padded or paged. Sequence b has cache_seqlens[b]
 * keys (the new tokens included: its queries are its last ones, bottom-right aligned as in
 * infllmv2_sparse_attn_fwd); key j of sequence b is
 *   padded (block_table NULL, pages_per_seq 0): row j of page b;
 *   paged:        row j % page_size of page block_table[b * pages_per_seq + j / page_size],
 *                 block_table int32 (batch, pages_per_seq) in device memory; page_size a
 *                 multiple of 64 when pages_per_seq > 1 (one page a sequence, as a cache
 *                 indexed by batch entry, may have any size);
 *   where k_cache, v_cache are (num_pages, page_size, heads_k, head_dim), contiguous, dtype
 *   (padded: num_pages >= batch, page_size the capacity of a sequence), num_pages x page_size
 *   < 2^31.
 *   [in]  cache_seqlens  int32 (batch), device memory. Lengths past the capacity (page_size,
 *                      or pages_per_seq x page_size) are clamped to it, and page numbers into
 *                      [0, num_pages): bad values give wrong keys, never an access outside the
 *                      cache (the lengths and the table are not read on the host).
 *   [in]  q, cu_seqlens_q, max_seqlen_q, topk_idx, out, lse  as for infllmv2_sparse_decode
 *                      (a padded q of s tokens a sequence: cu_seqlens_q[b] = b * s)
 *   [in]  splits       1 .. 64, from infllmv2_sparse_decode_splits()
 *   [in]  workspace    at least infllmv2_sparse_decode_kvcache_workspace_size() bytes, 16-byte
 *                      aligned (needed with 1 split too)
 *   The cache rows past a sequence's keys never reach the result (its partial last block is
 *   walked last, loaded with those rows as zeros). Deterministic; with one query a sequence and
 *   splits > 1 the result is bitwise infllmv2_sparse_decode's on the same keys packed. No host
 *   synchronisation: usable inside CUDA graphs. Forward only.
 */
INFLLMV2_API infllmv2_status infllmv2_sparse_decode_kvcache(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table,
    const int32_t* cache_seqlens, const int32_t* topk_idx, const int32_t* cu_seqlens_q, void* out, float* lse,
    void* workspace, size_t workspace_size, int32_t batch, int64_t total_q, int32_t max_seqlen_q,
    int64_t num_pages, int32_t page_size, int32_t pages_per_seq, int32_t heads, int32_t heads_k,
    int32_t head_dim, int32_t topk, int32_t splits, infllmv2_dtype dtype, float softmax_scale,
    cudaStream_t stream);

/* Bytes of device workspace infllmv2_sparse_decode_kvcache needs: infllmv2_sparse_decode's
 * partial outputs and LSEs, for splits >= 1. 0 for a non-positive size. */
INFLLMV2_API size_t infllmv2_sparse_decode_kvcache_workspace_size(int64_t total_q, int32_t heads,
                                                                  int32_t head_dim, int32_t splits);

/*
 * infllmv2_dense_decode_kvcache: dense causal attention (every key a query sees, bottom-right
 * aligned) of one or a few queries a sequence over a KV cache, split over the keys: what
 * infllmv2_sparse_decode_kvcache computes when every block is selected, for caches of any
 * length (no topk_idx, so no 128-block limit). The cache layouts, q, cu_seqlens_q,
 * cache_seqlens, out, lse and their checks are infllmv2_sparse_decode_kvcache's. The kernel
 * reads cache_seqlens on the device and cuts the key blocks each query tile sees into `splits`
 * contiguous ranges; a query with no visible key (a sequence with fewer cached keys than
 * queries) gets out = 0, lse = -inf.
 *   [in]  splits       1 .. 128, from infllmv2_dense_decode_kvcache_splits()
 *   [in]  workspace    at least infllmv2_dense_decode_kvcache_workspace_size() bytes, 16-byte
 *                      aligned (needed with 1 split too)
 *   Deterministic (sums in a fixed order). No host synchronisation: usable inside CUDA graphs.
 *   Forward only.
 */
INFLLMV2_API infllmv2_status infllmv2_dense_decode_kvcache(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table,
    const int32_t* cache_seqlens, const int32_t* cu_seqlens_q, void* out, float* lse, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int32_t max_seqlen_q, int64_t num_pages,
    int32_t page_size, int32_t pages_per_seq, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t splits,
    infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/* The splits infllmv2_dense_decode_kvcache should run on the current device: num_splits itself
 * (at most 128) when > 0; when 0, as infllmv2_sparse_decode_splits picks them, each split
 * keeping at least 4 of the ceil(max_seqlen_k / 64) key blocks, at most 64. max_seqlen_k is the longest
 * cache length the call may see (the capacity when the lengths are not known on the host): it
 * sizes the split count only, the kernel reads the lengths. 0 on a bad argument (num_splits < 0,
 * max_seqlen_k < 0) or when no device can be queried. */
INFLLMV2_API int32_t infllmv2_dense_decode_kvcache_splits(int32_t batch, int32_t max_seqlen_q, int32_t heads,
                                                          int32_t heads_k, int32_t max_seqlen_k,
                                                          int32_t num_splits);

/* Bytes of device workspace infllmv2_dense_decode_kvcache needs: fp32 partial outputs and LSEs
 * as infllmv2_sparse_decode_kvcache's, for splits >= 1. 0 for a non-positive size. */
INFLLMV2_API size_t infllmv2_dense_decode_kvcache_workspace_size(int64_t total_q, int32_t heads,
                                                                 int32_t head_dim, int32_t splits);

/*
 * infllmv2_dense_attn_fwd: dense GQA attention, the short-input side of the dense-sparse switch.
 *
 *   As infllmv2_sparse_attn_fwd with every key of the sequence selected: over keys t with
 *   t <= p (p = Lk - Lq + i) when causal != 0, over all Lk keys when causal == 0. A query with
 *   no visible key (causal with Lq > Lk, or Lk = 0) gets out = 0 and lse = -inf.
 *
 *   [in]  q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse  as for infllmv2_sparse_attn_fwd; q, k,
 *                      v and out 16-byte aligned (the kernels load tiles of them by TMA on sm_90a)
 *   [in]  max_seqlen_q, max_seqlen_k  the longest query and key sequences (size the grid)
 *   [in]  causal       0 or 1
 *   heads at most 65535 (a grid axis). No workspace. No host synchronisation: usable inside
 *   CUDA graphs.
 */
INFLLMV2_API infllmv2_status infllmv2_dense_attn_fwd(
    const void* q, const void* k, const void* v, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    void* out, float* lse, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
    int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t causal,
    infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/* Bytes of device workspace infllmv2_dense_attn_bwd needs: fp32 (2, heads, total_q rounded up
 * to a multiple of 4), lse * log2(e) and rowsum(dout * out) in rows the kernels can load by TMA. */
INFLLMV2_API size_t infllmv2_dense_attn_bwd_workspace_size(int64_t total_q, int32_t heads);

/*
 * infllmv2_dense_attn_bwd: dq, dk, dv of infllmv2_dense_attn_fwd (dk, dv summed over each
 * group's G query heads). Arguments as for the forward plus out, lse (what it returned),
 * dout, and a workspace of infllmv2_dense_attn_bwd_workspace_size() bytes; dout, dq, dk, dv
 * and workspace 16-byte aligned too. max_seqlen_k at most 65535 key blocks (128 keys on sm_90a, 64
 * elsewhere). Deterministic (no atomics): repeated calls are bitwise identical.
 */
INFLLMV2_API infllmv2_status infllmv2_dense_attn_bwd(
    const void* q, const void* k, const void* v, const void* out, const void* dout, const float* lse,
    const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, void* dq, void* dk, void* dv, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
    int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t causal,
    infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/*
 * Stage 1 (block selection). Built for fine compressed keys of window 32 and stride 16
 * (infllmv2_compress_keys with kernel_size 32, kernel_stride 16) and 64-token blocks; these
 * are DSL build parameters (dsl/select_blocks.py), reported by infllmv2_build_info().
 *
 * For query i of sequence b (position p = Lk - Lq + i, bottom-right aligned, Lk the ORIGINAL
 * key length) and KV head g with query heads h = g*G .. g*G+G-1:
 *   fine key j is visible iff 16 j + 31 <= p; normaliser key n (window W, stride S) iff
 *   S n + W - 1 <= p;
 *   LSE_h  = log sum_{visible n} exp(scale * q_h . norm_keys[n])   (the fine keys when
 *            norm_keys is NULL, or for a row that sees no normaliser key)
 *   S(p,j) = sum_h exp(scale * q_h . ck[j] - LSE_h)                 (visible j; else 0 / -inf)
 *   score(p,b) = max of S(p,j) over visible j in 4b-1 .. 4b+3 (-inf if none);
 *                +inf if b < init_blocks or p/64 - local_blocks <= b <= p/64;
 *                -inf if b > p/64.
 */

/*
 * infllmv2_select_blocks: the topk best blocks per (KV head, query), fused: neither the
 * per-head scores, nor S, nor the block scores are written to device memory.
 *
 *   [in]  q              (total_q, heads, head_dim), dtype
 *   [in]  ck             fine compressed keys (total_c, heads_k, head_dim), dtype
 *   [in]  norm_keys      normaliser keys (total_norm, heads_k, head_dim), dtype, e.g. the coarse
 *                        keys (window 128, stride 64); NULL for the exact normaliser
 *   [in]  cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, cu_seqlens_norm  int32 (batch + 1); k holds
 *                        the original key lengths; cu_seqlens_norm is ignored without norm_keys
 *   [out] topk_idx       int32 (heads_k, total_q, topk): per-sequence block indices of the
 *                        min(topk, candidates) best blocks, ascending, then -1. Candidates are
 *                        the blocks b <= p/64 with score > -inf. Ties at the topk-th score go to
 *                        the lower block index.
 *   [in]  max_seqlen_q   the longest query sequence (sizes the grid)
 *   [in]  max_seqlen_k   the longest ORIGINAL key sequence; it sizes the per-tile block-score
 *                        buffer (a smaller value than the truth gives wrong picks, never a fault)
 *   [in]  topk           1 .. 8192; init_blocks, local_blocks >= 0
 *   [in]  norm_kernel_size, norm_kernel_stride  window and stride of norm_keys (ignored if NULL)
 *   [in]  softmax_scale  > 0, or 0 for 1/sqrt(head_dim)
 *   Sequences up to 8192 blocks (524288 keys) with the sm_90a kernels, 6144 blocks (393216 keys)
 *   with the sm_80/sm_89 ones (99 KB of shared memory). q, ck and norm_keys 16-byte aligned.
 *   No workspace, no host synchronisation.
 */
INFLLMV2_API infllmv2_status infllmv2_select_blocks(
    const void* q, const void* ck, const void* norm_keys, const int32_t* cu_seqlens_q,
    const int32_t* cu_seqlens_k, const int32_t* cu_seqlens_c, const int32_t* cu_seqlens_norm,
    int32_t* topk_idx, int32_t batch, int64_t total_q, int64_t total_c, int64_t total_norm,
    int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim,
    int32_t topk, int32_t init_blocks, int32_t local_blocks, int32_t norm_kernel_size,
    int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/*
 * infllmv2_select_blocks_from_keys: stages 0 and 1 in one call, from the raw keys. Runs
 * infllmv2_attention_compressed_offsets and infllmv2_compress_keys for the fine keys (32/16)
 * and, with approx_lse, for the normaliser keys (norm_kernel_size / norm_kernel_stride), then
 * infllmv2_select_blocks with those keys. The compressed keys and their offsets live in the
 * workspace, sized by the bound total_k / stride + batch: no host synchronisation.
 *
 *   [in]  k              (total_k, heads_k, head_dim), dtype
 *   [in]  punct_mask, phsa_lambda  PHSA for both compressions, as for infllmv2_compress_keys
 *                        (NULL: the plain mean)
 *   [out] topk_idx       int32 (heads_k, total_q, topk), as for infllmv2_select_blocks
 *   [in]  workspace      device memory of infllmv2_select_blocks_from_keys_workspace_size() bytes
 *   [in]  approx_lse     1: normalise over the coarse keys; 0: over the fine keys (exact)
 *   Other arguments as for infllmv2_select_blocks; q, k and workspace 16-byte aligned.
 */
INFLLMV2_API size_t infllmv2_select_blocks_from_keys_workspace_size(int32_t batch, int64_t total_k,
                                                                     int32_t heads_k, int32_t head_dim,
                                                                     int32_t approx_lse,
                                                                     int32_t norm_kernel_stride);

INFLLMV2_API infllmv2_status infllmv2_select_blocks_from_keys(
    const void* q, const void* k, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const uint8_t* punct_mask, float phsa_lambda, int32_t* topk_idx, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
    int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t topk,
    int32_t init_blocks, int32_t local_blocks, int32_t approx_lse, int32_t norm_kernel_size,
    int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream);

/*
 * infllmv2_select_decode: infllmv2_select_blocks_from_keys' selection for calls whose query
 * tiles alone leave the GPU idle, above all decoding (one or a few queries a sequence against a
 * long key cache, where the fused selection runs one thread block per sequence and KV head over
 * all its compressed keys). Each tile's compressed keys are cut into `splits` contiguous ranges
 * of 64 keys run by their own thread blocks: partial normalisers, then block scores (fp32, in
 * the workspace), then the top-K per token. Arguments as for infllmv2_select_blocks_from_keys,
 * plus:
 *   [in]  splits       1 .. 64, from infllmv2_select_decode_splits(); 1 runs
 *                      infllmv2_select_blocks_from_keys itself (its result bitwise)
 *   [in]  workspace    device memory of infllmv2_select_decode_workspace_size() bytes
 *   With splits > 1 the normaliser's sums are merged in another order than the fused kernel's
 *   (scores may differ in the last bits, so ties may resolve otherwise) but in a fixed one:
 *   repeated calls are bitwise identical. heads_k * total_q * ceil(max_seqlen_k / 64) must be
 *   below 2^31. No host synchronisation: usable inside CUDA graphs.
 */
INFLLMV2_API infllmv2_status infllmv2_select_decode(
    const void* q, const void* k, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const uint8_t* punct_mask, float phsa_lambda, int32_t* topk_idx, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
    int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim, int32_t topk,
    int32_t init_blocks, int32_t local_blocks, int32_t approx_lse, int32_t norm_kernel_size,
    int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, int32_t splits,
    cudaStream_t stream);

/* The splits infllmv2_select_decode should run for this call on the current device: num_splits
 * itself (at most 64) when > 0; when 0, 1 if the query tiles (ceil(max_seqlen_q / min(64 / G,
 * 16)) a sequence and KV head) alone fill the device's multiprocessors, else the most that keep
 * tiles x splits within twice the multiprocessors, each split scoring at least two chunks of 64
 * fine keys. 0 on a bad argument or when no device can be queried. */
INFLLMV2_API int32_t infllmv2_select_decode_splits(int32_t batch, int32_t max_seqlen_q, int32_t max_seqlen_k,
                                                   int32_t heads, int32_t heads_k, int32_t num_splits);

/* Bytes of device workspace infllmv2_select_decode needs with `splits`: with splits == 1
 * infllmv2_select_blocks_from_keys_workspace_size(); else that plus the partial normalisers and
 * the block scores (heads_k, total_q, ceil(max_seqlen_k / 64)) fp32. 0 on a bad argument. */
INFLLMV2_API size_t infllmv2_select_decode_workspace_size(int32_t batch, int64_t total_q, int64_t total_k,
                                                          int32_t max_seqlen_q, int32_t max_seqlen_k,
                                                          int32_t heads, int32_t heads_k, int32_t head_dim,
                                                          int32_t approx_lse, int32_t norm_kernel_stride,
                                                          int32_t splits);

/*
 * infllmv2_select_decode_kvcache: infllmv2_select_decode's selection over compressed caches kept by
 * infllmv2_compress_keys_kvcache, so that a decoding step does not recompress its whole cache.
 * Sequence b has L = min(cache_seqlens[b], capacity) keys (its queries, cu_seqlens_q, are the
 * last ones, bottom-right aligned); its fine compressed keys are ck_cache[b, 0 .. n(L)) (window
 * 32, stride 16) and its normaliser keys nk_cache[b, 0 .. ) (norm_kernel_size /
 * norm_kernel_stride; NULL: the exact normaliser over the fine keys). Rows at or past n(L) are
 * never read into a score, so they may hold anything. Same result as
 * infllmv2_select_blocks_from_keys / infllmv2_select_decode on the same keys packed (ties and the
 * split merge order as there).
 *
 *   [in]  ck_cache       (batch, capacity_c, heads_k, head_dim), dtype
 *   [in]  nk_cache       (batch, capacity_n, heads_k, head_dim), dtype, or NULL
 *   [in]  cache_seqlens  int32 (batch), device memory
 *   [in]  capacity       the most keys a sequence may have (lengths are clamped to it); it sizes
 *                        the block scores, as max_seqlen_k does for infllmv2_select_decode
 *   [in]  capacity_c, capacity_n  rows a sequence in ck_cache / nk_cache: at least the compressed
 *                        keys of `capacity` keys
 *   [in]  splits         1 .. 64, from infllmv2_select_decode_splits(batch, max_seqlen_q,
 *                        capacity, ...)
 *   [in]  workspace      infllmv2_select_decode_kvcache_workspace_size() bytes (with any splits)
 *   Other arguments as for infllmv2_select_decode. No host synchronisation.
 */
INFLLMV2_API infllmv2_status infllmv2_select_decode_kvcache(
    const void* q, const void* ck_cache, const void* nk_cache, const int32_t* cache_seqlens,
    const int32_t* cu_seqlens_q, int32_t* topk_idx, void* workspace, size_t workspace_size, int32_t batch,
    int64_t total_q, int32_t max_seqlen_q, int32_t capacity, int32_t capacity_c, int32_t capacity_n, int32_t heads,
    int32_t heads_k, int32_t head_dim, int32_t topk, int32_t init_blocks, int32_t local_blocks,
    int32_t norm_kernel_size, int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, int32_t splits,
    cudaStream_t stream);

/* Bytes of device workspace infllmv2_select_decode_kvcache needs with `splits`: the offsets it
 * makes on the device, plus (splits > 1) infllmv2_select_decode's partials and block scores.
 * 0 on a bad argument. */
INFLLMV2_API size_t infllmv2_select_decode_kvcache_workspace_size(int32_t batch, int64_t total_q,
                                                                  int32_t max_seqlen_q, int32_t capacity,
                                                                  int32_t heads, int32_t heads_k, int32_t splits);

/*
 * infllmv2_group_scores: S itself, fp32 (heads_k, total_q, width), column j = the sequence's
 * fine compressed key j; 0 where j is invisible or past the sequence's compressed length.
 * Arguments as for infllmv2_select_blocks; width >= 1 columns are written per row.
 */
INFLLMV2_API infllmv2_status infllmv2_group_scores(
    const void* q, const void* ck, const void* norm_keys, const int32_t* cu_seqlens_q,
    const int32_t* cu_seqlens_k, const int32_t* cu_seqlens_c, const int32_t* cu_seqlens_norm,
    float* scores, int32_t batch, int64_t total_q, int64_t total_c, int64_t total_norm,
    int32_t max_seqlen_q, int32_t width, int32_t heads, int32_t heads_k, int32_t head_dim,
    int32_t norm_kernel_size, int32_t norm_kernel_stride, infllmv2_dtype dtype,
    float softmax_scale, cudaStream_t stream);

/*
 * infllmv2_max_pool_blocks: block scores from S (pooling, forcing and the causal limit of
 * score(p, b) above), fp32 (heads_k, total_q, n_blocks); blocks >= ceil(Lk / 64) are -inf.
 *
 *   [in]  scores         fp32 (heads_k, total_q, width), e.g. infllmv2_group_scores' output;
 *                        columns invisible to a row are ignored whatever they hold
 *   [in]  cu_seqlens_q, cu_seqlens_k (original key lengths), cu_seqlens_c  int32 (batch + 1)
 *   [out] block_scores   fp32 (heads_k, total_q, n_blocks)
 */
INFLLMV2_API infllmv2_status infllmv2_max_pool_blocks(
    const float* scores, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const int32_t* cu_seqlens_c, float* block_scores, int32_t batch, int64_t total_q,
    int32_t width, int32_t n_blocks, int32_t max_seqlen_q, int32_t heads_k, int32_t init_blocks,
    int32_t local_blocks, cudaStream_t stream);

/*
 * The whole InfLLM-V2 attention in one call (forward): dense causal attention when the longest
 * key sequence is shorter than dense_len, otherwise compression and fused selection
 * (infllmv2_select_blocks_from_keys) and block-sparse attention (infllmv2_sparse_attn_fwd).
 * The fields mean what MiniCPM4.1's sparse_config keys mean; each selected row holds
 * K = topk + window_size / block_size blocks. No host synchronisation: the
 * compressed keys' offsets are computed on the device, their storage sized by a bound.
 */
typedef struct {
  int32_t kernel_size;        /* fine compression window: 32 (the stage-1 kernels' build parameter) */
  int32_t kernel_stride;      /* fine compression stride: 16 (build parameter) */
  int32_t block_size;         /* tokens per selectable block: 64 (build parameter) */
  int32_t init_blocks;        /* leading blocks always selected: 1 */
  int32_t window_size;        /* local window in tokens, a multiple of block_size: 2048 */
  int32_t topk;               /* blocks chosen by score on top of the window: 64 (K = 96 <= 128) */
  int32_t dense_len;          /* dense below this many keys in the longest sequence: 8192 */
  int32_t approx_lse;         /* 1: normalise stage-1 scores over the coarse keys; 0: the fine keys */
  int32_t norm_kernel_size;   /* coarse compression window: 128 */
  int32_t norm_kernel_stride; /* coarse compression stride: 64 */
} infllmv2_sparse_config;

/* Fills *config with MiniCPM4.1's defaults (the values in the comments above). */
INFLLMV2_API void infllmv2_sparse_config_default(infllmv2_sparse_config* config);

/* Bytes of device workspace infllmv2_attention_fwd needs (0 on the dense path); an upper bound
 * that depends only on these sizes. */
INFLLMV2_API size_t infllmv2_attention_fwd_workspace_size(int32_t batch, int64_t total_q, int64_t total_k,
                                                          int32_t max_seqlen_k, int32_t heads_k, int32_t head_dim,
                                                          const infllmv2_sparse_config* config);

/*
 * infllmv2_attention_fwd: out (total_q, heads, head_dim) and lse fp32 (heads, total_q) of the
 * InfLLM-V2 attention of packed varlen sequences, bottom-right causal.
 *
 *   [in]  q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse  as for infllmv2_sparse_attn_fwd
 *   [in]  punct_mask, phsa_lambda  PHSA: optional uint8 (total_k,) device flags, nonzero for a
 *                      punctuation key, with its weight in [0, 1], as for infllmv2_compress_keys
 *                      (NULL: the plain mean); stage 0 only, so the dense path checks but does
 *                      not use them
 *   [out] topk_idx     optional (NULL: kept in the workspace): int32 (heads_k, total_q, K), the
 *                      selection the sparse path used (untouched on the dense path)
 *   [in]  workspace    device memory of infllmv2_attention_fwd_workspace_size() bytes
 *   [in]  max_seqlen_q, max_seqlen_k  the longest sequences (the switch and the grids)
 *   [in]  config       see infllmv2_sparse_config; softmax_scale 0 for 1/sqrt(head_dim)
 * q, k, v, out and workspace 16-byte aligned.
 * Support: what its ops support (bf16/fp16, head_dim 64/128, G <= 64, K <= 128).
 * (ABI 5 added punct_mask and phsa_lambda.)
 */
INFLLMV2_API infllmv2_status infllmv2_attention_fwd(
    const void* q, const void* k, const void* v, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const uint8_t* punct_mask, float phsa_lambda, void* out, float* lse, int32_t* topk_idx, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
    int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype,
    float softmax_scale, const infllmv2_sparse_config* config, cudaStream_t stream);

/* Bytes of device workspace infllmv2_attention_bwd needs: the dense backward's
 * (infllmv2_dense_attn_bwd_workspace_size) when max_seqlen_k < config->dense_len, else the sparse
 * backward's (infllmv2_sparse_attn_bwd_workspace_size with topk + window_size / block_size
 * selected blocks). 0 for a NULL config or non-positive sizes. */
INFLLMV2_API size_t infllmv2_attention_bwd_workspace_size(int32_t batch, int64_t total_q, int64_t total_k,
                                                          int32_t max_seqlen_k, int32_t heads, int32_t heads_k,
                                                          const infllmv2_sparse_config* config);

/*
 * infllmv2_attention_bwd: dq (total_q, heads, head_dim), dk and dv (total_k, heads_k, head_dim,
 * summed over each group's G query heads) of infllmv2_attention_fwd, on the side of the switch
 * the forward took: pass the forward's config and max_seqlen_k. The sparse path holds the
 * selection constant, as the original kernels' backward does.
 *
 *   [in]  q, k, v, cu_seqlens_q, cu_seqlens_k  what the forward was given
 *   [in]  out, lse     what infllmv2_attention_fwd returned
 *   [in]  dout         (total_q, heads, head_dim), dtype
 *   [in]  topk_idx     the selection infllmv2_attention_fwd wrote into its topk_idx argument;
 *                      required (not NULL) when max_seqlen_k >= config->dense_len, ignored below
 *   [in]  workspace    device memory of infllmv2_attention_bwd_workspace_size() bytes
 * q, k, v, out, dout, dq, dk, dv and workspace 16-byte aligned. Deterministic: repeated calls are
 * bitwise identical. No host synchronisation. Errors of the backward it runs name that op
 * (infllmv2_dense_attn_bwd or infllmv2_sparse_attn_bwd).
 */
INFLLMV2_API infllmv2_status infllmv2_attention_bwd(
    const void* q, const void* k, const void* v, const void* out, const void* dout, const float* lse,
    const int32_t* topk_idx, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, void* dq, void* dk,
    void* dv, void* workspace, size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k,
    int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim,
    infllmv2_dtype dtype, float softmax_scale, const infllmv2_sparse_config* config, cudaStream_t stream);

/*
 * infllmv2_attention_kvcache: one decoding (or speculative, or chunked-prefill) step of the
 * InfLLM-V2 attention against a KV cache, forward only, with the compressed caches kept across
 * steps: what infllmv2.attention_kvcache does, in one call.
 *   1. infllmv2_compress_keys_kvcache brings ck_cache (window/stride config kernel_size /
 *      kernel_stride) and, with config approx_lse, nk_cache (norm_kernel_size / _stride) up to
 *      date for the last new_keys keys of each sequence (the first call after filling a cache:
 *      new_keys = its length);
 *   2. max_seqlen_k < config dense_len: infllmv2_dense_decode_kvcache writes out and lse
 *      (dense attention, any dense_len); else
 *   3. infllmv2_select_decode_kvcache picks topk + window_size / block_size blocks a token and
 *      infllmv2_sparse_decode_kvcache writes out and lse.
 * On the dense path step 1 runs on the side stream (see the top of this file), beside step 2,
 * which reads no compressed key.
 * Split counts are the library's (infllmv2_select_decode_splits, infllmv2_sparse_decode_splits,
 * infllmv2_dense_decode_kvcache_splits).
 *   [in]  q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, out, lse, num_pages,
 *         page_size, pages_per_seq  as for infllmv2_sparse_decode_kvcache (the new tokens'
 *         keys and values in the cache already, cache_seqlens counting them)
 *   [in]  punct_cache, phsa_lambda  PHSA for both compressed caches, as for
 *         infllmv2_compress_keys_kvcache (NULL: the plain mean)
 *   [in,out] ck_cache, nk_cache  (batch, capacity_c / capacity_n, heads_k, head_dim), as for
 *         infllmv2_compress_keys_kvcache; nk_cache may be NULL with approx_lse = 0
 *   [in]  max_seqlen_q, max_seqlen_k  the longest query run and key sequence (the switch and
 *         the grids; max_seqlen_k at most the capacity of a sequence)
 *   [in]  workspace    infllmv2_attention_kvcache_workspace_size() bytes, 16-byte aligned
 *   [in]  config       as for infllmv2_attention_fwd
 * No host synchronisation: usable inside CUDA graphs. Errors of the calls it makes carry their
 * names. (ABI 4 added punct_cache and phsa_lambda.)
 */
INFLLMV2_API size_t infllmv2_attention_kvcache_workspace_size(int32_t batch, int64_t total_q, int32_t max_seqlen_q,
                                                             int32_t max_seqlen_k, int64_t num_pages,
                                                             int32_t page_size, int32_t pages_per_seq, int32_t heads,
                                                             int32_t heads_k, int32_t head_dim,
                                                             const infllmv2_sparse_config* config);

INFLLMV2_API infllmv2_status infllmv2_attention_kvcache(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table, const int32_t* cache_seqlens,
    const int32_t* cu_seqlens_q, const uint8_t* punct_cache, float phsa_lambda, void* ck_cache, void* nk_cache,
    void* out, float* lse, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int32_t max_seqlen_q, int32_t max_seqlen_k,
    int64_t num_pages, int32_t page_size, int32_t pages_per_seq, int32_t capacity_c, int32_t capacity_n,
    int32_t new_keys, int32_t heads, int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype, float softmax_scale,
    const infllmv2_sparse_config* config, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* INFLLMV2_H_ */
