// infllmv2_compress_keys: validation and dispatch over the generated compress_keys units.
#include <climits>
#include <numeric>
#include <string>

#include "registry.h"
#include "runtime.h"

using namespace infllmv2;

namespace {
constexpr const char* kOp = "infllmv2_compress_keys";
// CUDA limits gridDim.y and gridDim.z, which carry the batch and the KV heads.
}  // namespace

extern "C" INFLLMV2_API infllmv2_status infllmv2_compress_keys(
    const void* k, const int32_t* cu_seqlens_k, const int32_t* cu_seqlens_c, const uint8_t* punct_mask,
    float phsa_lambda, void* ck, int32_t batch, int64_t total_k, int64_t total_c, int32_t max_nc,
    int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype, int32_t kernel_size, int32_t kernel_stride,
    cudaStream_t stream) {
  clear_error();
  if (dtype != INFLLMV2_DTYPE_BF16 && dtype != INFLLMV2_DTYPE_FP16)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: dtype must be INFLLMV2_DTYPE_BF16 or INFLLMV2_DTYPE_FP16, got %d", kOp,
                (int)dtype);
  if (head_dim != 64 && head_dim != 128)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: head_dim must be 64 or 128, got %d", kOp, head_dim);
  if (batch < 1 || batch > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: batch must be in [1, %d], got %d", kOp, kMaxGridYZ, batch);
  if (heads_k < 1 || heads_k > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: heads_k must be in [1, %d], got %d", kOp, kMaxGridYZ, heads_k);
  if (total_k < 0 || total_k > INT_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: total_k must be in [0, 2^31), got %lld", kOp, (long long)total_k);
  if (total_c < 0 || total_c > INT_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: total_c must be in [0, 2^31), got %lld", kOp, (long long)total_c);
  if (max_nc < 0 || max_nc > total_c)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_nc must be in [0, total_c=%lld], got %d", kOp,
                (long long)total_c, max_nc);
  if (kernel_size < 1 || kernel_stride < 1)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: kernel_size and kernel_stride must be >= 1, got %d and %d", kOp,
                kernel_size, kernel_stride);
  infllmv2_status st = check_phsa_lambda(kOp, punct_mask, phsa_lambda);
  if (st != INFLLMV2_OK) return st;
  // total_c bounds every row the kernel writes; a bound beyond what the lengths allow is a
  // caller bug worth naming rather than a silent partial write.
  if (total_c > total_k / kernel_stride + batch)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: total_c=%lld exceeds what total_k=%lld keys can give with stride %d over %d sequences", kOp,
                (long long)total_c, (long long)total_k, kernel_stride, batch);

  Device dev;
  if ((st = current_device(kOp, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointer(kOp, "cu_seqlens_k", cu_seqlens_k, dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointer(kOp, "cu_seqlens_c", cu_seqlens_c, dev)) != INFLLMV2_OK) return st;
  if (total_k > 0 && (st = check_device_pointer(kOp, "k", k, dev)) != INFLLMV2_OK) return st;
  if (total_c > 0 && (st = check_device_pointer(kOp, "ck", ck, dev)) != INFLLMV2_OK) return st;
  if (punct_mask != nullptr && total_k > 0 &&
      (st = check_device_pointer(kOp, "punct_mask", punct_mask, dev)) != INFLLMV2_OK)
    return st;
  if ((st = check_aligned(kOp, {{"k", k}, {"ck", ck}})) != INFLLMV2_OK) return st;

  const int phsa = punct_mask != nullptr;
  const std::string desc = config_desc(dtype, head_dim);
  if (!phsa) {
    const infllmv2_compress_keys_unit* unit = nullptr;
    st = pick_unit(kOp, infllmv2_compress_keys_units, dev,
                   [&](const infllmv2_compress_keys_unit& u) { return u.dtype == dtype && u.head_dim == head_dim; },
                   desc, &unit);
    if (st != INFLLMV2_OK) return st;
    if (total_c == 0 || max_nc == 0) return INFLLMV2_OK;
    // the kernel sums runs of gcd(window, stride) keys once and each window from them
    int rc = unit->call(const_cast<void*>(k), const_cast<int32_t*>(cu_seqlens_k), const_cast<int32_t*>(cu_seqlens_c),
                        ck, batch, max_nc, kernel_size, kernel_stride, std::gcd(kernel_size, kernel_stride),
                        (int)total_k, heads_k, batch + 1, (int)total_c, stream);
    return launch_result(kOp, unit->name, rc, unit->last_error);
  }
  const infllmv2_compress_keys_phsa_unit* unit = nullptr;
  st = pick_unit(kOp, infllmv2_compress_keys_phsa_units, dev,
                 [&](const infllmv2_compress_keys_phsa_unit& u) { return u.dtype == dtype && u.head_dim == head_dim; },
                 desc + " (PHSA)", &unit);
  if (st != INFLLMV2_OK) return st;
  if (total_c == 0 || max_nc == 0) return INFLLMV2_OK;
  int rc = unit->call(const_cast<void*>(k), const_cast<int32_t*>(cu_seqlens_k), const_cast<int32_t*>(cu_seqlens_c),
                      const_cast<uint8_t*>(punct_mask), ck, batch, max_nc, kernel_size, kernel_stride, phsa_lambda,
                      (int)total_k, heads_k, batch + 1, (int)total_c, stream);
  return launch_result(kOp, unit->name, rc, unit->last_error);
}
