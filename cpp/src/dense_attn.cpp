// infllmv2_dense_attn_{fwd,bwd}: validation and dispatch over the generated dense_attn units.
#include <string>

#include "registry.h"
#include "runtime.h"

using namespace infllmv2;

namespace {

struct Shape {
  int32_t batch;
  int64_t total_q, total_k;
  int32_t max_seqlen_q, max_seqlen_k, heads, heads_k, head_dim, causal;
  infllmv2_dtype dtype;
  float softmax_scale;
};

infllmv2_status check_shape(const char* op, const Shape& s) {
  infllmv2_status st = check_group_layout(op, s.dtype, s.head_dim, s.batch, s.heads, s.heads_k);
  if (st != INFLLMV2_OK) return st;
  if (s.causal != 0 && s.causal != 1) return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: causal must be 0 or 1, got %d", op, s.causal);
  // a tile is rows of one query head: heads are a grid axis
  if (s.heads > kMaxGridYZ) return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: heads must be at most %d, got %d", op, kMaxGridYZ, s.heads);
  return check_attn_sizes(op, s.total_q, s.total_k, s.max_seqlen_q, s.max_seqlen_k, s.softmax_scale);
}

std::string desc(const Shape& s) {
  return config_desc(s.dtype, s.head_dim);
}

template <class Unit>
auto matcher(const Shape& s) {
  return [&s](const Unit& u) { return u.dtype == s.dtype && u.head_dim == s.head_dim; };
}

}  // namespace

extern "C" INFLLMV2_API infllmv2_status infllmv2_dense_attn_fwd(
    const void* q, const void* k, const void* v, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, void* out,
    float* lse, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k,
    int32_t heads, int32_t heads_k, int32_t head_dim, int32_t causal, infllmv2_dtype dtype, float softmax_scale,
    cudaStream_t stream) {
  static const char* op = "infllmv2_dense_attn_fwd";
  clear_error();
  Shape s{batch, total_q, total_k, max_seqlen_q, max_seqlen_k, heads, heads_k, head_dim, causal, dtype, softmax_scale};
  infllmv2_status st = check_shape(op, s);
  if (st != INFLLMV2_OK) return st;
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(op, dev, {{"q", q}, {"out", out}, {"lse", lse}})) != INFLLMV2_OK)
    return st;
  if (total_k > 0 && (st = check_device_pointers(op, dev, {{"k", k}, {"v", v}})) != INFLLMV2_OK) return st;
  if ((st = check_aligned(op, {{"q", q}, {"k", k}, {"v", v}, {"out", out}})) != INFLLMV2_OK) return st;

  const infllmv2_dense_attn_fwd_unit* unit = nullptr;
  st = pick_unit(op, infllmv2_dense_attn_fwd_units, dev, matcher<infllmv2_dense_attn_fwd_unit>(s), desc(s), &unit);
  if (st != INFLLMV2_OK || total_q == 0 || max_seqlen_q == 0) return st;
  // A tile is block_m tokens of one query head; rows with no key get out = 0, lse = -inf.
  const int tiles = (max_seqlen_q + unit->block_m - 1) / unit->block_m;
  int rc = unit->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<int32_t*>(cu_seqlens_q),
                      const_cast<int32_t*>(cu_seqlens_k), out, lse, batch, tiles, heads / heads_k, causal,
                      attn_scale_log2(softmax_scale, head_dim), (int)total_q, heads, (int)total_k, heads_k, batch + 1,
                      stream);
  return launch_result(op, unit->name, rc, unit->last_error);
}

namespace {
// The backward's workspace: fp32 (2, heads, q_pad), log2(e) * lse and rowsum(dout * out), each
// head's row padded to q_pad floats so that the kernels can load row slices by TMA, which needs
// 16-byte aligned strides. The kernels assume this padding (dsl/dense_attn.py Q_PAD).
constexpr int64_t kStatsRowAlign = 4;
int64_t stats_q_pad(int64_t total_q) { return (total_q + kStatsRowAlign - 1) / kStatsRowAlign * kStatsRowAlign; }
}  // namespace

extern "C" INFLLMV2_API size_t infllmv2_dense_attn_bwd_workspace_size(int64_t total_q, int32_t heads) {
  if (total_q <= 0 || heads <= 0) return 0;
  return 2 * (size_t)stats_q_pad(total_q) * (size_t)heads * sizeof(float);
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_dense_attn_bwd(
    const void* q, const void* k, const void* v, const void* out, const void* dout, const float* lse,
    const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, void* dq, void* dk, void* dv, void* workspace,
    size_t workspace_size, int32_t batch, int64_t total_q, int64_t total_k, int32_t max_seqlen_q, int32_t max_seqlen_k,
    int32_t heads, int32_t heads_k, int32_t head_dim, int32_t causal, infllmv2_dtype dtype, float softmax_scale,
    cudaStream_t stream) {
  static const char* op = "infllmv2_dense_attn_bwd";
  clear_error();
  Shape s{batch, total_q, total_k, max_seqlen_q, max_seqlen_k, heads, heads_k, head_dim, causal, dtype, softmax_scale};
  infllmv2_status st = check_shape(op, s);
  if (st != INFLLMV2_OK) return st;
  const size_t need = infllmv2_dense_attn_bwd_workspace_size(total_q, heads);
  if (workspace_size < need)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: workspace_size is %zu bytes, infllmv2_dense_attn_bwd_workspace_size() asks for %zu", op,
                workspace_size, need);
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(op, dev, {{"q", q}, {"out", out}, {"dout", dout}, {"lse", lse},
                                                    {"dq", dq}, {"workspace", workspace}})) != INFLLMV2_OK)
    return st;
  if (total_k > 0 && (st = check_device_pointers(op, dev, {{"k", k}, {"v", v}, {"dk", dk}, {"dv", dv}})) != INFLLMV2_OK)
    return st;
  if ((st = check_aligned(op, {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"dout", dout}, {"dq", dq}, {"dk", dk},
                             {"dv", dv}, {"workspace", workspace}})) != INFLLMV2_OK)
    return st;

  const infllmv2_dense_attn_bwd_preprocess_unit* pre = nullptr;
  const infllmv2_dense_attn_bwd_dq_unit* udq = nullptr;
  const infllmv2_dense_attn_bwd_dkdv_unit* udkdv = nullptr;
  if ((st = pick_unit(op, infllmv2_dense_attn_bwd_preprocess_units, dev,
                      matcher<infllmv2_dense_attn_bwd_preprocess_unit>(s), desc(s), &pre)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_dense_attn_bwd_dq_units, dev, matcher<infllmv2_dense_attn_bwd_dq_unit>(s), desc(s),
                      &udq)) != INFLLMV2_OK ||
      (st = pick_unit(op, infllmv2_dense_attn_bwd_dkdv_units, dev, matcher<infllmv2_dense_attn_bwd_dkdv_unit>(s),
                      desc(s), &udkdv)) != INFLLMV2_OK)
    return st;
  if ((st = check_key_blocks_on_grid(op, max_seqlen_k, udkdv->block_n)) != INFLLMV2_OK) return st;
  if (total_k > 0 && max_seqlen_k > 0 && (total_q == 0 || max_seqlen_q == 0)) {
    // No query saw any key: the key gradients are zero, and no kernel would write them.
    const size_t bytes = (size_t)total_k * heads_k * head_dim * 2;
    cudaError_t e1 = cudaMemsetAsync(dk, 0, bytes, stream), e2 = cudaMemsetAsync(dv, 0, bytes, stream);
    if (e1 != cudaSuccess || e2 != cudaSuccess)
      return fail(INFLLMV2_ERR_CUDA, "%s: zeroing dk/dv failed: %s", op, cudaGetErrorString(e1 != cudaSuccess ? e1 : e2));
    return INFLLMV2_OK;
  }
  if (total_q == 0 || max_seqlen_q == 0) return INFLLMV2_OK;
  float* stats = static_cast<float*>(workspace);
  const int groups = heads / heads_k, q_pad = (int)stats_q_pad(total_q);
  const float sl2 = attn_scale_log2(softmax_scale, head_dim);
  int rc = pre->call(const_cast<void*>(out), const_cast<void*>(dout), const_cast<float*>(lse), stats, (int)total_q,
                     heads, q_pad, stream);
  if ((st = launch_result(op, pre->name, rc, pre->last_error)) != INFLLMV2_OK) return st;
  rc = udq->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(dout), stats,
                 const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k), dq, batch,
                 (max_seqlen_q + udq->block_m - 1) / udq->block_m, groups, causal, sl2, (int)total_q, heads,
                 (int)total_k, heads_k, q_pad, batch + 1, stream);
  if ((st = launch_result(op, udq->name, rc, udq->last_error)) != INFLLMV2_OK) return st;
  if (total_k == 0 || max_seqlen_k == 0) return INFLLMV2_OK;
  rc = udkdv->call(const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(dout), stats,
                   const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k), dk, dv, batch,
                   (max_seqlen_k + udkdv->block_n - 1) / udkdv->block_n, groups, causal, sl2, (int)total_q, heads,
                   (int)total_k, heads_k, q_pad, batch + 1, stream);
  return launch_result(op, udkdv->name, rc, udkdv->last_error);
}
