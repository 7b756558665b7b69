// The library-wide part of the C ABI: version, build info, errors, arch override.
#include "runtime.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "registry.h"

#ifndef INFLLMV2_VERSION
#define INFLLMV2_VERSION "0.0.0"
#endif

namespace infllmv2 {
namespace {

thread_local std::string g_last_error;

std::mutex g_mutex;
std::string g_override;  // guarded by g_mutex
bool g_override_loaded = false;

std::string build_info_json() {
  std::string archs, units;
  std::set<std::string> seen;
  for (const infllmv2_unit_info* u = infllmv2_all_units; u->kernel != nullptr; ++u) {
    if (seen.insert(u->arch).second) archs += std::string(archs.empty() ? "" : ", ") + "\"" + u->arch + "\"";
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s{\"kernel\": \"%s\", \"name\": \"%s\", \"arch\": \"%s\", \"threads\": %d, \"dynamic_smem\": %d}",
                  units.empty() ? "" : ", ", u->kernel, u->name, u->arch, u->threads, u->dynamic_smem);
    units += buf;
  }
  char head[256];
  std::snprintf(head, sizeof head,
                "{\"version\": \"%s\", \"abi_version\": %d, \"cuda_runtime\": %d, \"tilelang\": \"%s\", ",
                INFLLMV2_VERSION, INFLLMV2_ABI_VERSION, CUDART_VERSION, INFLLMV2_TILELANG_VERSION);
  return std::string(head) + "\"archs\": [" + archs + "], \"kernels\": [" + units + "]}";
}

}  // namespace

infllmv2_status fail(infllmv2_status status, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  g_last_error = buf;
  return status;
}

void clear_error() { g_last_error.clear(); }

const char* dtype_name(int dtype) {
  switch (dtype) {
    case INFLLMV2_DTYPE_BF16: return "bf16";
    case INFLLMV2_DTYPE_FP16: return "fp16";
    case INFLLMV2_DTYPE_FP32: return "fp32";
    default: return "unknown";
  }
}

std::string config_desc(int dtype, int head_dim) {
  return std::string("dtype=") + dtype_name(dtype) + " head_dim=" + std::to_string(head_dim);
}

std::string arch_override() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_override_loaded) {
    const char* env = std::getenv("INFLLMV2_FORCE_ARCH");
    if (env != nullptr) g_override = env;
    g_override_loaded = true;
  }
  return g_override;
}

bool arch_runs_on(const char* arch, int sm, int cc) {
  size_t n = std::strlen(arch);
  bool arch_specific = n > 0 && arch[n - 1] == 'a';
  return arch_specific ? cc == sm : cc >= sm;
}

std::string compiled_archs() {
  std::string out;
  std::set<std::string> seen;
  for (const infllmv2_unit_info* u = infllmv2_all_units; u->kernel != nullptr; ++u)
    if (seen.insert(u->arch).second) out += (out.empty() ? "" : ", ") + std::string(u->arch);
  return out.empty() ? "none" : out;
}

namespace {

// A device's fixed properties, read once: every call asks for them, and a decoding step makes
// several calls, each a few driver queries (about 0.5 us each) otherwise. Entries are written
// whole under g_mutex and published by `ready`.
struct DeviceProps {
  std::atomic<bool> ready{false};
  int cc = 0, smem_optin = 0, sms = 0;
};
constexpr int kMaxCachedDevices = 64;
DeviceProps g_props[kMaxCachedDevices];

cudaError_t read_props(int index, int* cc, int* smem_optin, int* sms) {
  if (index >= 0 && index < kMaxCachedDevices && g_props[index].ready.load(std::memory_order_acquire)) {
    *cc = g_props[index].cc, *smem_optin = g_props[index].smem_optin, *sms = g_props[index].sms;
    return cudaSuccess;
  }
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, index);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, index);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, index);
  if (err != cudaSuccess) return err;
  *cc = 10 * major + minor;
  if (index >= 0 && index < kMaxCachedDevices) {
    std::lock_guard<std::mutex> lock(g_mutex);
    DeviceProps& p = g_props[index];
    if (!p.ready.load(std::memory_order_relaxed)) {
      p.cc = *cc, p.smem_optin = *smem_optin, p.sms = *sms;
      p.ready.store(true, std::memory_order_release);
    }
  }
  return cudaSuccess;
}

}  // namespace

infllmv2_status current_device(const char* op, Device* dev) {
  cudaError_t err = cudaGetDevice(&dev->index);
  if (err == cudaSuccess) err = read_props(dev->index, &dev->cc, &dev->smem_optin, &dev->sms);
  if (err != cudaSuccess) {
    cudaGetLastError();  // do not leave a sticky-looking error for the caller's next check
    return fail(INFLLMV2_ERR_CUDA, "%s: no usable CUDA device: %s (%s)", op, cudaGetErrorString(err),
                cudaGetErrorName(err));
  }
  return INFLLMV2_OK;
}

infllmv2_status device_sms(const char* op, int* sms) {
  Device dev;
  infllmv2_status st = current_device(op, &dev);
  if (st == INFLLMV2_OK) *sms = dev.sms;
  return st;
}

int resolve_splits(int32_t num_splits, int64_t ctas, int64_t useful, int sms, int max_splits) {
  int64_t s;
  if (num_splits > 0) {
    s = num_splits;
  } else {
    if (ctas <= 0 || ctas >= sms) return 1;
    s = std::min<int64_t>(2 * (int64_t)sms / ctas, useful);
  }
  return (int)std::max<int64_t>(1, std::min<int64_t>(s, max_splits));
}

namespace {
thread_local int t_pointers_checked = 0;  // > 0 inside a PointersChecked scope
}  // namespace

PointersChecked::PointersChecked() { ++t_pointers_checked; }
PointersChecked::~PointersChecked() { --t_pointers_checked; }

infllmv2_status check_device_pointer(const char* op, const char* name, const void* ptr, const Device& dev) {
  if (ptr == nullptr) return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: %s is NULL", op, name);
  if (t_pointers_checked > 0) return INFLLMV2_OK;
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: %s is not a CUDA pointer (%s)", op, name, cudaGetErrorString(err));
  }
  if (attr.type == cudaMemoryTypeUnregistered || attr.type == cudaMemoryTypeHost)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: %s must be device memory, got a host pointer", op, name);
  if (attr.type == cudaMemoryTypeDevice && attr.device != dev.index)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: %s is on device %d but the current device is %d", op, name,
                attr.device, dev.index);
  return INFLLMV2_OK;
}

infllmv2_status init_unit_once(const char* op, const void* unit_key, int device, int (*init)(),
                               const char* (*last_error)()) {
  static std::set<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (done.count({unit_key, device})) return INFLLMV2_OK;
  if (init() != 0) return fail(INFLLMV2_ERR_CUDA, "%s: kernel initialisation failed: %s", op, last_error());
  done.insert({unit_key, device});
  return INFLLMV2_OK;
}

namespace {

struct SideStreams {
  std::vector<SideStream> per_device;
  ~SideStreams() {
    // at thread exit; during process teardown these may fail, which is harmless
    for (SideStream& s : per_device) {
      if (s.fork != nullptr) cudaEventDestroy(s.fork);
      if (s.join != nullptr) cudaEventDestroy(s.join);
      if (s.stream != nullptr) cudaStreamDestroy(s.stream);
    }
  }
};

// The thread's side stream on `device`. False where none can be had: creating it failed, or
// `stream` is being captured into a graph before this thread made one (creating it then could
// invalidate the capture); the caller then stays on its own stream.
bool side_stream(int device, cudaStream_t stream, SideStream* out) {
  thread_local SideStreams streams;
  if (device < 0) return false;
  if ((size_t)device >= streams.per_device.size()) streams.per_device.resize(device + 1);
  SideStream& s = streams.per_device[device];
  if (s.stream == nullptr) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
      cudaGetLastError();
      return false;
    }
    SideStream made;
    if (cudaStreamCreateWithFlags(&made.stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&made.fork, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&made.join, cudaEventDisableTiming) != cudaSuccess) {
      cudaGetLastError();
      if (made.fork != nullptr) cudaEventDestroy(made.fork);
      if (made.stream != nullptr) cudaStreamDestroy(made.stream);
      return false;
    }
    s = made;
  }
  *out = s;
  return true;
}

}  // namespace

cudaError_t SideBranch::fork(int device, cudaStream_t* out) {
  *out = caller_;
  if (armed_ || !side_stream(device, caller_, &side_)) return cudaSuccess;
  cudaError_t e = cudaEventRecord(side_.fork, caller_);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(side_.stream, side_.fork, 0);
  if (e != cudaSuccess) return e;
  armed_ = true;
  *out = side_.stream;
  return cudaSuccess;
}

cudaError_t SideBranch::join() {
  if (!armed_) return cudaSuccess;
  armed_ = false;
  cudaError_t e = cudaEventRecord(side_.join, side_.stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(caller_, side_.join, 0);
  if (e != cudaSuccess) cudaStreamSynchronize(side_.stream);  // no event to wait on
  return e;
}

infllmv2_status launch_result(const char* op, const char* unit_name, int rc, const char* (*last_error)()) {
  if (rc == 0) return INFLLMV2_OK;
  return fail(INFLLMV2_ERR_CUDA, "%s: launch of %s failed: %s", op, unit_name, last_error());
}

infllmv2_status check_device_pointers(const char* op, const Device& dev,
                                      std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  for (const auto& p : ptrs) {
    infllmv2_status st = check_device_pointer(op, p.first, p.second, dev);
    if (st != INFLLMV2_OK) return st;
  }
  return INFLLMV2_OK;
}

infllmv2_status check_aligned(const char* op, std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  for (const auto& p : ptrs)
    if (reinterpret_cast<uintptr_t>(p.second) % 16 != 0)
      return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: %s must be 16-byte aligned, got address %p", op, p.first, p.second);
  return INFLLMV2_OK;
}

infllmv2_status check_group_layout(const char* op, int dtype, int head_dim, int batch, int heads, int heads_k) {
  if (dtype != INFLLMV2_DTYPE_BF16 && dtype != INFLLMV2_DTYPE_FP16)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: dtype must be INFLLMV2_DTYPE_BF16 or INFLLMV2_DTYPE_FP16, got %d",
                op, dtype);
  if (head_dim != 64 && head_dim != 128)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: head_dim must be 64 or 128, got %d", op, head_dim);
  if (batch < 1 || batch > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: batch must be in [1, %d], got %d", op, kMaxGridYZ, batch);
  if (heads_k < 1 || heads_k > kMaxGridYZ)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: heads_k must be in [1, %d], got %d", op, kMaxGridYZ, heads_k);
  if (heads < heads_k || heads % heads_k != 0)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: heads (%d) must be a multiple of heads_k (%d)", op, heads,
                heads_k);
  if (heads / heads_k > 64)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: group size heads/heads_k = %d exceeds 64, the query rows of one tile",
                op, heads / heads_k);
  return INFLLMV2_OK;
}

infllmv2_status check_cache_layout(const char* op, bool paged, int32_t batch, int64_t num_pages,
                                   int32_t page_size, int32_t pages_per_seq, int block) {
  if (page_size < 1)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: page_size must be >= 1, got %d", op, page_size);
  if (num_pages < 1 || num_pages > INT32_MAX / page_size)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: num_pages must be in [1, 2^31 / page_size = %d], got %lld", op,
                INT32_MAX / page_size, (long long)num_pages);
  if (!paged) {
    if (pages_per_seq != 0)
      return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                  "%s: pages_per_seq must be 0 for a padded cache (block_table NULL), got %d", op, pages_per_seq);
    if (num_pages < batch)
      return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                  "%s: a padded cache (block_table NULL) needs a page a sequence: num_pages (%lld) < batch (%d)", op,
                  (long long)num_pages, batch);
    return INFLLMV2_OK;
  }
  if (pages_per_seq < 1 || (int64_t)pages_per_seq * batch > INT32_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT,
                "%s: pages_per_seq must be >= 1 with a block_table (and batch x pages_per_seq < 2^31), got %d", op,
                pages_per_seq);
  if (pages_per_seq > 1 && page_size % block != 0)
    return fail(INFLLMV2_ERR_UNSUPPORTED,
                "%s: page_size must be a multiple of %d (the block size) with several pages a sequence, got %d", op,
                block, page_size);
  if ((int64_t)pages_per_seq * page_size > INT32_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: pages_per_seq x page_size must be < 2^31, got %d x %d", op,
                pages_per_seq, page_size);
  return INFLLMV2_OK;
}

infllmv2_status check_phsa_lambda(const char* op, const void* punct, float phsa_lambda) {
  if (punct != nullptr && !(phsa_lambda >= 0.0f && phsa_lambda <= 1.0f))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: phsa_lambda must be in [0, 1], got %g", op, (double)phsa_lambda);
  return INFLLMV2_OK;
}

infllmv2_status check_key_blocks_on_grid(const char* op, int32_t max_seqlen_k, int block) {
  if (((int64_t)max_seqlen_k + block - 1) / block > kMaxGridYZ)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: max_seqlen_k must be at most %d in the backward, got %d", op,
                kMaxGridYZ * block, max_seqlen_k);
  return INFLLMV2_OK;
}

infllmv2_status check_attn_sizes(const char* op, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
                                 int32_t max_seqlen_k, float softmax_scale) {
  if (total_q < 0 || total_q > INT_MAX || total_k < 0 || total_k > INT_MAX)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: total_q and total_k must be in [0, 2^31), got %lld and %lld", op,
                (long long)total_q, (long long)total_k);
  if (max_seqlen_q < 0 || max_seqlen_q > total_q)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_q must be in [0, total_q=%lld], got %d", op,
                (long long)total_q, max_seqlen_q);
  if (max_seqlen_k < 0 || max_seqlen_k > total_k)
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: max_seqlen_k must be in [0, total_k=%lld], got %d", op,
                (long long)total_k, max_seqlen_k);
  if (!(softmax_scale >= 0.0f) || !std::isfinite(softmax_scale))
    return fail(INFLLMV2_ERR_INVALID_ARGUMENT, "%s: softmax_scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got %g",
                op, (double)softmax_scale);
  return INFLLMV2_OK;
}

float attn_scale_log2(float softmax_scale, int head_dim) {
  const float scale = softmax_scale > 0.0f ? softmax_scale : 1.0f / std::sqrt((float)head_dim);
  return scale * 1.4426950408889634f;
}

}  // namespace infllmv2

using namespace infllmv2;

extern "C" {

INFLLMV2_API int infllmv2_abi_version(void) { return INFLLMV2_ABI_VERSION; }

INFLLMV2_API const char* infllmv2_version(void) { return INFLLMV2_VERSION; }

INFLLMV2_API const char* infllmv2_build_info(void) {
  static const std::string info = build_info_json();
  return info.c_str();
}

INFLLMV2_API const char* infllmv2_last_error(void) { return g_last_error.c_str(); }

INFLLMV2_API infllmv2_status infllmv2_set_arch_override(const char* arch) {
  std::string want = arch == nullptr ? "" : arch;
  if (!want.empty()) {
    bool known = false;
    for (const infllmv2_unit_info* u = infllmv2_all_units; u->kernel != nullptr; ++u) known |= want == u->arch;
    if (!known)
      return fail(INFLLMV2_ERR_UNSUPPORTED_ARCH, "infllmv2_set_arch_override: arch '%s' is not compiled in; compiled archs: %s",
                  want.c_str(), compiled_archs().c_str());
  }
  arch_override();  // load the environment first so that it cannot overwrite this call later
  std::lock_guard<std::mutex> lock(g_mutex);
  g_override = want;
  return INFLLMV2_OK;
}

INFLLMV2_API const char* infllmv2_selected_arch(void) {
  Device dev;
  if (current_device("infllmv2_selected_arch", &dev) != INFLLMV2_OK) return nullptr;
  std::string forced = arch_override();
  const infllmv2_unit_info* best = nullptr;
  int best_sm = -1;
  for (const infllmv2_unit_info* u = infllmv2_all_units; u->kernel != nullptr; ++u) {
    int sm = std::atoi(u->arch + 3);
    bool usable = forced.empty() ? arch_runs_on(u->arch, sm, dev.cc) : forced == u->arch;
    if (usable && sm > best_sm) best = u, best_sm = sm;
  }
  if (best == nullptr) {
    fail(INFLLMV2_ERR_UNSUPPORTED_ARCH, "the GPU (device %d) is sm_%d, which this build does not support; compiled archs: %s",
         dev.index, dev.cc, compiled_archs().c_str());
    return nullptr;
  }
  return best->arch;
}

}  // extern "C"
