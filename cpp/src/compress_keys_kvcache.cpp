// infllmv2_compress_keys_kvcache: the compressed keys that a KV cache's newest keys completed,
// written into a compressed cache kept across decoding steps.
#include <algorithm>
#include <climits>
#include <numeric>
#include <string>

#include "registry.h"
#include "runtime.h"
#include "stage1.h"

using namespace infllmv2;

infllmv2_status infllmv2::check_compressed_capacity(const char* op, const char* name, int32_t capacity_c,
                                                    int64_t capacity, int w, int s, int32_t batch) {
  const int64_t need = windows(capacity, w, s);
  if (capacity_c < std::max<int64_t>(need, 1) || (int64_t)batch * capacity_c > INT_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: %s must hold the %lld compressed keys (window %d, stride %d) of a full cache of capacity %lld, "
                "with batch x %s < 2^31; got %d",
                op, name, (long long)std::max<int64_t>(need, 1), w, s, (long long)capacity, name, capacity_c);
  return INFLLMV2_OK;
}

infllmv2_status infllmv2::compress_kvcache_levels(const char* op, const void* k_cache, const int32_t* block_table,
                                                  const int32_t* cache_seqlens, const uint8_t* punct_cache,
                                                  float phsa_lambda, const CompressedLevel* levels,
                                                  int n_levels, int32_t batch, int64_t num_pages, int32_t page_size,
                                                  int32_t pages_per_seq, int32_t new_keys, int32_t heads_k,
                                                  int32_t head_dim, infllmv2_dtype dtype, cudaStream_t stream) {
  // dtype, head_dim, and batch and heads_k within a grid axis (one head a group: no query heads here)
  infllmv2_status st = check_group_layout(op, dtype, head_dim, batch, heads_k, heads_k);
  if (st != INFLLMV2_OK) return st;
  if (heads_k > kMaxGridYZ / std::max(n_levels, 1))  // the levels share grid z
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: heads_k must be at most %d to update %d compressed caches in one "
                "launch, got %d", op, kMaxGridYZ / n_levels, n_levels, heads_k);
  if (new_keys < 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: new_keys must be >= 0, got %d", op, new_keys);
  if ((st = check_phsa_lambda(op, punct_cache, phsa_lambda)) != INFLLMV2_OK) return st;
  if ((st = check_cache_layout(op, block_table != nullptr, batch, num_pages, page_size, pages_per_seq, kBlock)) !=
      INFLLMV2_OK)
    return st;
  const int64_t capacity = (int64_t)page_size * std::max(pages_per_seq, 1);
  Device dev;
  if ((st = current_device(op, &dev)) != INFLLMV2_OK) return st;
  if ((st = check_device_pointers(op, dev, {{"k_cache", k_cache}, {"cache_seqlens", cache_seqlens}})) != INFLLMV2_OK)
    return st;
  if (block_table != nullptr && (st = check_device_pointers(op, dev, {{"block_table", block_table}})) != INFLLMV2_OK)
    return st;
  if (punct_cache != nullptr && (st = check_device_pointers(op, dev, {{"punct_cache", punct_cache}})) != INFLLMV2_OK)
    return st;
  if ((st = check_aligned(op, {{"k_cache", k_cache}})) != INFLLMV2_OK) return st;
  for (int i = 0; i < n_levels; ++i) {
    const CompressedLevel& l = levels[i];
    if (l.window < 1 || l.stride < 1)
      return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: %s and %s must be >= 1, got %d and %d", op, l.window_name,
                  l.stride_name, l.window, l.stride);
    if ((st = check_compressed_capacity(op, l.capacity_name, l.capacity_c, capacity, l.window, l.stride, batch)) !=
        INFLLMV2_OK)
      return st;
    if ((st = check_device_pointers(op, dev, {{l.cache_name, l.cache}})) != INFLLMV2_OK) return st;
    if ((st = check_aligned(op, {{l.cache_name, l.cache}})) != INFLLMV2_OK) return st;
  }
  auto config = [&](const auto& u) { return u.dtype == dtype && u.head_dim == head_dim; };
  const infllmv2_compress_keys_kvcache_unit* unit = nullptr;
  const infllmv2_compress_keys_kvcache_phsa_unit* phsa_unit = nullptr;
  st = punct_cache == nullptr
           ? pick_unit(op, infllmv2_compress_keys_kvcache_units, dev, config, config_desc(dtype, head_dim), &unit)
           : pick_unit(op, infllmv2_compress_keys_kvcache_phsa_units, dev, config,
                       config_desc(dtype, head_dim) + " with PHSA", &phsa_unit);
  if (st != INFLLMV2_OK) return st;
  // keys past the capacity are never read: a larger count recomputes the same entries
  const int32_t fresh = (int32_t)std::min<int64_t>(new_keys, capacity);
  if (fresh == 0 || n_levels == 0) return INFLLMV2_OK;
  const CompressedLevel& a = levels[0];
  const CompressedLevel& b = levels[n_levels - 1];  // not read by the kernel with one level
  const CacheTable t = cache_table(block_table, cache_seqlens, batch, pages_per_seq);
  const int cache_rows = (int)(num_pages * page_size);
  if (phsa_unit != nullptr) {
    int rc = phsa_unit->call(const_cast<void*>(k_cache), t.table, const_cast<int32_t*>(cache_seqlens),
                             const_cast<uint8_t*>(punct_cache), a.cache, b.cache, fresh, n_levels,
                             std::min(a.stride, b.stride), a.capacity_c, a.window, a.stride, b.capacity_c, b.window,
                             b.stride, page_size, pages_per_seq, (int)num_pages, phsa_lambda, cache_rows, heads_k,
                             t.len, batch, batch * a.capacity_c, batch * b.capacity_c, stream);
    return launch_result(op, phsa_unit->name, rc, phsa_unit->last_error);
  }
  int rc = unit->call(const_cast<void*>(k_cache), t.table, const_cast<int32_t*>(cache_seqlens), a.cache, b.cache,
                      fresh, n_levels, std::min(a.stride, b.stride), a.capacity_c, a.window, a.stride,
                      std::gcd(a.window, a.stride), b.capacity_c, b.window, b.stride, std::gcd(b.window, b.stride),
                      page_size, pages_per_seq, (int)num_pages, cache_rows, heads_k, t.len, batch,
                      batch * a.capacity_c, batch * b.capacity_c, stream);
  return launch_result(op, unit->name, rc, unit->last_error);
}

extern "C" INFLLMV2_API infllmv2_status infllmv2_compress_keys_kvcache(
    const void* k_cache, const int32_t* block_table, const int32_t* cache_seqlens, const uint8_t* punct_cache,
    float phsa_lambda, void* ck_cache, int32_t batch,
    int64_t num_pages, int32_t page_size, int32_t pages_per_seq, int32_t capacity_c, int32_t new_keys,
    int32_t heads_k, int32_t head_dim, infllmv2_dtype dtype, int32_t kernel_size, int32_t kernel_stride,
    cudaStream_t stream) {
  clear_error();
  const CompressedLevel level{ck_cache, capacity_c, kernel_size, kernel_stride, "ck_cache", "capacity_c",
                              "kernel_size", "kernel_stride"};
  return compress_kvcache_levels("infllmv2_compress_keys_kvcache", k_cache, block_table, cache_seqlens, punct_cache,
                                 phsa_lambda, &level, 1,
                                 batch, num_pages, page_size, pages_per_seq, new_keys, heads_k, head_dim, dtype,
                                 stream);
}
