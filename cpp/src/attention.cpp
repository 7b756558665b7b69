// infllmv2_attention_fwd / _bwd: the dense-sparse switch over the library's own ops, for C callers.
#include <algorithm>
#include <string>

#include "registry.h"
#include "runtime.h"
#include "stage1.h"

using namespace infllmv2;

namespace {

constexpr const char* kOp = "infllmv2_attention_fwd";
constexpr const char* kBwdOp = "infllmv2_attention_bwd";
// stage 2's row limit
constexpr int kMaxK = 128;


int selected(const infllmv2_sparse_config& c) { return c.topk + c.window_size / c.block_size; }

infllmv2_status check_config(const char* op, const infllmv2_sparse_config* c) {
  if (c == nullptr) return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: config must not be NULL", op);
  if (c->kernel_size != kFineW || c->kernel_stride != kFineS || c->block_size != kBlock)
    return fail(INFLLMV2_ERR_UNSUPPORTED,
                "%s: config kernel_size/kernel_stride/block_size must be %d/%d/%d (the stage-1 kernels' build "
                "parameters), got %d/%d/%d",
                op, kFineW, kFineS, kBlock, c->kernel_size, c->kernel_stride, c->block_size);
  if (c->init_blocks < 0 || c->topk < 0 || c->dense_len < 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: config init_blocks, topk and dense_len must be >= 0, got %d, %d, %d",
                op, c->init_blocks, c->topk, c->dense_len);
  if (c->window_size < 0 || c->window_size % c->block_size != 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: config window_size must be a multiple of block_size >= 0, got %d",
                op, c->window_size);
  const int K = selected(*c);
  if (K < 1 || K > kMaxK)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: config topk + window_size / block_size must be in [1, %d], got %d", op,
                kMaxK, K);
  if (c->approx_lse != 0 && c->approx_lse != 1)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: config approx_lse must be 0 or 1, got %d", op, c->approx_lse);
  if (c->approx_lse && (c->norm_kernel_size < 1 || c->norm_kernel_stride < 1))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: config norm_kernel_size and norm_kernel_stride must be >= 1, got %d and %d",
                op, c->norm_kernel_size, c->norm_kernel_stride);
  return INFLLMV2_OK;
}

// What the forward and the backward check before either side of the switch.
infllmv2_status check_call(const char* op, const infllmv2_sparse_config* config, infllmv2_dtype dtype,
                           int32_t head_dim, int32_t batch, int32_t heads, int32_t heads_k, int64_t total_q,
                           int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k, float softmax_scale) {
  infllmv2_status st = check_config(op, config);
  if (st == INFLLMV2_OK) st = check_group_layout(op, dtype, head_dim, batch, heads, heads_k);
  if (st == INFLLMV2_OK) st = check_attn_sizes(op, total_q, total_k, max_seqlen_q, max_seqlen_k, softmax_scale);
  return st;
}

// Where stages 0 and 1 keep the compressed keys and their offsets in the workspace; sizes are
// bounds that hold for any lengths summing to total_k (n(L) <= L / s + 1 per sequence).
struct SelectLayout {
  int64_t bound_c = 0, bound_n = 0;
  size_t row = 0;  // one compressed key, bf16/fp16
  size_t cu_c = 0, cu_n = 0, ck = 0, nk = 0, total = 0;
};

SelectLayout select_layout(int32_t batch, int64_t total_k, int32_t heads_k, int32_t head_dim, bool approx_lse,
                           int32_t norm_kernel_stride) {
  SelectLayout l;
  l.row = (size_t)heads_k * head_dim * 2;
  l.bound_c = total_k / kFineS + batch;
  l.bound_n = approx_lse ? total_k / norm_kernel_stride + batch : 0;
  size_t at = 0;
  l.cu_c = at, at += align256((size_t)(batch + 1) * 4);
  l.cu_n = at, at += align256((size_t)(batch + 1) * 4);
  l.ck = at, at += align256((size_t)l.bound_c * l.row);
  l.nk = at, at += align256((size_t)l.bound_n * l.row);
  l.total = at;
  return l;
}

// The sparse path of infllmv2_attention_fwd: stages 0-1's workspace (select bytes), then the
// selection at that offset.
struct Layout {
  size_t select = 0, total = 0;
};

Layout layout(int32_t batch, int64_t total_q, int64_t total_k, int32_t heads_k, int32_t head_dim,
              const infllmv2_sparse_config& c) {
  Layout l;
  l.select = select_layout(batch, total_k, heads_k, head_dim, c.approx_lse != 0, c.norm_kernel_stride).total;
  l.total = l.select + align256((size_t)heads_k * total_q * selected(c) * 4);
  return l;
}

}  // namespace

extern "C" INFLLMV2_API infllmv2_status infllmv2_attention_compressed_offsets(const int32_t* cu_seqlens_k,
                                                                             int32_t* cu_seqlens_c, int32_t batch,
                                                                             int32_t kernel_size, int32_t kernel_stride,
                                                                             cudaStream_t stream) {
  constexpr const char* op = "infllmv2_attention_compressed_offsets";
  clear_error();
  if (batch < 1 || batch > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: batch must be in [1, %d], got %d", op, kMaxGridYZ, batch);
  if (kernel_size < 1 || kernel_stride < 1)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: kernel_size and kernel_stride must be >= 1, got %d and %d", op,
                kernel_size, kernel_stride);
  Device dev;
  infllmv2_status st = current_device(op, &dev);
  if (st != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_k", cu_seqlens_k}, {"cu_seqlens_c", cu_seqlens_c}})) !=
      INFLLMV2_OK)
    return st;
  const infllmv2_attention_compressed_offsets_unit* unit = nullptr;
  if ((st = pick_unit(op, infllmv2_attention_compressed_offsets_units, dev,
                      [](const infllmv2_attention_compressed_offsets_unit&) { return true; }, "compressed offsets",
                      &unit)) != INFLLMV2_OK)
    return st;
  int rc = unit->call(const_cast<int32_t*>(cu_seqlens_k), cu_seqlens_c, batch, kernel_size, kernel_stride, batch + 1,
                      stream);
  return launch_result(op, unit->name, rc, unit->last_error);
}

extern "C" INFLLMV2_API size_t infllmv2_select_blocks_from_keys_workspace_size(int32_t batch, int64_t total_k,
                                                                                int32_t heads_k, int32_t head_dim,
                                                                                int32_t approx_lse,
                                                                                int32_t norm_kernel_stride) {
  if (batch < 1 || total_k < 0 || heads_k < 1 || head_dim < 1 || (approx_lse != 0 && approx_lse != 1) ||
      (approx_lse && norm_kernel_stride < 1))
    return 0;
  return select_layout(batch, total_k, heads_k, head_dim, approx_lse != 0, norm_kernel_stride).total;
}

namespace infllmv2 {

size_t select_from_keys_bytes(int32_t batch, int64_t total_k, int32_t heads_k, int32_t head_dim, bool approx_lse,
                              int32_t norm_kernel_stride) {
  return select_layout(batch, total_k, heads_k, head_dim, approx_lse, norm_kernel_stride).total;
}

infllmv2_status compress_for_selection(const char* op, const char* size_fn, const void* q, const void* k,
                                       const int32_t* cu_seqlens_k, const uint8_t* punct_mask, float phsa_lambda,
                                       void* workspace, size_t workspace_size, size_t extra_bytes, int32_t batch,
                                       int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads_k,
                                       int32_t head_dim, int32_t approx_lse, int32_t norm_kernel_size,
                                       int32_t norm_kernel_stride, infllmv2_dtype dtype, cudaStream_t stream,
                                       CompressedKeys* out) {
  // what sizes the workspace is checked here; the rest by the ops it runs, each before its launch
  if (batch < 1 || batch > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: batch must be in [1, %d], got %d", op, kMaxGridYZ, batch);
  if (total_k < 0 || heads_k < 1 || head_dim < 1)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: total_k must be >= 0 and heads_k, head_dim >= 1, got %lld, %d, %d",
                op, (long long)total_k, heads_k, head_dim);
  if (approx_lse != 0 && approx_lse != 1)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: approx_lse must be 0 or 1, got %d", op, approx_lse);
  if (approx_lse && (norm_kernel_size < 1 || norm_kernel_stride < 1))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: norm_kernel_size and norm_kernel_stride must be >= 1, got %d and %d",
                op, norm_kernel_size, norm_kernel_stride);
  if (max_seqlen_k < 0 || max_seqlen_k < max_seqlen_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_k must be >= max_seqlen_q (%d) and >= 0, got %d", op,
                max_seqlen_q, max_seqlen_k);
  const SelectLayout l = select_layout(batch, total_k, heads_k, head_dim, approx_lse != 0, norm_kernel_stride);
  if (workspace_size < l.total + extra_bytes)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: workspace_size is %zu bytes, %s() asks for %zu", op, workspace_size,
                size_fn, l.total + extra_bytes);
  Device dev;
  infllmv2_status st = current_device(op, &dev);
  if (st != INFLLMV2_OK) return st;
  if ((st = check_device_pointer(op, "workspace", workspace, dev)) != INFLLMV2_OK) return st;
  if ((st = check_aligned(op, {{"q", q}, {"k", k}, {"workspace", workspace}})) != INFLLMV2_OK) return st;

  int32_t* cu_c = at<int32_t>(workspace, l.cu_c);
  int32_t* cu_n = approx_lse ? at<int32_t>(workspace, l.cu_n) : nullptr;
  void* ck = at<void>(workspace, l.ck);
  void* nk = approx_lse ? at<void>(workspace, l.nk) : nullptr;
  struct Compression {
    int32_t* cu;
    void* keys;
    int64_t bound;
    int w, s;
  };
  const Compression levels[2] = {{cu_c, ck, l.bound_c, kFineW, kFineS},
                                 {cu_n, nk, l.bound_n, norm_kernel_size, norm_kernel_stride}};
  for (int i = 0; i < (approx_lse ? 2 : 1); ++i) {
    const Compression& z = levels[i];
    // The selection reads whole 64-key chunks, so the last sequence's final chunk reads rows
    // past the keys compress_keys writes, up to the bound; the visibility mask discards their
    // scores. They are zeroed so that no read of unwritten memory remains (compute-sanitizer's
    // initcheck sees none). The keys written number more than (total_k - batch * w) / s, since
    // n(L) > (L - w) / s for every length, so the rows from there to the bound hold every
    // unwritten one: at most about batch * (w / s + 1) rows, and compress_keys, launched after
    // the memset on the same stream, overwrites those it writes.
    const int64_t lo = std::max<int64_t>(0, (total_k - (int64_t)batch * z.w) / z.s);
    if (z.bound > lo) {
      cudaError_t e = cudaMemsetAsync(at<char>(z.keys, lo * l.row), 0, (size_t)(z.bound - lo) * l.row, stream);
      if (e != cudaSuccess)
        return fail(INFLLMV2_ERR_CUDA, "%s: zeroing the compressed keys' tail failed: %s", op, cudaGetErrorString(e));
    }
    if ((st = infllmv2_attention_compressed_offsets(cu_seqlens_k, z.cu, batch, z.w, z.s, stream)) != INFLLMV2_OK)
      return st;
    // capped by the buffer: a max_seqlen_k above the true longest length is allowed (it only sizes grids)
    const int32_t max_n = (int32_t)std::min<int64_t>(windows(max_seqlen_k, z.w, z.s), z.bound);
    if ((st = infllmv2_compress_keys(k, cu_seqlens_k, z.cu, punct_mask, phsa_lambda, z.keys, batch, total_k, z.bound,
                                     max_n, heads_k, head_dim, dtype, z.w, z.s, stream)) != INFLLMV2_OK)
      return st;
  }
  *out = CompressedKeys{ck, nk, cu_c, cu_n, l.bound_c, l.bound_n};
  return INFLLMV2_OK;
}

}  // namespace infllmv2

extern "C" INFLLMV2_API infllmv2_status infllmv2_select_blocks_from_keys(
    const void* q, const void* k, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, const uint8_t* punct_mask,
    float phsa_lambda, int32_t* topk_idx, void* workspace, size_t workspace_size, int32_t batch, int64_t total_q,
    int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim,
    int32_t topk, int32_t init_blocks, int32_t local_blocks, int32_t approx_lse, int32_t norm_kernel_size,
    int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream) {
  constexpr const char* op = "infllmv2_select_blocks_from_keys";
  clear_error();
  CompressedKeys c;
  infllmv2_status st = compress_for_selection(op, "infllmv2_select_blocks_from_keys_workspace_size", q, k, cu_seqlens_k,
                                              punct_mask, phsa_lambda, workspace, workspace_size, 0, batch, total_k,
                                              max_seqlen_q, max_seqlen_k, heads_k, head_dim, approx_lse,
                                              norm_kernel_size, norm_kernel_stride, dtype, stream, &c);
  if (st != INFLLMV2_OK) return st;
  return infllmv2_select_blocks(q, c.ck, c.nk, cu_seqlens_q, cu_seqlens_k, c.cu_c, c.cu_n, topk_idx, batch, total_q,
                                c.total_c, c.total_n, max_seqlen_q, max_seqlen_k, heads, heads_k, head_dim, topk,
                                init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride, dtype, softmax_scale,
                                stream);
}

extern "C" INFLLMV2_API void infllmv2_sparse_config_default(infllmv2_sparse_config* c) {
  if (c == nullptr) return;
  *c = infllmv2_sparse_config{kFineW, kFineS, kBlock, 1, 2048, 64, 8192, 1, 128, 64};
}

extern "C" INFLLMV2_API size_t infllmv2_attention_fwd_workspace_size(int32_t batch, int64_t total_q, int64_t total_k,
                                                                     int32_t max_seqlen_k, int32_t heads_k,
                                                                     int32_t head_dim, const infllmv2_sparse_config* c) {
  if (c == nullptr || batch < 1 || total_q < 0 || total_k < 0 || heads_k < 1 || head_dim < 1 || c->kernel_stride < 1 ||
      c->block_size < 1 || (c->approx_lse && c->norm_kernel_stride < 1))
    return 0;
  if (max_seqlen_k < c->dense_len) return 0;
  return layout(batch, total_q, total_k, heads_k, head_dim, *c).total;
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_attention_fwd(
    const void* q, const void* k, const void* v, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const uint8_t* punct_mask, float phsa_lambda, void* out, float* lse, int32_t* topk_idx, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k,
    int32_t heads, int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype, float softmax_scale,
    const infllmv2_sparse_config* config, cudaStream_t stream) {
  clear_error();
  infllmv2_status st = check_call(kOp, config, dtype, head_dim, batch, heads, heads_k, total_q, total_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale);
  if (st != INFLLMV2_OK) return st;
  // checked on both sides of the switch, so that a bad PHSA argument fails the same way for every
  // length (the dense path has no compression to use it)
  if ((st = check_phsa_lambda(kOp, punct_mask, phsa_lambda)) != INFLLMV2_OK) return st;
  const infllmv2_sparse_config& c = *config;
  const bool sparse = max_seqlen_k >= c.dense_len;
  const bool check_punct = punct_mask != nullptr && total_k > 0;
  // one device query serves the mask's check and the sparse path's workspace checks
  Device dev;
  if ((check_punct || sparse) && (st = current_device(kOp, &dev)) != INFLLMV2_OK) return st;
  if (check_punct && (st = check_device_pointer(kOp, "punct_mask", punct_mask, dev)) != INFLLMV2_OK) return st;
  // named here, not by the op it dispatches to
  if ((st = check_aligned(kOp, {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"workspace", workspace}})) != INFLLMV2_OK)
    return st;
  if (!sparse)
    return infllmv2_dense_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, batch, total_q, total_k,
                                   max_seqlen_q, max_seqlen_k, heads, heads_k, head_dim, 1, dtype, softmax_scale,
                                   stream);

  const Layout l = layout(batch, total_q, total_k, heads_k, head_dim, c);
  if (workspace_size < l.total)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: workspace_size is %zu bytes, infllmv2_attention_fwd_workspace_size() asks for %zu", kOp,
                workspace_size, l.total);
  if ((st = check_device_pointer(kOp, "workspace", workspace, dev)) != INFLLMV2_OK) return st;
  if (topk_idx != nullptr && (st = check_device_pointer(kOp, "topk_idx", topk_idx, dev)) != INFLLMV2_OK) return st;

  int32_t* idx = topk_idx != nullptr ? topk_idx : at<int32_t>(workspace, l.select);
  const int K = selected(c);
  if ((st = infllmv2_select_blocks_from_keys(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, idx, workspace,
                                             l.select,
                                             batch, total_q, total_k, max_seqlen_q, max_seqlen_k, heads, heads_k,
                                             head_dim, K, c.init_blocks, c.window_size / c.block_size, c.approx_lse,
                                             c.norm_kernel_size, c.norm_kernel_stride, dtype, softmax_scale, stream)) !=
      INFLLMV2_OK)
    return st;
  return infllmv2_sparse_attn_fwd(q, k, v, idx, cu_seqlens_q, cu_seqlens_k, out, lse, batch, total_q, total_k,
                                  max_seqlen_q, heads, heads_k, head_dim, K, dtype, softmax_scale, stream);
}

extern "C" INFLLMV2_API size_t infllmv2_attention_bwd_workspace_size(int32_t batch, int64_t total_q, int64_t total_k,
                                                                     int32_t max_seqlen_k, int32_t heads,
                                                                     int32_t heads_k, const infllmv2_sparse_config* c) {
  if (c == nullptr || batch < 1 || total_q < 0 || total_k < 0 || heads < 1 || heads_k < 1 || c->block_size < 1) return 0;
  if (max_seqlen_k < c->dense_len) return infllmv2_dense_attn_bwd_workspace_size(total_q, heads);
  return infllmv2_sparse_attn_bwd_workspace_size(total_q, total_k, batch, heads, heads_k, selected(*c));
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_attention_bwd(
    const void* q, const void* k, const void* v, const void* out, const void* dout, const float* lse,
    const int32_t* topk_idx, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, void* dq, void* dk, void* dv,
    void* workspace, size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
    int32_t max_seqlen_k, int32_t heads, int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype, float softmax_scale,
    const infllmv2_sparse_config* config, cudaStream_t stream) {
  clear_error();
  infllmv2_status st = check_call(kBwdOp, config, dtype, head_dim, batch, heads, heads_k, total_q, total_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale);
  if (st != INFLLMV2_OK) return st;
  // the switch must take the forward's side: the same config and max_seqlen_k give it
  const infllmv2_sparse_config& c = *config;
  const size_t need = infllmv2_attention_bwd_workspace_size(batch, total_q, total_k, max_seqlen_k, heads, heads_k, &c);
  if (workspace_size < need)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: workspace_size is %zu bytes, infllmv2_attention_bwd_workspace_size() asks for %zu", kBwdOp,
                workspace_size, need);
  if (max_seqlen_k < c.dense_len)
    return infllmv2_dense_attn_bwd(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, workspace,
                                   workspace_size, batch, total_q, total_k, max_seqlen_q, max_seqlen_k, heads, heads_k,
                                   head_dim, 1, dtype, softmax_scale, stream);
  // the forward keeps its selection in its own workspace when given none; the backward needs it
  if (topk_idx == nullptr && total_q > 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: topk_idx must not be NULL on the sparse path (max_seqlen_k %d >= config dense_len %d): pass the "
                "(heads_k, total_q, topk + window_size / block_size) selection infllmv2_attention_fwd wrote",
                kBwdOp, max_seqlen_k, c.dense_len);
  return infllmv2_sparse_attn_bwd(q, k, v, out, dout, lse, topk_idx, cu_seqlens_q, cu_seqlens_k, dq, dk, dv, workspace,
                                  workspace_size, batch, total_q, total_k, max_seqlen_q, max_seqlen_k, heads, heads_k,
                                  head_dim, selected(c), dtype, softmax_scale, stream);
}

namespace {

constexpr const char* kCacheOp = "infllmv2_attention_kvcache";

// The decoding step's workspace. Sparse path: the selection (heads_k, total_q, cols) int32, the
// split selection's, then stage 2's partials. Dense path (every key, through
// infllmv2_dense_decode_kvcache): its partials only. The split counts are the library's, as
// infllmv2_select_decode_splits, infllmv2_sparse_decode_splits and
// infllmv2_dense_decode_kvcache_splits pick them on this device.
struct CacheLayout {
  bool dense = false;
  int cols = 0;
  int32_t select_splits = 0, decode_splits = 0;
  size_t idx = 0, select = 0, decode = 0, total = 0;
};

infllmv2_status cache_step_layout(const char* op, int32_t batch, int64_t total_q, int32_t max_seqlen_q,
                                  int32_t max_seqlen_k, int32_t capacity, int32_t heads, int32_t heads_k,
                                  int32_t head_dim, const infllmv2_sparse_config& c, CacheLayout* l) {
  l->dense = max_seqlen_k < c.dense_len;
  if (l->dense) {
    if ((l->decode_splits = infllmv2_dense_decode_kvcache_splits(batch, max_seqlen_q, heads, heads_k,
                                                                 std::min(max_seqlen_k, capacity), 0)) < 1)
      return fail(INFLLMV2_ERR_CUDA, "%s: no split count for dense attention: %s", op, infllmv2_last_error());
    l->idx = l->select = l->decode = 0;
    l->total = align256(infllmv2_dense_decode_kvcache_workspace_size(total_q, heads, head_dim, l->decode_splits));
    return INFLLMV2_OK;
  }
  l->cols = selected(c);
  if ((l->select_splits = infllmv2_select_decode_splits(batch, max_seqlen_q, capacity, heads, heads_k, 0)) < 1)
    return fail(INFLLMV2_ERR_CUDA, "%s: no split count for the selection: %s", op, infllmv2_last_error());
  if ((l->decode_splits = infllmv2_sparse_decode_splits(batch, max_seqlen_q, heads, heads_k, l->cols, 0)) < 1)
    return fail(INFLLMV2_ERR_CUDA, "%s: no split count for stage 2: %s", op, infllmv2_last_error());
  size_t at = 0;
  l->idx = at, at += align256((size_t)heads_k * (size_t)total_q * (size_t)l->cols * sizeof(int32_t));
  l->select = at;
  at += align256(infllmv2_select_decode_kvcache_workspace_size(batch, total_q, max_seqlen_q, capacity, heads, heads_k,
                                                               l->select_splits));
  l->decode = at, at += align256(infllmv2_sparse_decode_kvcache_workspace_size(total_q, heads, head_dim,
                                                                              l->decode_splits));
  l->total = at;
  return INFLLMV2_OK;
}

// The checks of the step's own arguments (the ops it calls check theirs).
infllmv2_status check_cache_step(const char* op, const infllmv2_sparse_config* config, infllmv2_dtype dtype,
                                 int32_t head_dim, int32_t batch, int32_t heads, int32_t heads_k, int64_t total_q,
                                 int32_t max_seqlen_q, int32_t max_seqlen_k, bool paged, int64_t num_pages,
                                 int32_t page_size, int32_t pages_per_seq, int32_t* capacity) {
  infllmv2_status st = check_config(op, config);
  if (st == INFLLMV2_OK) st = check_group_layout(op, dtype, head_dim, batch, heads, heads_k);
  if (st == INFLLMV2_OK) st = check_cache_layout(op, paged, batch, num_pages, page_size, pages_per_seq, kBlock);
  if (st != INFLLMV2_OK) return st;
  *capacity = page_size * std::max(pages_per_seq, 1);
  if (total_q < 0 || total_q > INT32_MAX || max_seqlen_q < 0 || max_seqlen_q > total_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: total_q must be in [0, 2^31) and max_seqlen_q in [0, total_q], got %lld and %d", op,
                (long long)total_q, max_seqlen_q);
  if (max_seqlen_k < max_seqlen_q || max_seqlen_k > *capacity)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: max_seqlen_k must be in [max_seqlen_q = %d, the capacity %d of a sequence], got %d", op,
                max_seqlen_q, *capacity, max_seqlen_k);
  return INFLLMV2_OK;
}

}  // namespace

extern "C" INFLLMV2_API size_t infllmv2_attention_kvcache_workspace_size(
    int32_t batch, int64_t total_q, int32_t max_seqlen_q, int32_t max_seqlen_k, int64_t num_pages, int32_t page_size,
    int32_t pages_per_seq, int32_t heads, int32_t heads_k, int32_t head_dim, const infllmv2_sparse_config* config) {
  int32_t capacity = 0;
  CacheLayout l;
  if (check_cache_step(kCacheOp, config, INFLLMV2_DTYPE_BF16, head_dim, batch, heads, heads_k, total_q, max_seqlen_q,
                       max_seqlen_k, pages_per_seq > 0, num_pages, page_size, pages_per_seq, &capacity) != INFLLMV2_OK ||
      cache_step_layout(kCacheOp, batch, total_q, max_seqlen_q, max_seqlen_k, capacity, heads, heads_k, head_dim,
                        *config, &l) != INFLLMV2_OK)
    return 0;
  return l.total;
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_attention_kvcache(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_table, const int32_t* cache_seqlens,
    const int32_t* cu_seqlens_q, const uint8_t* punct_cache, float phsa_lambda, void* ck_cache, void* nk_cache,
    void* out, float* lse, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int32_t max_seqlen_q, int32_t max_seqlen_k,
    int64_t num_pages, int32_t page_size, int32_t pages_per_seq, int32_t capacity_c, int32_t capacity_n,
    int32_t new_keys, int32_t heads, int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype, float softmax_scale,
    const infllmv2_sparse_config* config, cudaStream_t stream) {
  clear_error();
  int32_t capacity = 0;
  infllmv2_status st = check_cache_step(kCacheOp, config, dtype, head_dim, batch, heads, heads_k, total_q,
                                        max_seqlen_q, max_seqlen_k, block_table != nullptr, num_pages, page_size,
                                        pages_per_seq, &capacity);
  if (st != INFLLMV2_OK) return st;
  const infllmv2_sparse_config& c = *config;
  if (c.approx_lse && nk_cache == nullptr)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: nk_cache (the normaliser keys' compressed cache) must not be NULL with config approx_lse = 1", kCacheOp);
  CacheLayout l;
  if ((st = cache_step_layout(kCacheOp, batch, total_q, max_seqlen_q, max_seqlen_k, capacity, heads, heads_k, head_dim,
                              c, &l)) != INFLLMV2_OK)
    return st;
  if (workspace_size < l.total)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: workspace_size is %zu bytes, infllmv2_attention_kvcache_workspace_size() asks for %zu", kCacheOp,
                workspace_size, l.total);
  Device dev;
  if ((st = current_device(kCacheOp, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointer(kCacheOp, "workspace", workspace, dev)) != INFLLMV2_OK) return st;
  if ((st = check_aligned(kCacheOp, {{"workspace", workspace}})) != INFLLMV2_OK) return st;
  // every pointer the ops below take, once (their own checks are skipped in the scope)
  if ((st = check_device_pointers(kCacheOp, dev, {{"k_cache", k_cache}, {"v_cache", v_cache},
                                                  {"cache_seqlens", cache_seqlens}, {"cu_seqlens_q", cu_seqlens_q},
                                                  {"ck_cache", ck_cache}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(kCacheOp, dev, {{"q", q}, {"out", out}, {"lse", lse}})) != INFLLMV2_OK)
    return st;
  if (c.approx_lse && (st = check_device_pointer(kCacheOp, "nk_cache", nk_cache, dev)) != INFLLMV2_OK) return st;
  if (block_table != nullptr && (st = check_device_pointer(kCacheOp, "block_table", block_table, dev)) != INFLLMV2_OK)
    return st;
  if (punct_cache != nullptr && (st = check_device_pointer(kCacheOp, "punct_cache", punct_cache, dev)) != INFLLMV2_OK)
    return st;
  PointersChecked checked;

  // The compressed caches brought up to date for the new keys, on either side of the switch, so
  // that a later step past dense_len finds them complete (both levels in one launch). The dense
  // path reads none of them, so there the update runs on the side stream, beside the attention:
  // in line, its chain of dependent loads (length, page, keys) added 9-12 us to every dense step
  // (H200, CUDA graphs: 25.8 -> 17.0 us at 4K x 1, 48.3 -> 36.6 at 8K x 8). The sparse path's
  // selection reads them; beside the selection's first launch (its cache offsets) the update
  // measured no gain.
  SideBranch update(stream);
  cudaStream_t update_stream = stream;
  if (l.dense) {
    if (cudaError_t e = update.fork(dev.index, &update_stream); e != cudaSuccess)
      return fail(INFLLMV2_ERR_CUDA, "%s: forking the compressed caches' update failed: %s", kCacheOp,
                  cudaGetErrorString(e));
  }
  const CompressedLevel levels[2] = {
      {ck_cache, capacity_c, c.kernel_size, c.kernel_stride, "ck_cache", "capacity_c", "config kernel_size",
       "config kernel_stride"},
      {nk_cache, capacity_n, c.norm_kernel_size, c.norm_kernel_stride, "nk_cache", "capacity_n",
       "config norm_kernel_size", "config norm_kernel_stride"}};
  if ((st = compress_kvcache_levels(kCacheOp, k_cache, block_table, cache_seqlens, punct_cache, phsa_lambda, levels,
                                    c.approx_lse ? 2 : 1, batch,
                                    num_pages, page_size, pages_per_seq, new_keys, heads_k, head_dim, dtype,
                                    update_stream)) != INFLLMV2_OK)
    return st;
  if (l.dense) {
    if ((st = infllmv2_dense_decode_kvcache(q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, out, lse,
                                            at<void>(workspace, l.decode), l.total - l.decode, batch, total_q,
                                            max_seqlen_q, num_pages, page_size, pages_per_seq, heads, heads_k,
                                            head_dim, l.decode_splits, dtype, softmax_scale, stream)) != INFLLMV2_OK)
      return st;
    if (cudaError_t e = update.join(); e != cudaSuccess)
      return fail(INFLLMV2_ERR_CUDA, "%s: joining the compressed caches' update failed: %s", kCacheOp,
                  cudaGetErrorString(e));
    return INFLLMV2_OK;
  }
  int32_t* idx = at<int32_t>(workspace, l.idx);
  if ((st = infllmv2_select_decode_kvcache(
           q, ck_cache, c.approx_lse ? nk_cache : nullptr, cache_seqlens, cu_seqlens_q, idx,
           at<void>(workspace, l.select), l.decode - l.select, batch, total_q, max_seqlen_q, capacity, capacity_c,
           capacity_n, heads, heads_k, head_dim, l.cols, c.init_blocks, c.window_size / c.block_size,
           c.norm_kernel_size, c.norm_kernel_stride, dtype, softmax_scale, l.select_splits, stream)) != INFLLMV2_OK)
    return st;
  return infllmv2_sparse_decode_kvcache(q, k_cache, v_cache, block_table, cache_seqlens, idx, cu_seqlens_q, out, lse,
                                        at<void>(workspace, l.decode), l.total - l.decode, batch, total_q,
                                        max_seqlen_q, num_pages, page_size, pages_per_seq, heads, heads_k, head_dim,
                                        l.cols, l.decode_splits, dtype, softmax_scale, stream);
}
