"""attention: the kernels the one-call C entry point (infllmv2_attention_fwd) needs beyond the
ops' own, so that a C caller gets compression, selection and sparse attention with no host
synchronisation. The offsets kernel is also an entry point of its own
(infllmv2_attention_compressed_offsets), which infllmv2.select_blocks uses.

  compressed_offsets   cu_seqlens_c[b] = sum over sequences i < b of n(L_i), where
                       n(L) = floor((L - w) / s) + 1 if L >= w else 0 (SPEC.md, stage 0): the
                       offsets of the compressed keys, computed on the device from cu_seqlens_k
                       (one thread; the batch is at most 65535 sequences).
  cache_offsets        the offsets select_decode's kernels take, for a selection over compressed
                       caches (infllmv2_select_decode_kvcache): cu_seqlens_k[b] = sum over i < b
                       of min(max(cache_seqlens[i], 0), capacity) (only its differences, the key
                       lengths, are read), cu_seqlens_c[b] = b * cap_c and cu_seqlens_n[b] = b *
                       cap_n (sequence b's compressed keys are rows b * cap .. of its padded
                       compressed cache; the visibility rule keeps every read below n(L)).
"""

import tilelang.language as T

OP = "attention"

KERNELS = ("compressed_offsets", "cache_offsets")
VARIANTS = [{"kernel": kernel} for kernel in KERNELS]


def variant_name(kernel):
    return f"{OP}_{kernel}"


def program(kernel, arch):
    return {"compressed_offsets": _compressed_offsets, "cache_offsets": _cache_offsets}[kernel]()


def _compressed_offsets():
    batch_plus_one = T.dynamic("batch_plus_one")

    @T.prim_func
    def attention_compressed_offsets(
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
        batch: T.int32,
        kernel_size: T.int32,
        kernel_stride: T.int32,
    ):
        with T.Kernel(1, threads=32) as _:
            tx = T.get_thread_binding()
            acc = T.alloc_var("int32")
            if tx == 0:
                acc = 0
                cu_seqlens_c[0] = 0
                for b in T.serial(batch):
                    acc += T.if_then_else(
                        cu_seqlens_k[b + 1] - cu_seqlens_k[b] >= kernel_size,
                        (cu_seqlens_k[b + 1] - cu_seqlens_k[b] - kernel_size) // kernel_stride + 1,
                        0,
                    )
                    cu_seqlens_c[b + 1] = acc

    return attention_compressed_offsets


def _cache_offsets():
    batch = T.dynamic("batch")
    batch_plus_one = T.dynamic("batch_plus_one")

    @T.prim_func
    def attention_cache_offsets(
        cache_seqlens: T.Tensor([batch], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_n: T.Tensor([batch_plus_one], "int32"),
        capacity: T.int32,
        cap_c: T.int32,
        cap_n: T.int32,
    ):
        with T.Kernel(1, threads=32) as _:
            tx = T.get_thread_binding()
            acc = T.alloc_var("int32")
            if tx == 0:
                acc = 0
                cu_seqlens_k[0] = 0
                cu_seqlens_c[0] = 0
                cu_seqlens_n[0] = 0
                for b in T.serial(batch):
                    acc += T.max(T.min(cache_seqlens[b], capacity), 0)
                    cu_seqlens_k[b + 1] = acc
                    cu_seqlens_c[b + 1] = (b + 1) * cap_c
                    cu_seqlens_n[b + 1] = (b + 1) * cap_n

    return attention_cache_offsets
