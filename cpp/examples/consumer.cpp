// A non-Python consumer of the C ABI: prints the build info, and on a GPU compresses the keys
// of a small varlen batch and checks them against a CPU mean, then runs the whole attention
// forward and backward (infllmv2_attention_fwd, infllmv2_attention_bwd) on its sparse path with
// a selection wide enough to hold every block and checks it equals the dense path. Exit status 0
// means it worked.
//
//   g++ consumer.cpp -I<include dir> -I<cuda>/include -L<lib dir> -linfllmv2 \
//       -L<cuda>/lib64 -lcudart_static -ldl -lrt -lpthread -o consumer
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "infllmv2.h"

// Sequences of 300 and 130 tokens, 32 query heads on 2 KV heads: at most 5 blocks of 64 per
// query, so a selection of K = 2 window blocks + 3 scored blocks holds every causal block and
// the sparse path must give the dense path's result, forward (infllmv2_attention_fwd) and
// backward (infllmv2_attention_bwd).
static double max_rel_diff(const void* da, const void* db, size_t n) {
  std::vector<__nv_bfloat16> a(n), b(n);
  cudaMemcpy(a.data(), da, n * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), db, n * 2, cudaMemcpyDeviceToHost);
  double diff = 0, scale = 0;
  for (size_t i = 0; i < n; ++i) {
    diff = std::fmax(diff, std::fabs(__bfloat162float(a[i]) - __bfloat162float(b[i])));
    scale = std::fmax(scale, std::fabs(__bfloat162float(a[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

static bool attention_sparse_equals_dense() {
  const int lens[2] = {300, 130}, hq = 32, hk = 2, dim = 128, total = lens[0] + lens[1];
  std::vector<int32_t> cu = {0, lens[0], total};
  std::vector<__nv_bfloat16> q(size_t(total) * hq * dim), kv(size_t(total) * hk * dim), dy(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = __float2bfloat16(std::sin(0.11f * float(i)));
  for (size_t i = 0; i < kv.size(); ++i) kv[i] = __float2bfloat16(std::cos(0.23f * float(i)));
  for (size_t i = 0; i < dy.size(); ++i) dy[i] = __float2bfloat16(std::sin(0.07f * float(i) + 1.f));
  void *dq, *dkv, *ddy, *dcu, *dlse, *didx, *out[2], *grad_q[2], *grad_k[2], *grad_v[2];
  const size_t qb = q.size() * 2, kvb = kv.size() * 2;
  cudaMalloc(&dq, qb);
  cudaMalloc(&dkv, kvb);
  cudaMalloc(&ddy, qb);
  cudaMalloc(&dcu, 12);
  cudaMalloc(&dlse, size_t(hq) * total * 4);
  cudaMemcpy(dq, q.data(), qb, cudaMemcpyHostToDevice);
  cudaMemcpy(dkv, kv.data(), kvb, cudaMemcpyHostToDevice);
  cudaMemcpy(ddy, dy.data(), qb, cudaMemcpyHostToDevice);
  cudaMemcpy(dcu, cu.data(), 12, cudaMemcpyHostToDevice);
  infllmv2_sparse_config cfg;
  infllmv2_sparse_config_default(&cfg);
  cfg.window_size = 128;
  cfg.topk = 3;
  const int K = cfg.topk + cfg.window_size / cfg.block_size;
  cudaMalloc(&didx, size_t(hk) * total * K * 4);
  const int32_t* cu_d = (const int32_t*)dcu;
  for (int path = 0; path < 2; ++path) {
    const char* name = path ? "sparse" : "dense";
    cfg.dense_len = path == 0 ? 1 << 30 : 0;  // 0: dense, 1: sparse
    cudaMalloc(&out[path], qb);
    cudaMalloc(&grad_q[path], qb);
    cudaMalloc(&grad_k[path], kvb);
    cudaMalloc(&grad_v[path], kvb);
    size_t bytes = infllmv2_attention_fwd_workspace_size(2, total, total, lens[0], hk, dim, &cfg);
    void* ws = nullptr;
    if (bytes) cudaMalloc(&ws, bytes);
    infllmv2_status st = infllmv2_attention_fwd(dq, dkv, dkv, cu_d, cu_d, nullptr, 0.f, out[path], (float*)dlse,
                                                (int32_t*)didx, ws, bytes, 2, total, total, lens[0], lens[0], hq, hk, dim,
                                                INFLLMV2_DTYPE_BF16, 0.f, &cfg, nullptr);
    if (st != INFLLMV2_OK) {
      std::printf("infllmv2_attention_fwd (%s path) failed (%d): %s\n", name, (int)st, infllmv2_last_error());
      return false;
    }
    std::printf("attention_fwd %s path: workspace %zu bytes\n", name, bytes);
    cudaFree(ws);
    ws = nullptr;
    // the backward of the same call: same config and max_seqlen_k, so the same side of the switch
    bytes = infllmv2_attention_bwd_workspace_size(2, total, total, lens[0], hq, hk, &cfg);
    if (bytes) cudaMalloc(&ws, bytes);
    st = infllmv2_attention_bwd(dq, dkv, dkv, out[path], ddy, (const float*)dlse, (const int32_t*)didx, cu_d, cu_d,
                                grad_q[path], grad_k[path], grad_v[path], ws, bytes, 2, total, total, lens[0], lens[0],
                                hq, hk, dim, INFLLMV2_DTYPE_BF16, 0.f, &cfg, nullptr);
    if (st != INFLLMV2_OK) {
      std::printf("infllmv2_attention_bwd (%s path) failed (%d): %s\n", name, (int)st, infllmv2_last_error());
      return false;
    }
    std::printf("attention_bwd %s path: workspace %zu bytes\n", name, bytes);
    cudaFree(ws);
  }
  // relative to the largest magnitude: bf16 outputs of two kernels that sum in different orders
  const double d_out = max_rel_diff(out[0], out[1], q.size()), d_q = max_rel_diff(grad_q[0], grad_q[1], q.size()),
               d_k = max_rel_diff(grad_k[0], grad_k[1], kv.size()), d_v = max_rel_diff(grad_v[0], grad_v[1], kv.size());
  const bool ok = d_out < 2e-2 && d_q < 2e-2 && d_k < 2e-2 && d_v < 2e-2;
  std::printf("attention sparse (every block selected) vs dense, max relative |diff|: out %.3g, dq %.3g, dk %.3g, "
              "dv %.3g -> %s\n",
              d_out, d_q, d_k, d_v, ok ? "OK" : "FAIL");
  return ok;
}

int main() {
  if (infllmv2_abi_version() != INFLLMV2_ABI_VERSION) {
    std::printf("ABI mismatch: library %d, header %d\n", infllmv2_abi_version(), INFLLMV2_ABI_VERSION);
    return 1;
  }
  std::printf("infllmv2 %s: %s\n", infllmv2_version(), infllmv2_build_info());

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: build info only\n");
    return 0;
  }
  const char* arch = infllmv2_selected_arch();
  std::printf("kernels for this GPU: %s\n", arch ? arch : infllmv2_last_error());

  // Two sequences of 100 and 40 keys, 2 KV heads, head dim 128: 5 + 1 windows of 32 / 16.
  const int lens[2] = {100, 40}, heads = 2, dim = 128, w = 32, s = 16;
  const int total_k = lens[0] + lens[1];
  std::vector<int32_t> cu_k = {0, lens[0], total_k}, cu_c = {0, 5, 6};
  const int total_c = 6, max_nc = 5;
  std::vector<__nv_bfloat16> k(size_t(total_k) * heads * dim);
  for (size_t i = 0; i < k.size(); ++i) k[i] = __float2bfloat16(std::sin(0.37f * float(i)));

  void *dk, *dck, *dcu_k, *dcu_c;
  cudaMalloc(&dk, k.size() * 2);
  cudaMalloc(&dck, size_t(total_c) * heads * dim * 2);
  cudaMalloc(&dcu_k, 12);
  cudaMalloc(&dcu_c, 12);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dcu_k, cu_k.data(), 12, cudaMemcpyHostToDevice);
  cudaMemcpy(dcu_c, cu_c.data(), 12, cudaMemcpyHostToDevice);

  infllmv2_status st = infllmv2_compress_keys(dk, (const int32_t*)dcu_k, (const int32_t*)dcu_c, nullptr, 0.f, dck, 2,
                                              total_k, total_c, max_nc, heads, dim, INFLLMV2_DTYPE_BF16, w, s, nullptr);
  if (st != INFLLMV2_OK) {
    std::printf("infllmv2_compress_keys failed (%d): %s\n", (int)st, infllmv2_last_error());
    return 1;
  }
  // A bad call reports the argument by name instead of crashing.
  st = infllmv2_compress_keys(dk, (const int32_t*)dcu_k, (const int32_t*)dcu_c, nullptr, 0.f, dck, 2, total_k, total_c,
                              max_nc, heads, 96, INFLLMV2_DTYPE_BF16, w, s, nullptr);
  std::printf("head_dim=96 -> status %d: %s\n", (int)st, infllmv2_last_error());

  std::vector<__nv_bfloat16> ck(size_t(total_c) * heads * dim);
  cudaMemcpy(ck.data(), dck, ck.size() * 2, cudaMemcpyDeviceToHost);
  double max_err = 0;
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < cu_c[b + 1] - cu_c[b]; ++j)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < dim; ++d) {
          double sum = 0;
          for (int t = 0; t < w; ++t) sum += __bfloat162float(k[(size_t(cu_k[b] + j * s + t) * heads + h) * dim + d]);
          double got = __bfloat162float(ck[(size_t(cu_c[b] + j) * heads + h) * dim + d]);
          max_err = std::fmax(max_err, std::fabs(got - sum / w));
        }
  std::printf("compress_keys max |err| vs CPU mean: %.3g -> %s\n", max_err, max_err < 1e-2 ? "OK" : "FAIL");
  if (max_err >= 1e-2) return 1;
  return attention_sparse_equals_dense() ? 0 : 1;
}
