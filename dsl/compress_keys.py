"""compress_keys: stage 0 of InfLLM-V2, mean-pooled "semantic kernel" keys.

For every sequence b (keys ``cu_seqlens_k[b] .. cu_seqlens_k[b+1]``, length L) and KV head h:

    C[c0 + j, h, :] = mean(K[k0 + j*stride : k0 + j*stride + window, h, :])   j = 0 .. n-1
    n = (L - window) // stride + 1  if L >= window  else 0

where ``c0 = cu_seqlens_c[b]`` (the caller derives ``cu_seqlens_c`` from the lengths). With the
PHSA block representation (seed phsa-paper.txt), a per-token punctuation mask P selects a
second mean, and

    C[j] = lam * mean(K[window]) + (1 - lam) * mean(K[window][P])   (plain mean if no P in window)

Window and stride are run-time ints, so one kernel serves the fine (32/16) and the coarse
(128/64) keys. Sums are fp32, one thread block per ``BLOCK_C`` compressed rows of one (sequence,
head). The plain kernel first sums runs of ``part`` = gcd(window, stride) keys (the host passes
it) into shared memory, each key read once, then each row adds its window / part runs: every
key was read window / stride times before (H100, 128K keys x 1 / x 8 sequences, both levels:
0.180 -> 0.120 ms and 0.794 -> 0.492 ms). A block whose rows need more than ``MAX_PARTS`` runs
(a small common divisor, e.g. 5/3) sums each row's keys directly. The PHSA kernel sums each row
directly.

Grid: (ceil(max_nc / BLOCK_C), batch, heads_k). Reads and writes are bounds-checked against
``total_k`` / ``total_c`` by TileLang, so inconsistent ``cu_seqlens`` cannot fault.
"""

import tilelang.language as T

OP = "compress_keys"

BLOCK_C = 16
THREADS = 128
# Sums of `part` = gcd(window, stride) consecutive keys a block keeps: (BLOCK_C - 1) * stride /
# part + window / part of them, 17 for 32/16 and for 128/64. Summing those once and each row
# from them reads every key once instead of window / stride times.
MAX_PARTS = 32
UNROLL_T = 4
KEY0, C0, ROWS, PARTS = range(4)  # the block's scalars, held in registers (see select_decode's iv)

# Compile-time configurations this op is built in, for every arch.
VARIANTS = [
    {"dtype": dtype, "head_dim": head_dim, "phsa": phsa}
    for phsa in (0, 1)
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
]


def variant_name(dtype, head_dim, phsa):
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{OP}{'_phsa' if phsa else ''}_{short}_d{head_dim}"


def program(dtype, head_dim, phsa):
    D = head_dim
    accum = "float32"
    total_k = T.dynamic("total_k")
    total_c = T.dynamic("total_c")
    heads_k = T.dynamic("heads_k")
    batch_plus_one = T.dynamic("batch_plus_one")

    if not phsa:

        @T.prim_func
        def compress_keys(
            K: T.Tensor([total_k, heads_k, D], dtype),
            cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
            cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
            C: T.Tensor([total_c, heads_k, D], dtype),
            batch: T.int32,
            max_nc: T.int32,
            window: T.int32,
            stride: T.int32,
            part: T.int32,
        ):
            with T.Kernel(T.ceildiv(max_nc, BLOCK_C), batch, heads_k, threads=THREADS) as (bx, b, h):
                acc = T.alloc_fragment([BLOCK_C, D], accum)
                S_f = T.alloc_fragment([MAX_PARTS, D], accum)
                S_s = T.alloc_shared([MAX_PARTS, D], accum)
                iv = T.alloc_local([4], "int32")
                iv[KEY0] = cu_seqlens_k[b] + bx * BLOCK_C * stride  # the block's first key
                iv[C0] = cu_seqlens_c[b] + bx * BLOCK_C
                iv[ROWS] = T.min(BLOCK_C, cu_seqlens_c[b + 1] - iv[C0])
                iv[PARTS] = (iv[ROWS] - 1) * (stride // part) + window // part
                T.clear(acc)
                if iv[ROWS] > 0 and iv[PARTS] <= MAX_PARTS:
                    # each key read once: sums of `part` keys, then a row sums window / part of them
                    T.clear(S_f)
                    for t in T.serial(T.ceildiv(part, UNROLL_T)):
                        # UNROLL_T keys of each part a step: independent loads in flight
                        for u in T.unroll(UNROLL_T):
                            for p, d in T.Parallel(MAX_PARTS, D):
                                if p < iv[PARTS] and t * UNROLL_T + u < part:
                                    S_f[p, d] += T.cast(K[iv[KEY0] + p * part + t * UNROLL_T + u, h, d], accum)
                    T.copy(S_f, S_s)
                    T.sync_threads()
                    for q in T.serial(window // part):
                        for i, d in T.Parallel(BLOCK_C, D):
                            if i < iv[ROWS]:
                                acc[i, d] += S_s[i * (stride // part) + q, d]
                elif iv[ROWS] > 0:
                    # windows and strides with a small common divisor: each row sums its own keys
                    for t in T.serial(window):
                        for i, d in T.Parallel(BLOCK_C, D):
                            if i < iv[ROWS]:
                                acc[i, d] += T.cast(K[iv[KEY0] + i * stride + t, h, d], accum)
                for i, d in T.Parallel(BLOCK_C, D):
                    if i < iv[ROWS]:
                        C[iv[C0] + i, h, d] = T.cast(acc[i, d] / T.cast(window, accum), dtype)

        return compress_keys

    @T.prim_func
    def compress_keys_phsa(
        K: T.Tensor([total_k, heads_k, D], dtype),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
        punct_mask: T.Tensor([total_k], "uint8"),
        C: T.Tensor([total_c, heads_k, D], dtype),
        batch: T.int32,
        max_nc: T.int32,
        window: T.int32,
        stride: T.int32,
        phsa_lambda: T.float32,
    ):
        with T.Kernel(T.ceildiv(max_nc, BLOCK_C), batch, heads_k, threads=THREADS) as (bx, b, h):
            acc = T.alloc_fragment([BLOCK_C, D], accum)
            acc_punct = T.alloc_fragment([BLOCK_C, D], accum)
            # The punctuation count is kept per element, in the same [BLOCK_C, D] layout as
            # the sums, so that all three fragments share one thread mapping.
            n_punct = T.alloc_fragment([BLOCK_C, D], accum)
            k0 = cu_seqlens_k[b]
            c0 = cu_seqlens_c[b]
            n = cu_seqlens_c[b + 1] - c0
            T.clear(acc)
            T.clear(acc_punct)
            T.clear(n_punct)
            for t in T.serial(window):
                for i, d in T.Parallel(BLOCK_C, D):
                    if bx * BLOCK_C + i < n:
                        pos = k0 + (bx * BLOCK_C + i) * stride + t
                        x = T.cast(K[pos, h, d], accum)
                        is_punct = punct_mask[pos] != T.uint8(0)
                        acc[i, d] += x
                        acc_punct[i, d] += T.if_then_else(is_punct, x, T.float32(0))
                        n_punct[i, d] += T.if_then_else(is_punct, T.float32(1), T.float32(0))
            for i, d in T.Parallel(BLOCK_C, D):
                if bx * BLOCK_C + i < n:
                    mean_all = acc[i, d] / T.cast(window, accum)
                    C[c0 + bx * BLOCK_C + i, h, d] = T.cast(
                        T.if_then_else(
                            n_punct[i, d] > T.float32(0),
                            phsa_lambda * mean_all
                            + (T.float32(1) - phsa_lambda) * acc_punct[i, d] / T.max(n_punct[i, d], T.float32(1)),
                            mean_all,
                        ),
                        dtype,
                    )

    return compress_keys_phsa
