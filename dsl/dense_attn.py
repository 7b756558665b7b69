"""dense_attn: dense GQA attention, the short-input side of InfLLM-V2's dense-sparse switch.

For the query at position p of a sequence and query head h of KV group g = h // G:

    O[p, h]   = sum_t softmax_t(scale * q[p, h] . k[t, g]) v[t, g]
    LSE[h, p] = log sum_t exp(scale * q[p, h] . k[t, g])          (natural log, fp32)

over the keys t of the sequence, with t <= p when causal (bottom-right alignment, p = Lk - Lq
+ i for the i-th of Lq queries); a query with no visible key gets O = 0, LSE = -inf.

Tiling. Unlike sparse_attn, whose tiles pack the G heads of a KV group so that a selected
block is loaded once for all of them, a dense tile is BM consecutive tokens of ONE query head,
as in FlashAttention: every tile of a sequence walks the same keys anyway (they come from L2
for the other heads), and contiguous rows let TMA load the Q, dO, LSE and Delta tiles, so on
sm_90a TileLang's warp-specialised pipeline (a TMA producer warpgroup, two consumer
warpgroups, two stages) runs every loop. Measured on an H100 at 4K x 8, G = 16 (against the
previous tiles of T tokens x G heads, whose rows could only be gathered by the threads):
forward 3.26 -> 2.25 ms, dQ 4.97 -> 2.73 ms, dK/dV 7.36 -> 3.75 ms.

Kernels (one PrimFunc each):
  fwd              O, LSE                                  grid (q tiles, Hq, batch)
  bwd_preprocess   Stats[0, h, p] = LSE[h, p] * log2(e),   grid (ceil(q_pad / 32), Hq)
                   Stats[1, h, p] = dO[p, h] . O[p, h]; rows padded to q_pad (a multiple of 4)
                   so that each head's row is 16-byte aligned for TMA
  bwd_dq           dQ, same tiles as fwd                   grid (q tiles, Hq, batch)
  bwd_dkdv         dK, dV per key block, visiting every    grid (Hk, batch, key blocks)
                   (query tile, head of the group) that can see it, summed over the group
Every gradient is written by exactly one thread block in a fixed order: the backward is
deterministic, with no atomics.
"""

import math

import tilelang.language as T

from dsl import EXP_NVCC_FLAGS
from dsl.sparse_attn import row_dots
from dsl.spans import seq_span

OP = "dense_attn"
NVCC_FLAGS = EXP_NVCC_FLAGS

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
Q_PAD = 4  # Stats rows are padded to a multiple of this many floats (16 bytes, for TMA)
STATS_SLACK = 32  # extra Stats entries a bwd_dkdv step loads (>= Q_PAD - 1; 128 bytes keeps
                  # each stage of the buffer 128-byte aligned)

KERNELS = ("fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv")
VARIANTS = [
    {"kernel": kernel, "dtype": dtype, "head_dim": head_dim}
    for kernel in KERNELS
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
]

# Per kernel and arch: (rows of a query tile, keys of a key tile, pipeline stages, threads).
# For bwd_dkdv the roles swap: a block holds its key tile, the query tiles are the loop.
# sm_90a: TMA + warp specialisation (the threads are the consumers; TileLang adds a producer
# warpgroup), 128 x 128 forward tiles in 2 x 32 KB stages; measured on an H100 at 4K x 8
# (kernel alone): forward 128 x 64 tiles 2.61 ms vs 2.25, dQ 128 x 128 2.64 vs 2.73 ms but
# 5.39 vs 5.06 at 8K x 4, dK/dV with dS^T through shared memory 5.00 vs 3.75 ms.
# Elsewhere (sm_80, also run on sm_86, and sm_89): one stage (TileLang 0.1.15 cannot pipeline
# a run-time trip count deeper there, see ../shared/TILELANG.md) and tiles that fit 99 KB.
TILES = {
    "sm_90a": {"fwd": (128, 128, 2, 256), "bwd_dq": (128, 64, 2, 256), "bwd_dkdv": (64, 128, 2, 256)},
    "other": {"fwd": (128, 64, 1, 256), "bwd_dq": (128, 64, 1, 256), "bwd_dkdv": (64, 64, 1, 128)},
}
PRE_ROWS = 32  # rows of bwd_preprocess's tile


def _tiles(kernel, arch):
    return TILES["sm_90a" if arch.startswith("sm_90") else "other"][kernel]


def unit_constants(kernel, dtype, head_dim, arch):
    """What the host wrapper needs to size the grid: query rows (block_m) and keys (block_n) a tile."""
    if kernel == "bwd_preprocess":
        return {"block_m": PRE_ROWS, "block_n": Q_PAD}
    bm, bn = _tiles(kernel, arch)[:2]
    return {"block_m": bm, "block_n": bn}


def variant_name(kernel, dtype, head_dim):
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{OP}_{kernel}_{short}_d{head_dim}"


def program(kernel, dtype, head_dim, arch):
    if kernel == "bwd_preprocess":
        return _bwd_preprocess(dtype, head_dim)
    return {"fwd": _fwd, "bwd_dq": _bwd_dq, "bwd_dkdv": _bwd_dkdv}[kernel](dtype, head_dim, *_tiles(kernel, arch))


def _dyn():
    return (T.dynamic("total_q"), T.dynamic("total_k"), T.dynamic("heads"), T.dynamic("heads_k"),
            T.dynamic("batch_plus_one"))


def _q_tile(cu_seqlens_q, cu_seqlens_k, total_q, total_k, b, bx, max_tiles, BM, BN, causal):
    """A query tile's place: the longest causal tiles launch first (bx counts from the end).

    Returns q0, k0, len_k, t0 (first token), n_tok (tokens in the sequence), p0 (position of
    the first token), the key tiles to visit, and how many of them every row sees whole."""
    q0, len_q = seq_span(cu_seqlens_q, b, total_q)
    k0, len_k = seq_span(cu_seqlens_k, b, total_k)
    t0 = (max_tiles - 1 - bx) * BM
    n_tok = T.max(T.min(BM, len_q - t0), 0)
    p0 = len_k - len_q + t0
    n_blk = T.if_then_else(causal != 0, T.ceildiv(T.max(T.min(p0 + n_tok, len_k), 0), BN), T.ceildiv(len_k, BN))
    n_full = T.if_then_else(causal != 0, T.max(T.min(p0 + 1, len_k), 0) // BN, len_k // BN)
    return q0, k0, len_k, t0, n_tok, p0, n_blk, n_full


def _visible(key, row, len_k, p0, causal):
    # T.And / T.Or: this runs as Python, where `and` would test an expression's truthiness
    return T.And(key < len_k, T.Or(causal == 0, key <= p0 + row))


def _fwd(dtype, D, BM, BN, stages, threads):
    accum = "float32"
    total_q, total_k, heads, heads_k, batch_plus_one = _dyn()

    @T.prim_func
    def dense_attn_fwd(
        Q: T.Tensor([total_q, heads, D], dtype),
        K: T.Tensor([total_k, heads_k, D], dtype),
        V: T.Tensor([total_k, heads_k, D], dtype),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        O: T.Tensor([total_q, heads, D], dtype),
        LSE: T.Tensor([heads, total_q], accum),
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        causal: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles, heads, batch, threads=threads) as (bx, h, b):
            Q_s = T.alloc_shared([BM, D], dtype)
            K_s = T.alloc_shared([BN, D], dtype)
            V_s = T.alloc_shared([BN, D], dtype)
            acc_s = T.alloc_fragment([BM, BN], accum)
            acc_s_cast = T.alloc_fragment([BM, BN], dtype)
            acc_o = T.alloc_fragment([BM, D], accum)
            m_prev = T.alloc_fragment([BM], accum)
            m_cur = T.alloc_fragment([BM], accum)
            m_safe = T.alloc_fragment([BM], accum)
            r_scale = T.alloc_fragment([BM], accum)
            r_sum = T.alloc_fragment([BM], accum)
            l_sum = T.alloc_fragment([BM], accum)

            hk = h // groups
            q0, k0, len_k, t0, n_tok, p0, n_blk, n_full = _q_tile(
                cu_seqlens_q, cu_seqlens_k, total_q, total_k, b, bx, max_tiles, BM, BN, causal)

            if n_tok > 0:
                # rows past the sequence load the next one's queries (or TMA's zeros past
                # total_q); they are computed and never written
                T.copy(Q[q0 + t0 : q0 + t0 + BM, h, :], Q_s)
                T.fill(acc_o, 0)
                T.fill(l_sum, 0)
                T.fill(m_cur, NEG_INF)
                for blk in T.Pipelined(n_blk, num_stages=stages):
                    T.copy(K[k0 + blk * BN : k0 + (blk + 1) * BN, hk, :], K_s)
                    if blk < n_full:
                        T.clear(acc_s)
                    else:
                        for r, c in T.Parallel(BM, BN):
                            acc_s[r, c] = T.if_then_else(_visible(blk * BN + c, r, len_k, p0, causal), 0, NEG_INF)
                    T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(m_cur, m_prev)
                    T.reduce_max(acc_s, m_cur, dim=1, clear=False)
                    for r in T.Parallel(BM):
                        # rows with nothing visible yet stay at -inf; offset by 0 to avoid inf - inf
                        m_safe[r] = T.if_then_else(m_cur[r] == NEG_INF, 0, m_cur[r])
                        r_scale[r] = T.exp2((m_prev[r] - m_safe[r]) * scale_log2)
                    for r, c in T.Parallel(BM, BN):
                        acc_s[r, c] = T.exp2(acc_s[r, c] * scale_log2 - m_safe[r] * scale_log2)
                    T.reduce_sum(acc_s, r_sum, dim=1)
                    for r in T.Parallel(BM):
                        l_sum[r] = l_sum[r] * r_scale[r] + r_sum[r]
                    T.copy(acc_s, acc_s_cast)
                    for r, d in T.Parallel(BM, D):
                        acc_o[r, d] *= r_scale[r]
                    T.copy(V[k0 + blk * BN : k0 + (blk + 1) * BN, hk, :], V_s)
                    T.gemm(acc_s_cast, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

                for r, d in T.Parallel(BM, D):
                    if r < n_tok:
                        O[q0 + t0 + r, h, d] = T.cast(T.if_then_else(l_sum[r] > 0, acc_o[r, d] / l_sum[r], 0), dtype)
                for r in T.Parallel(BM):
                    if r < n_tok:
                        LSE[h, q0 + t0 + r] = T.if_then_else(
                            l_sum[r] > 0, (m_cur[r] * scale_log2 + T.log2(l_sum[r])) * LN2, NEG_INF)

    return dense_attn_fwd


def _bwd_preprocess(dtype, D):
    accum = "float32"
    total_q, heads, q_pad = T.dynamic("total_q"), T.dynamic("heads"), T.dynamic("q_pad")

    @T.prim_func
    def dense_attn_bwd_preprocess(
        O: T.Tensor([total_q, heads, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        LSE: T.Tensor([heads, total_q], accum),
        Stats: T.Tensor([2, heads, q_pad], accum),
    ):
        with T.Kernel(T.ceildiv(q_pad, PRE_ROWS), heads, threads=128) as (bx, h):
            prod = T.alloc_fragment([PRE_ROWS, D], accum)
            delta = T.alloc_fragment([PRE_ROWS], accum)
            row_dots(O, dO, bx * PRE_ROWS, h, total_q, prod, delta)
            for r in T.Parallel(PRE_ROWS):
                p = bx * PRE_ROWS + r
                if p < q_pad:
                    # padding rows: a finite LSE and zero Delta, never used unmasked
                    Stats[0, h, p] = T.if_then_else(p < total_q, LSE[h, T.min(p, total_q - 1)] * LOG2E, 0)
                    Stats[1, h, p] = delta[r]

    return dense_attn_bwd_preprocess


def _bwd_dq(dtype, D, BM, BN, stages, threads):
    accum = "float32"
    total_q, total_k, heads, heads_k, batch_plus_one = _dyn()
    q_pad = T.dynamic("q_pad")

    @T.prim_func
    def dense_attn_bwd_dq(
        Q: T.Tensor([total_q, heads, D], dtype),
        K: T.Tensor([total_k, heads_k, D], dtype),
        V: T.Tensor([total_k, heads_k, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        Stats: T.Tensor([2, heads, q_pad], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        dQ: T.Tensor([total_q, heads, D], dtype),
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        causal: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles, heads, batch, threads=threads) as (bx, h, b):
            Q_s = T.alloc_shared([BM, D], dtype)
            dO_s = T.alloc_shared([BM, D], dtype)
            K_s = T.alloc_shared([BN, D], dtype)
            V_s = T.alloc_shared([BN, D], dtype)
            acc_s = T.alloc_fragment([BM, BN], accum)
            acc_dp = T.alloc_fragment([BM, BN], accum)
            ds_cast = T.alloc_fragment([BM, BN], dtype)
            acc_dq = T.alloc_fragment([BM, D], accum)
            lse_r = T.alloc_fragment([BM], accum)
            delta_r = T.alloc_fragment([BM], accum)

            hk = h // groups
            q0, k0, len_k, t0, n_tok, p0, n_blk, n_full = _q_tile(
                cu_seqlens_q, cu_seqlens_k, total_q, total_k, b, bx, max_tiles, BM, BN, causal)

            if n_tok > 0:
                T.copy(Q[q0 + t0 : q0 + t0 + BM, h, :], Q_s)
                T.copy(dO[q0 + t0 : q0 + t0 + BM, h, :], dO_s)
                for r in T.Parallel(BM):
                    # a -inf LSE (a row with no visible key) has no probabilities: masked below
                    lse_r[r] = T.if_then_else(r < n_tok, Stats[0, h, q0 + t0 + r], NEG_INF)
                    delta_r[r] = T.if_then_else(r < n_tok, Stats[1, h, q0 + t0 + r], 0)
                T.fill(acc_dq, 0)
                for blk in T.Pipelined(n_blk, num_stages=stages):
                    T.copy(K[k0 + blk * BN : k0 + (blk + 1) * BN, hk, :], K_s)
                    T.copy(V[k0 + blk * BN : k0 + (blk + 1) * BN, hk, :], V_s)
                    T.clear(acc_s)
                    T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.clear(acc_dp)
                    T.gemm(dO_s, V_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if blk < n_full:
                        # every row sees the whole block, so its LSE is finite (rows past the
                        # sequence get garbage here, confined to rows never written)
                        for r, c in T.Parallel(BM, BN):
                            ds_cast[r, c] = T.cast(
                                T.exp2(acc_s[r, c] * scale_log2 - lse_r[r]) * (acc_dp[r, c] - delta_r[r]), dtype)
                    else:
                        for r, c in T.Parallel(BM, BN):
                            ds_cast[r, c] = T.cast(T.if_then_else(
                                T.And(_visible(blk * BN + c, r, len_k, p0, causal), lse_r[r] != NEG_INF),
                                T.exp2(acc_s[r, c] * scale_log2 - lse_r[r]) * (acc_dp[r, c] - delta_r[r]), 0), dtype)
                    T.gemm(ds_cast, K_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                for r, d in T.Parallel(BM, D):
                    if r < n_tok:
                        dQ[q0 + t0 + r, h, d] = T.cast(acc_dq[r, d] * (scale_log2 / LOG2E), dtype)

    return dense_attn_bwd_dq


def _bwd_dkdv(dtype, D, BM, BN, stages, threads):
    accum = "float32"
    total_q, total_k, heads, heads_k, batch_plus_one = _dyn()
    q_pad = T.dynamic("q_pad")

    @T.prim_func
    def dense_attn_bwd_dkdv(
        Q: T.Tensor([total_q, heads, D], dtype),
        K: T.Tensor([total_k, heads_k, D], dtype),
        V: T.Tensor([total_k, heads_k, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        Stats: T.Tensor([2, heads, q_pad], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        dK: T.Tensor([total_k, heads_k, D], dtype),
        dV: T.Tensor([total_k, heads_k, D], dtype),
        batch: T.int32,
        max_kblocks: T.int32,
        groups: T.int32,
        causal: T.int32,
        scale_log2: T.float32,
    ):
        # key blocks outermost: with causal masking the first blocks of every sequence have the
        # most query tiles and must start in the first wave, not at the end of the grid
        with T.Kernel(heads_k, batch, max_kblocks, threads=threads) as (hk, b, kb):
            K_s = T.alloc_shared([BN, D], dtype)
            V_s = T.alloc_shared([BN, D], dtype)
            Q_s = T.alloc_shared([BM, D], dtype)
            dO_s = T.alloc_shared([BM, D], dtype)
            lse_s = T.alloc_shared([BM + STATS_SLACK], accum)
            delta_s = T.alloc_shared([BM + STATS_SLACK], accum)
            acc_sT = T.alloc_fragment([BN, BM], accum)
            acc_dpT = T.alloc_fragment([BN, BM], accum)
            pT_cast = T.alloc_fragment([BN, BM], dtype)
            dsT_cast = T.alloc_fragment([BN, BM], dtype)
            acc_dk = T.alloc_fragment([BN, D], accum)
            acc_dv = T.alloc_fragment([BN, D], accum)

            q0, len_q = seq_span(cu_seqlens_q, b, total_q)
            k0, len_k = seq_span(cu_seqlens_k, b, total_k)
            shift = len_k - len_q
            # causal: queries at positions before this block's first key cannot see it
            tile0 = T.if_then_else(causal != 0, T.max(kb * BN - shift, 0) // BM, 0)
            n_steps = T.max(T.ceildiv(len_q, BM) - tile0, 0) * groups

            if kb * BN < len_k:
                T.copy(K[k0 + kb * BN : k0 + (kb + 1) * BN, hk, :], K_s)
                T.copy(V[k0 + kb * BN : k0 + (kb + 1) * BN, hk, :], V_s)
                T.fill(acc_dk, 0)
                T.fill(acc_dv, 0)
                # step j: query tile tile0 + j // G of head hk * G + j % G, in a fixed order
                for j in T.Pipelined(n_steps, num_stages=stages):
                    h = hk * groups + j % groups
                    t0 = (tile0 + j // groups) * BM
                    T.copy(Q[q0 + t0 : q0 + t0 + BM, h, :], Q_s)
                    T.copy(dO[q0 + t0 : q0 + t0 + BM, h, :], dO_s)
                    # a TMA box must start 16-byte aligned and q0 + t0 is any row: the rows
                    # load from the aligned row below it, and row r sits at r + s_off
                    s_row = (q0 + t0) // Q_PAD * Q_PAD
                    T.copy(Stats[0, h, s_row : s_row + BM + STATS_SLACK], lse_s)
                    T.copy(Stats[1, h, s_row : s_row + BM + STATS_SLACK], delta_s)
                    T.clear(acc_sT)
                    T.gemm(K_s, Q_s, acc_sT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.clear(acc_dpT)
                    T.gemm(V_s, dO_s, acc_dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    n_tok = T.min(BM, len_q - t0)
                    s_off = q0 + t0 - s_row
                    if n_tok == BM and (kb + 1) * BN <= T.if_then_else(causal != 0, T.min(shift + t0 + 1, len_k), len_k):
                        # a full tile whose first token sees the whole key block: no mask, and
                        # every row's LSE is finite
                        for c, r in T.Parallel(BN, BM):
                            acc_sT[c, r] = T.exp2(acc_sT[c, r] * scale_log2 - lse_s[r + s_off])
                    else:
                        for c, r in T.Parallel(BN, BM):
                            acc_sT[c, r] = T.if_then_else(
                                T.And(r < n_tok, _visible(kb * BN + c, r, len_k, shift + t0, causal)),
                                T.exp2(acc_sT[c, r] * scale_log2 - lse_s[r + s_off]), 0)
                    T.copy(acc_sT, pT_cast)
                    T.gemm(pT_cast, dO_s, acc_dv, policy=T.GemmWarpPolicy.FullRow)
                    for c, r in T.Parallel(BN, BM):
                        dsT_cast[c, r] = T.cast(acc_sT[c, r] * (acc_dpT[c, r] - delta_s[r + s_off]), dtype)
                    T.gemm(dsT_cast, Q_s, acc_dk, policy=T.GemmWarpPolicy.FullRow)
                for c, d in T.Parallel(BN, D):
                    if kb * BN + c < len_k:
                        dK[k0 + kb * BN + c, hk, d] = T.cast(acc_dk[c, d] * (scale_log2 / LOG2E), dtype)
                        dV[k0 + kb * BN + c, hk, d] = T.cast(acc_dv[c, d], dtype)

    return dense_attn_bwd_dkdv
