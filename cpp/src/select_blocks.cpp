// infllmv2_select_blocks, infllmv2_group_scores, infllmv2_max_pool_blocks: validation and
// dispatch over the generated select_blocks units (stage 1).
#include <algorithm>
#include <climits>
#include <cmath>
#include <string>

#include "registry.h"
#include "runtime.h"

using namespace infllmv2;

namespace {

constexpr int kMaxTopk = 8192;

struct Shape {
  int32_t batch;
  int64_t total_q, total_c, total_norm;
  int32_t max_seqlen_q, heads, heads_k, head_dim;
  infllmv2_dtype dtype;
  bool has_norm;
  int32_t norm_kernel_size, norm_kernel_stride;
  float softmax_scale;
};

infllmv2_status check_shape(const char* op, const Shape& s) {
  infllmv2_status st = check_group_layout(op, s.dtype, s.head_dim, s.batch, s.heads, s.heads_k);
  if (st != INFLLMV2_OK) return st;
  if (s.total_q < 0 || s.total_q > INT_MAX || s.total_c < 0 || s.total_c > INT_MAX || s.total_norm < 0 ||
      s.total_norm > INT_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: total_q, total_c and total_norm must be in [0, 2^31), got %lld, %lld and %lld", op,
                (long long)s.total_q, (long long)s.total_c, (long long)s.total_norm);
  if (s.max_seqlen_q < 0 || s.max_seqlen_q > s.total_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_q must be in [0, total_q=%lld], got %d", op,
                (long long)s.total_q, s.max_seqlen_q);
  if (s.has_norm && (s.norm_kernel_size < 1 || s.norm_kernel_stride < 1))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: norm_kernel_size and norm_kernel_stride must be >= 1, got %d and %d",
                op, s.norm_kernel_size, s.norm_kernel_stride);
  if (!(s.softmax_scale >= 0.0f) || !std::isfinite(s.softmax_scale))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: softmax_scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got %g",
                op, (double)s.softmax_scale);
  return INFLLMV2_OK;
}

float scale_log2(const Shape& s) {
  float scale = s.softmax_scale > 0.0f ? s.softmax_scale : 1.0f / std::sqrt((float)s.head_dim);
  return scale * 1.4426950408889634f;  // the kernels use exp2
}

std::string desc(const Shape& s) {
  return config_desc(s.dtype, s.head_dim);
}

template <class Unit>
auto matcher(const Shape& s) {
  return [&s](const Unit& u) { return u.dtype == s.dtype && u.head_dim == s.head_dim; };
}

// Pointer checks common to select_blocks and group_scores; `out` is topk_idx or scores.
infllmv2_status check_scoring_pointers(const char* op, const Device& dev, const Shape& s, const void* q,
                                       const void* ck, const void* norm_keys, const int32_t* cu_q,
                                       const int32_t* cu_k, const int32_t* cu_c, const int32_t* cu_norm,
                                       const char* out_name, const void* out) {
  infllmv2_status st =
      check_device_pointers(op, dev, {{"cu_seqlens_q", cu_q}, {"cu_seqlens_k", cu_k}, {"cu_seqlens_c", cu_c}});
  if (st != INFLLMV2_OK) return st;
  if (s.has_norm && (st = check_device_pointers(op, dev, {{"cu_seqlens_norm", cu_norm}})) != INFLLMV2_OK) return st;
  if (s.total_q > 0 && (st = check_device_pointers(op, dev, {{"q", q}, {out_name, out}})) != INFLLMV2_OK) return st;
  if (s.total_c > 0 && (st = check_device_pointers(op, dev, {{"ck", ck}})) != INFLLMV2_OK) return st;
  if (s.has_norm && s.total_norm > 0 && (st = check_device_pointers(op, dev, {{"norm_keys", norm_keys}})) != INFLLMV2_OK)
    return st;
  return check_aligned(op, {{"q", q}, {"ck", ck}, {"norm_keys", s.has_norm ? norm_keys : nullptr}});
}

// The normaliser the kernels iterate: norm_keys, or the fine keys themselves (exact).
struct Norm {
  void* keys;
  int32_t* cu;
  int total;
  int window, stride, approx;
};

template <class Unit>
Norm normaliser(const Shape& s, const Unit* u, const void* ck, const void* norm_keys, const int32_t* cu_c,
                const int32_t* cu_norm) {
  if (s.has_norm)
    return {const_cast<void*>(norm_keys), const_cast<int32_t*>(cu_norm), (int)s.total_norm, s.norm_kernel_size,
            s.norm_kernel_stride, 1};
  return {const_cast<void*>(ck), const_cast<int32_t*>(cu_c), (int)s.total_c, u->fine_w, u->fine_s, 0};
}

}  // namespace

extern "C" INFLLMV2_API infllmv2_status infllmv2_select_blocks(
    const void* q, const void* ck, const void* norm_keys, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const int32_t* cu_seqlens_c, const int32_t* cu_seqlens_norm, int32_t* topk_idx, int32_t batch, int64_t total_q,
    int64_t total_c, int64_t total_norm, int32_t max_seqlen_q, int32_t max_seqlen_k, int32_t heads, int32_t heads_k,
    int32_t head_dim, int32_t topk, int32_t init_blocks, int32_t local_blocks, int32_t norm_kernel_size,
    int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale, cudaStream_t stream) {
  static const char* op = "infllmv2_select_blocks";
  clear_error();
  Shape s{batch, total_q, total_c, norm_keys ? total_norm : 0, max_seqlen_q, heads, heads_k, head_dim, dtype,
          norm_keys != nullptr, norm_kernel_size, norm_kernel_stride, softmax_scale};
  infllmv2_status st = check_shape(op, s);
  if (st != INFLLMV2_OK) return st;
  if (topk < 1 || topk > kMaxTopk)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: topk must be in [1, %d], got %d", op, kMaxTopk, topk);
  if (init_blocks < 0 || local_blocks < 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: init_blocks and local_blocks must be >= 0, got %d and %d", op,
                init_blocks, local_blocks);
  if (max_seqlen_k < 0 || max_seqlen_k < max_seqlen_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_k must be >= max_seqlen_q (%d) and >= 0, got %d", op,
                max_seqlen_q, max_seqlen_k);
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_scoring_pointers(op, dev, s, q, ck, norm_keys, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c,
                                   cu_seqlens_norm, "topk_idx", topk_idx)) != INFLLMV2_OK)
    return st;
  const infllmv2_select_blocks_unit* unit = nullptr;
  st = pick_unit(op, infllmv2_select_blocks_units, dev, matcher<infllmv2_select_blocks_unit>(s), desc(s), &unit);
  if (st != INFLLMV2_OK || total_q == 0 || max_seqlen_q == 0) return st;
  // A tile keeps T tokens' block scores in shared memory: T * n_blocks <= score_cap.
  const int n_blocks = (max_seqlen_k + unit->block - 1) / unit->block;
  if (n_blocks > unit->score_cap)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: max_seqlen_k = %d is %d blocks of %d; this build selects over at most %d",
                op, max_seqlen_k, n_blocks, unit->block, unit->score_cap);
  const int groups = heads / heads_k;
  int T = std::min(unit->block_m / groups, unit->t_max);
  if (T * n_blocks > unit->score_cap) T = unit->score_cap / n_blocks;
  const Norm n = normaliser(s, unit, ck, norm_keys, cu_seqlens_c, cu_seqlens_norm);
  int rc = unit->call(const_cast<void*>(q), const_cast<void*>(ck), n.keys, const_cast<int32_t*>(cu_seqlens_q),
                      const_cast<int32_t*>(cu_seqlens_k), const_cast<int32_t*>(cu_seqlens_c), n.cu, topk_idx, batch,
                      (max_seqlen_q + T - 1) / T, groups, T, n_blocks, init_blocks, local_blocks, n.window, n.stride,
                      n.approx, scale_log2(s), (int)total_q, heads, (int)total_c, heads_k, n.total, batch + 1, topk,
                      stream);
  return launch_result(op, unit->name, rc, unit->last_error);
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_group_scores(
    const void* q, const void* ck, const void* norm_keys, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k,
    const int32_t* cu_seqlens_c, const int32_t* cu_seqlens_norm, float* scores, int32_t batch, int64_t total_q,
    int64_t total_c, int64_t total_norm, int32_t max_seqlen_q, int32_t width, int32_t heads, int32_t heads_k,
    int32_t head_dim, int32_t norm_kernel_size, int32_t norm_kernel_stride, infllmv2_dtype dtype, float softmax_scale,
    cudaStream_t stream) {
  static const char* op = "infllmv2_group_scores";
  clear_error();
  Shape s{batch, total_q, total_c, norm_keys ? total_norm : 0, max_seqlen_q, heads, heads_k, head_dim, dtype,
          norm_keys != nullptr, norm_kernel_size, norm_kernel_stride, softmax_scale};
  infllmv2_status st = check_shape(op, s);
  if (st != INFLLMV2_OK) return st;
  if (width < 1) return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: width must be >= 1, got %d", op, width);
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_scoring_pointers(op, dev, s, q, ck, norm_keys, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c,
                                   cu_seqlens_norm, "scores", scores)) != INFLLMV2_OK)
    return st;
  const infllmv2_group_scores_unit* unit = nullptr;
  st = pick_unit(op, infllmv2_group_scores_units, dev, matcher<infllmv2_group_scores_unit>(s), desc(s), &unit);
  if (st != INFLLMV2_OK || total_q == 0 || max_seqlen_q == 0) return st;
  const int groups = heads / heads_k, T = std::min(unit->block_m / groups, unit->t_max);
  const Norm n = normaliser(s, unit, ck, norm_keys, cu_seqlens_c, cu_seqlens_norm);
  int rc = unit->call(const_cast<void*>(q), const_cast<void*>(ck), n.keys, const_cast<int32_t*>(cu_seqlens_q),
                      const_cast<int32_t*>(cu_seqlens_k), const_cast<int32_t*>(cu_seqlens_c), n.cu, scores, batch,
                      (max_seqlen_q + T - 1) / T, groups, T, n.window, n.stride, n.approx, scale_log2(s), (int)total_q,
                      heads, (int)total_c, heads_k, n.total, batch + 1, width, stream);
  return launch_result(op, unit->name, rc, unit->last_error);
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_max_pool_blocks(
    const float* scores, const int32_t* cu_seqlens_q, const int32_t* cu_seqlens_k, const int32_t* cu_seqlens_c,
    float* block_scores, int32_t batch, int64_t total_q, int32_t width, int32_t n_blocks, int32_t max_seqlen_q,
    int32_t heads_k, int32_t init_blocks, int32_t local_blocks, cudaStream_t stream) {
  static const char* op = "infllmv2_max_pool_blocks";
  clear_error();
  if (batch < 1 || batch > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: batch must be in [1, %d], got %d", op, kMaxGridYZ, batch);
  if (heads_k < 1 || heads_k > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: heads_k must be in [1, %d], got %d", op, kMaxGridYZ, heads_k);
  if (total_q < 0 || total_q > INT_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: total_q must be in [0, 2^31), got %lld", op, (long long)total_q);
  if (width < 1 || n_blocks < 1)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: width and n_blocks must be >= 1, got %d and %d", op, width, n_blocks);
  if (max_seqlen_q < 0 || max_seqlen_q > total_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_q must be in [0, total_q=%lld], got %d", op,
                (long long)total_q, max_seqlen_q);
  if (init_blocks < 0 || local_blocks < 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: init_blocks and local_blocks must be >= 0, got %d and %d", op,
                init_blocks, local_blocks);
  Device dev;
  infllmv2_status st = current_device(op, &dev);
  if (st != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"cu_seqlens_q", cu_seqlens_q}, {"cu_seqlens_k", cu_seqlens_k},
                                            {"cu_seqlens_c", cu_seqlens_c}})) != INFLLMV2_OK)
    return st;
  if (total_q > 0 && (st = check_device_pointers(op, dev, {{"scores", scores}, {"block_scores", block_scores}})) !=
                         INFLLMV2_OK)
    return st;
  const infllmv2_max_pool_blocks_unit* unit = nullptr;
  st = pick_unit(op, infllmv2_max_pool_blocks_units, dev,
                 [](const infllmv2_max_pool_blocks_unit& u) { return u.dtype == INFLLMV2_DTYPE_FP32; }, "dtype=fp32",
                 &unit);
  if (st != INFLLMV2_OK || total_q == 0 || max_seqlen_q == 0) return st;
  int rc = unit->call(const_cast<float*>(scores), const_cast<int32_t*>(cu_seqlens_q), const_cast<int32_t*>(cu_seqlens_k),
                      const_cast<int32_t*>(cu_seqlens_c), block_scores, batch, max_seqlen_q, init_blocks, local_blocks,
                      heads_k, (int)total_q, width, batch + 1, n_blocks, stream);
  return launch_result(op, unit->name, rc, unit->last_error);
}
