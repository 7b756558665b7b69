// A non-Python consumer of the C ABI: prints the build info, and on a GPU compresses the keys
// of a small varlen batch and checks them against a CPU mean. Exit status 0 means it worked.
//
//   g++ consumer.cpp -I<include dir> -I<cuda>/include -L<lib dir> -linfllmv2 \
//       -L<cuda>/lib64 -lcudart_static -ldl -lrt -lpthread -o consumer
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "infllmv2.h"

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
  return max_err < 1e-2 ? 0 : 1;
}
