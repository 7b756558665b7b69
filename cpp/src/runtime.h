// Host glue shared by the op wrappers: error reporting, argument checks, arch dispatch over
// the generated unit tables, and once-per-device unit initialisation.
#pragma once

#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <initializer_list>
#include <string>
#include <utility>

#include "infllmv2.h"

namespace infllmv2 {

// The largest grid y and z dimension (batch, KV heads, the dense dK/dV kernel's key blocks).
constexpr int kMaxGridYZ = 65535;

// Records the message for infllmv2_last_error() and returns the status, so that wrappers
// can `return fail(...)`.
infllmv2_status fail(infllmv2_status status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void clear_error();

const char* dtype_name(int dtype);
// "dtype=bf16 head_dim=128": how a unit's configuration is named in pick_unit's errors.
std::string config_desc(int dtype, int head_dim);

// Tokens a query tile of block_m rows holds at G = groups, at most the unit's t_max (the
// sparse_attn and sparse_decode tiles: min(block_m / G, t_max) tokens x G heads).
inline int tile_tokens(int block_m, int t_max, int groups) {
  const int t = block_m / groups;
  return t < t_max ? t : t_max;
}

// The device the next launch goes to, with what dispatch needs to know about it.
struct Device {
  int index = 0;
  int cc = 0;          // compute capability as 10*major + minor
  int smem_optin = 0;  // max dynamic shared memory per block
  int sms = 0;         // multiprocessors
};
infllmv2_status current_device(const char* op, Device* dev);

// The current device's multiprocessor count (the split-KV ops size their grids by it).
infllmv2_status device_sms(const char* op, int* sms);

// The splits a split op (sparse_decode, select_decode) runs: the caller's num_splits when > 0;
// else 1 when the ctas alone reach the multiprocessors, otherwise the most that keep ctas x
// splits within twice them, at most `useful` (what the work can feed); capped to [1, max_splits].
int resolve_splits(int32_t num_splits, int64_t ctas, int64_t useful, int sms, int max_splits);

// Checks that ptr is device memory of dev (not host, not another GPU). `name` is the
// argument's name in the C ABI.
infllmv2_status check_device_pointer(const char* op, const char* name, const void* ptr, const Device& dev);

// While one is alive on a thread, check_device_pointer checks only for NULL. A composite entry
// point (infllmv2_attention_kvcache) holds one around the ops it calls, after checking every
// pointer it hands them (the workspace covers the rest): their checks would repeat the same
// cudaPointerGetAttributes calls, about 1 us each and 25 a decoding step.
class PointersChecked {
 public:
  PointersChecked();
  ~PointersChecked();
  PointersChecked(const PointersChecked&) = delete;
  PointersChecked& operator=(const PointersChecked&) = delete;
};
infllmv2_status check_device_pointers(const char* op, const Device& dev,
                                      std::initializer_list<std::pair<const char*, const void*>> ptrs);

// Checks that each pointer is 16-byte aligned, as TMA (sm_90a) and 16-byte vector loads need;
// a NULL pointer passes (it is checked, where it matters, by check_device_pointer).
infllmv2_status check_aligned(const char* op, std::initializer_list<std::pair<const char*, const void*>> ptrs);

// The checks every attention-shaped op shares: bf16/fp16, head_dim 64/128, batch and heads_k
// within a grid dimension, heads a multiple of heads_k with a group of at most 64 rows.
infllmv2_status check_group_layout(const char* op, int dtype, int head_dim, int batch, int heads, int heads_k);

// The size checks of the attention ops (sparse and dense): token counts within int32, the
// longest sequences within the token counts, a finite softmax_scale >= 0 (0 = 1/sqrt(head_dim)).
infllmv2_status check_attn_sizes(const char* op, int64_t total_q, int64_t total_k, int32_t max_seqlen_q,
                                 int32_t max_seqlen_k, float softmax_scale);

// PHSA's weight, checked where a punctuation mask is given (NULL: the plain mean, lambda unused):
// in [0, 1], NaN rejected.
infllmv2_status check_phsa_lambda(const char* op, const void* punct, float phsa_lambda);

// The KV-cache layout the *_kvcache ops share (infllmv2.h, infllmv2_sparse_decode_kvcache):
// num_pages pages of page_size rows; a padded cache (no block table, pages_per_seq 0) has a
// page a sequence, a paged one pages_per_seq table entries a sequence, pages a multiple of
// `block` rows when a sequence has several; every row index below 2^31.
infllmv2_status check_cache_layout(const char* op, bool paged, int32_t batch, int64_t num_pages,
                                   int32_t page_size, int32_t pages_per_seq, int block);

// The table a KV-cache kernel takes: a padded cache has none, so the kernel gets cache_seqlens in
// its place, whose entry 0 is the only one it may read (it never uses what it reads).
struct CacheTable {
  int32_t* table;
  int len;
};
inline CacheTable cache_table(const int32_t* block_table, const int32_t* cache_seqlens, int32_t batch,
                              int32_t pages_per_seq) {
  if (block_table != nullptr) return {const_cast<int32_t*>(block_table), batch * pages_per_seq};
  return {const_cast<int32_t*>(cache_seqlens), batch};
}

// The dense dK/dV kernel puts a sequence's key blocks on the grid's z axis (the blocks every
// query sees must start in the first wave): at most kMaxGridYZ blocks of `block` keys.
infllmv2_status check_key_blocks_on_grid(const char* op, int32_t max_seqlen_k, int block);

// Bytes of Delta = rowsum(dO * O), fp32 (heads, total_q), which both attention backwards keep
// at the start of their workspace.
// Workspace regions start at 256-byte boundaries (TMA boxes and vector loads need 16 bytes).
inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

inline size_t attn_delta_bytes(int64_t total_q, int32_t heads) {
  return (size_t)total_q * (size_t)heads * sizeof(float);
}

// softmax_scale (0 = 1/sqrt(head_dim)) times log2(e): the attention kernels use exp2.
float attn_scale_log2(float softmax_scale, int head_dim);

// The arch forced by infllmv2_set_arch_override / INFLLMV2_FORCE_ARCH, or "" for automatic.
std::string arch_override();

// Whether code built for `arch` (e.g. "sm_90a", sm = 90) can be used on a device of compute
// capability cc: an arch-specific ("a") build only on exactly that cc, otherwise any
// cc >= sm (through the embedded PTX when the SASS does not match).
bool arch_runs_on(const char* arch, int sm, int cc);

// The comma-separated archs present in the build.
std::string compiled_archs();

// Runs unit_init once per (unit, device); on failure reports the unit's own message.
infllmv2_status init_unit_once(const char* op, const void* unit_key, int device, int (*init)(),
                               const char* (*last_error)());

// Picks the unit of `table` for `dev`: only units whose config satisfies `match`, of the
// forced arch if any, else of the newest arch that runs on the device, whose dynamic shared
// memory fits. Reports a precise error otherwise: unsupported config, unsupported arch, or no
// variant fitting the shared memory.
template <class Unit, class Match>
infllmv2_status pick_unit(const char* op, const Unit* table, const Device& dev, Match match,
                          const std::string& config_desc, const Unit** out) {
  const std::string forced = arch_override();
  const Unit* best = nullptr;
  bool config_exists = false, arch_ok = false, smem_rejected = false;
  for (const Unit* u = table; u->name != nullptr; ++u) {
    if (!match(*u)) continue;
    config_exists = true;
    bool usable = forced.empty() ? arch_runs_on(u->arch, u->sm, dev.cc) : forced == u->arch;
    if (!usable) continue;
    arch_ok = true;
    if (u->dynamic_smem > dev.smem_optin) {
      smem_rejected = true;
      continue;
    }
    if (best == nullptr || u->sm > best->sm) best = u;
  }
  if (best != nullptr) {
    *out = best;
    return init_unit_once(op, best, dev.index, best->init, best->last_error);
  }
  if (!config_exists)
    return fail(INFLLMV2_ERR_UNSUPPORTED, "%s: no kernel is built for %s", op, config_desc.c_str());
  if (!arch_ok) {
    if (!forced.empty())
      return fail(INFLLMV2_ERR_UNSUPPORTED_ARCH, "%s: arch override %s has no kernel for %s; compiled archs: %s", op,
                  forced.c_str(), config_desc.c_str(), compiled_archs().c_str());
    return fail(INFLLMV2_ERR_UNSUPPORTED_ARCH,
                "%s: the GPU (device %d) is sm_%d, which this build does not support; compiled archs: %s", op,
                dev.index, dev.cc, compiled_archs().c_str());
  }
  (void)smem_rejected;
  return fail(INFLLMV2_ERR_UNSUPPORTED,
              "%s: every variant for %s needs more shared memory per block than device %d (sm_%d) has (%d bytes)",
              op, config_desc.c_str(), dev.index, dev.cc, dev.smem_optin);
}

// A second stream of the calling thread on a device, with two events (see SideBranch).
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t fork = nullptr, join = nullptr;
};

// Work that may run beside the caller's stream: fork() hands out the thread's side stream (one
// per thread and device, so concurrent callers never share an event between a record and its
// wait), made to wait for what the caller's stream has queued so far, or the caller's
// stream itself where no side stream can be had; join() makes the caller's stream wait for the
// side work. The join also runs on destruction, so every way out of an op, an error's included,
// leaves nothing of it outside the caller's stream. In a captured graph the two streams become
// parallel branches.
class SideBranch {
 public:
  explicit SideBranch(cudaStream_t caller) : caller_(caller) {}
  SideBranch(const SideBranch&) = delete;
  SideBranch& operator=(const SideBranch&) = delete;
  ~SideBranch() { join(); }
  // *out: the stream to launch the side work on; an error is a failed fork (nothing forked)
  cudaError_t fork(int device, cudaStream_t* out);
  // at most once a fork; a failed join falls back to synchronising with the side stream
  cudaError_t join();

 private:
  cudaStream_t caller_;
  SideStream side_{};
  bool armed_ = false;
};

// Runs a unit's call() and turns its status into ours.
infllmv2_status launch_result(const char* op, const char* unit_name, int rc, const char* (*last_error)());

}  // namespace infllmv2
