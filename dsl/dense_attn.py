"""dense_attn: dense GQA attention, the short-input side of InfLLM-V2's dense-sparse switch.

For the query at position p of a sequence and query head h of KV group g = h // G:

    O[p, h]   = sum_t softmax_t(scale * q[p, h] . k[t, g]) v[t, g]
    LSE[h, p] = log sum_t exp(scale * q[p, h] . k[t, g])          (natural log, fp32)

over the keys t of the sequence, with t <= p when causal (bottom-right alignment, p = Lk - Lq
+ i for the i-th of Lq queries); a query with no visible key gets O = 0, LSE = -inf.

Tiling as in sparse_attn: a query tile is T = BLOCK_M // G consecutive tokens x the G heads of
one KV group (row r = token r // G, head r % G), so each K/V block is loaded once for all G
heads and small groups need no padding. Each row's last visible key (``rowlim``) is computed
once per tile, so the per-element causal mask is one comparison with no division.

Kernels (one PrimFunc each; the backward's Delta comes from sparse_attn_bwd_preprocess):
  fwd        O, LSE                                  grid (tiles, batch, Hk)
  bwd_dq     dQ, same tiles as fwd                    grid (tiles, batch, Hk)
  bwd_dkdv   dK, dV per 64-key block, visiting every  grid (Hk, batch, key blocks)
             query tile that can see it; on sm_90a the tiles have 128 rows and the next
             tile's rows load by cp.async while the current one is computed
Every gradient is written by exactly one thread block in a fixed order: the backward is
deterministic, with no atomics.
"""

import math

import tilelang.language as T

OP = "dense_attn"

BLOCK_N = 64  # keys per K/V tile
BLOCK_M = 64  # GEMM rows per query tile: T tokens x G heads
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")

KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
VARIANTS = [
    {"kernel": kernel, "dtype": dtype, "head_dim": head_dim}
    for kernel in KERNELS
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
]


def pass_configs(kernel, dtype, head_dim, arch):
    # Warp specialisation (TileLang's default on sm_90a) gives the forward and dQ kernels a TMA
    # producer warpgroup and 240 registers per consumer thread, so one block fills an SM and
    # the softmax never overlaps another block's GEMMs. Without it (as sparse_attn) two or
    # three blocks share an SM: measured on an H100 at 4K x 8, G = 16, the forward went from
    # 5.36 to 3.50 ms and dQ from 7.45 to 6.01 ms. bwd_dkdv loads by hand and is not affected.
    from tilelang import PassConfigKey

    return {PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True} if kernel in ("fwd", "bwd_dq") else {}


def unit_constants(kernel, dtype, head_dim, arch):
    """What the host wrapper needs to size the grid: T = block_m // G tokens a tile."""
    return {"block_m": _dkdv_block_m(arch) if kernel == "bwd_dkdv" else BLOCK_M}


def _dkdv_block_m(arch):
    # sm_90a's 227 KB hold two 128-row query tiles (the prefetch buffer); 99 KB (sm_86/sm_89)
    # hold one 64-row tile.
    return 128 if _prefetch(arch) else BLOCK_M


def variant_name(kernel, dtype, head_dim):
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{OP}_{kernel}_{short}_d{head_dim}"


# Without warp specialisation TileLang 0.1.15 aborts codegen when it pipelines a run-time trip
# count with more than one stage (see ../shared/TILELANG.md), on every arch; one stage still
# issues the next K/V loads before the current block's GEMMs.
STAGES = 1


def program(kernel, dtype, head_dim, arch):
    return {"fwd": _fwd, "bwd_dq": _bwd_dq, "bwd_dkdv": _bwd_dkdv}[kernel](dtype, head_dim, arch)


def _dyn():
    return (T.dynamic("total_q"), T.dynamic("total_k"), T.dynamic("heads"), T.dynamic("heads_k"),
            T.dynamic("batch_plus_one"))


@T.macro
def _row_limits(rowlim, n_rows, groups, p0, len_k, causal):
    """rowlim[r]: the last key row r may see (-1: none; rows past the tile's tokens see none).

    rowlim lives in shared memory, written before the key loop by all threads. (It had to: as a
    fragment under warp specialisation, which these kernels no longer use, TileLang 0.1.15 did
    not compile it. A fragment has not been measured since.)"""
    for r in T.Parallel(BLOCK_M):
        rowlim[r] = T.if_then_else(
            r < n_rows, T.if_then_else(causal != 0, T.min(p0 + r // groups, len_k - 1), len_k - 1), -1
        )


def _unmasked(blk, p0, len_k, causal):
    """Whether key block blk is wholly visible to every row of a tile whose first token sits at
    p0: such blocks (all but the last few of a causal row) skip the per-element mask."""
    return (blk + 1) * BLOCK_N <= T.if_then_else(causal != 0, T.min(p0 + 1, len_k), len_k)


def _n_key_blocks(p_last, len_k, causal):
    """K/V blocks a tile whose last token sits at p_last must visit."""
    return T.if_then_else(
        causal != 0, T.ceildiv(T.max(T.min(p_last + 1, len_k), 0), BLOCK_N), T.ceildiv(len_k, BLOCK_N)
    )


def _fwd(dtype, D, arch):
    accum = "float32"
    total_q, total_k, heads, heads_k, batch_plus_one = _dyn()
    threads = 128

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
        tile_tokens: T.int32,
        causal: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles, batch, heads_k, threads=threads) as (bx, b, hk):
            Q_s = T.alloc_shared([BLOCK_M, D], dtype)
            K_s = T.alloc_shared([BLOCK_N, D], dtype)
            V_s = T.alloc_shared([BLOCK_N, D], dtype)
            acc_s = T.alloc_fragment([BLOCK_M, BLOCK_N], accum)
            acc_s_cast = T.alloc_fragment([BLOCK_M, BLOCK_N], dtype)
            acc_o = T.alloc_fragment([BLOCK_M, D], accum)
            rowlim = T.alloc_shared([BLOCK_M], "int32")
            m_prev = T.alloc_fragment([BLOCK_M], accum)
            m_cur = T.alloc_fragment([BLOCK_M], accum)
            m_safe = T.alloc_fragment([BLOCK_M], accum)
            r_scale = T.alloc_fragment([BLOCK_M], accum)
            r_sum = T.alloc_fragment([BLOCK_M], accum)
            l_sum = T.alloc_fragment([BLOCK_M], accum)

            q0 = cu_seqlens_q[b]
            k0 = cu_seqlens_k[b]
            len_q = cu_seqlens_q[b + 1] - q0
            len_k = cu_seqlens_k[b + 1] - k0
            t0 = bx * tile_tokens
            n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
            n_rows = n_tok * groups
            p0 = len_k - len_q + t0  # position of the tile's first token

            if n_tok > 0:
                for r, d in T.Parallel(BLOCK_M, D):
                    Q_s[r, d] = T.if_then_else(
                        r < n_rows, Q[q0 + t0 + r // groups, hk * groups + r % groups, d], T.cast(0, dtype)
                    )
                _row_limits(rowlim, n_rows, groups, p0, len_k, causal)
                T.fill(acc_o, 0)
                T.fill(l_sum, 0)
                T.fill(m_cur, NEG_INF)
                for blk in T.Pipelined(_n_key_blocks(p0 + n_tok - 1, len_k, causal), num_stages=STAGES):
                    T.copy(K[k0 + blk * BLOCK_N : k0 + (blk + 1) * BLOCK_N, hk, :], K_s)
                    T.copy(V[k0 + blk * BLOCK_N : k0 + (blk + 1) * BLOCK_N, hk, :], V_s)
                    if _unmasked(blk, p0, len_k, causal):
                        T.clear(acc_s)
                    else:
                        for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                            acc_s[r, c] = T.if_then_else(blk * BLOCK_N + c <= rowlim[r], 0, NEG_INF)
                    T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(m_cur, m_prev)
                    T.reduce_max(acc_s, m_cur, dim=1, clear=False)
                    for r in T.Parallel(BLOCK_M):
                        # rows with nothing visible yet stay at -inf; offset by 0 to avoid inf - inf
                        m_safe[r] = T.if_then_else(m_cur[r] == NEG_INF, 0, m_cur[r])
                        r_scale[r] = T.exp2((m_prev[r] - m_safe[r]) * scale_log2)
                    for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                        acc_s[r, c] = T.exp2((acc_s[r, c] - m_safe[r]) * scale_log2)
                    T.reduce_sum(acc_s, r_sum, dim=1)
                    for r in T.Parallel(BLOCK_M):
                        l_sum[r] = l_sum[r] * r_scale[r] + r_sum[r]
                    T.copy(acc_s, acc_s_cast)
                    for r, d in T.Parallel(BLOCK_M, D):
                        acc_o[r, d] *= r_scale[r]
                    T.gemm(acc_s_cast, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)

                for r, d in T.Parallel(BLOCK_M, D):
                    if r < n_rows:
                        O[q0 + t0 + r // groups, hk * groups + r % groups, d] = T.cast(
                            T.if_then_else(l_sum[r] > 0, acc_o[r, d] / l_sum[r], 0), dtype
                        )
                for r in T.Parallel(BLOCK_M):
                    if r < n_rows:
                        LSE[hk * groups + r % groups, q0 + t0 + r // groups] = T.if_then_else(
                            l_sum[r] > 0, (m_cur[r] * scale_log2 + T.log2(l_sum[r])) * LN2, NEG_INF
                        )

    return dense_attn_fwd


def _bwd_dq(dtype, D, arch):
    accum = "float32"
    total_q, total_k, heads, heads_k, batch_plus_one = _dyn()
    threads = 128

    @T.prim_func
    def dense_attn_bwd_dq(
        Q: T.Tensor([total_q, heads, D], dtype),
        K: T.Tensor([total_k, heads_k, D], dtype),
        V: T.Tensor([total_k, heads_k, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        LSE: T.Tensor([heads, total_q], accum),
        Delta: T.Tensor([heads, total_q], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        dQ: T.Tensor([total_q, heads, D], dtype),
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        causal: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles, batch, heads_k, threads=threads) as (bx, b, hk):
            Q_s = T.alloc_shared([BLOCK_M, D], dtype)
            dO_s = T.alloc_shared([BLOCK_M, D], dtype)
            K_s = T.alloc_shared([BLOCK_N, D], dtype)
            V_s = T.alloc_shared([BLOCK_N, D], dtype)
            dS_s = T.alloc_shared([BLOCK_M, BLOCK_N], dtype)
            acc_s = T.alloc_fragment([BLOCK_M, BLOCK_N], accum)
            acc_dp = T.alloc_fragment([BLOCK_M, BLOCK_N], accum)
            acc_dq = T.alloc_fragment([BLOCK_M, D], accum)
            rowlim = T.alloc_shared([BLOCK_M], "int32")
            lse_r = T.alloc_fragment([BLOCK_M], accum)
            delta_r = T.alloc_fragment([BLOCK_M], accum)

            q0 = cu_seqlens_q[b]
            k0 = cu_seqlens_k[b]
            len_q = cu_seqlens_q[b + 1] - q0
            len_k = cu_seqlens_k[b + 1] - k0
            t0 = bx * tile_tokens
            n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
            n_rows = n_tok * groups
            p0 = len_k - len_q + t0

            if n_tok > 0:
                for r, d in T.Parallel(BLOCK_M, D):
                    Q_s[r, d] = T.if_then_else(
                        r < n_rows, Q[q0 + t0 + r // groups, hk * groups + r % groups, d], T.cast(0, dtype)
                    )
                    dO_s[r, d] = T.if_then_else(
                        r < n_rows, dO[q0 + t0 + r // groups, hk * groups + r % groups, d], T.cast(0, dtype)
                    )
                for r in T.Parallel(BLOCK_M):
                    # a -inf LSE (a row with no visible key) has no probabilities: masked below
                    lse_r[r] = T.if_then_else(
                        r < n_rows, LSE[hk * groups + r % groups, q0 + t0 + r // groups] * LOG2E, NEG_INF
                    )
                    delta_r[r] = T.if_then_else(r < n_rows, Delta[hk * groups + r % groups, q0 + t0 + r // groups], 0)
                _row_limits(rowlim, n_rows, groups, p0, len_k, causal)
                T.fill(acc_dq, 0)
                for blk in T.Pipelined(_n_key_blocks(p0 + n_tok - 1, len_k, causal), num_stages=STAGES):
                    T.copy(K[k0 + blk * BLOCK_N : k0 + (blk + 1) * BLOCK_N, hk, :], K_s)
                    T.copy(V[k0 + blk * BLOCK_N : k0 + (blk + 1) * BLOCK_N, hk, :], V_s)
                    T.clear(acc_s)
                    T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if _unmasked(blk, p0, len_k, causal):
                        # every row of the tile sees this block, so its LSE is finite (rows past
                        # the tile's tokens get garbage here, confined to rows never written)
                        for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                            acc_s[r, c] = T.exp2(acc_s[r, c] * scale_log2 - lse_r[r])
                    else:
                        for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                            acc_s[r, c] = T.if_then_else(
                                blk * BLOCK_N + c <= rowlim[r] and lse_r[r] != NEG_INF,
                                T.exp2(acc_s[r, c] * scale_log2 - lse_r[r]),
                                0,
                            )
                    T.clear(acc_dp)
                    T.gemm(dO_s, V_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                        dS_s[r, c] = T.cast(acc_s[r, c] * (acc_dp[r, c] - delta_r[r]), dtype)
                    T.gemm(dS_s, K_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                for r, d in T.Parallel(BLOCK_M, D):
                    if r < n_rows:
                        dQ[q0 + t0 + r // groups, hk * groups + r % groups, d] = T.cast(
                            acc_dq[r, d] * (scale_log2 / LOG2E), dtype
                        )

    return dense_attn_bwd_dq


def _prefetch(arch):
    # bwd_dkdv loads the next query tile by cp.async into a second buffer while the current
    # one is computed (as sparse_attn_bwd_dkdv); sm_80 (also run on sm_86) and sm_89 parts
    # have 99 KB of shared memory per block, too little for the second buffers.
    return arch.startswith("sm_90")


VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)


def _bwd_dkdv(dtype, D, arch):
    accum = "float32"
    total_q, total_k, heads, heads_k, batch_plus_one = _dyn()
    # Two warpgroups on 128-row query tiles on sm_90a: with four, each GEMM's N is split four
    # ways (n16/n32 wgmma), which reads the A operand from shared memory for every 16 columns
    # and leaves the tensor cores waiting on shared memory. Measured on an H100 at 4K x 8,
    # G = 16 (with the prefetch and the unmasked path): 512 threads on 64-row tiles 10.1 ms,
    # 256 threads 8.7 ms, 256 threads on 128-row tiles 7.4 ms.
    threads = 256
    prefetch = _prefetch(arch)
    BM = _dkdv_block_m(arch)
    NV = BM * D // VEC

    @T.macro
    def load_tile(Q, dO, LSE, Delta, q0, t0, n_rows, rtok_s, rhead_s, tx, Qb, dOb, lseb, deltab):
        # cp.async, zero-filled past the sequence, and no wait (the caller commits and waits)
        for i in T.serial(T.ceildiv(NV, threads)):
            v = i * threads + tx
            if v < NV:
                r = v // (D // VEC)
                d = (v % (D // VEC)) * VEC
                row = q0 + t0 + T.if_then_else(r < n_rows, rtok_s[r], 0)
                T.ptx_cp_async(T.access_ptr(Qb[r, d], "w", VEC), T.access_ptr(Q[row, rhead_s[r], d], "r", VEC), VEC,
                               predicate=r < n_rows)
                T.ptx_cp_async(T.access_ptr(dOb[r, d], "w", VEC), T.access_ptr(dO[row, rhead_s[r], d], "r", VEC), VEC,
                               predicate=r < n_rows)
        if tx < BM:
            row = q0 + t0 + T.if_then_else(tx < n_rows, rtok_s[tx], 0)
            T.ptx_cp_async(T.access_ptr(lseb[tx], "w", 1), T.access_ptr(LSE[rhead_s[tx], row], "r", 1), 1,
                           predicate=tx < n_rows)
            T.ptx_cp_async(T.access_ptr(deltab[tx], "w", 1), T.access_ptr(Delta[rhead_s[tx], row], "r", 1), 1,
                           predicate=tx < n_rows)

    @T.macro
    def compute(t0, n_rows, kb, shift, len_k, causal, scale_log2, rtok_s, K_s, V_s, pT_s, dsT_s,
                acc_sT, acc_dpT, acc_dk, acc_dv, Q_s, dO_s, lse_s, delta_s):
        T.clear(acc_sT)
        T.gemm(K_s, Q_s, acc_sT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        if n_rows == BM and _unmasked(kb, shift + t0, len_k, causal):
            # a full tile whose first token sees the whole key block: no mask, and every row's
            # LSE is finite
            for c, r in T.Parallel(BLOCK_N, BM):
                acc_sT[c, r] = T.exp2(acc_sT[c, r] * scale_log2 - lse_s[r] * LOG2E)
        else:
            for c, r in T.Parallel(BLOCK_N, BM):
                acc_sT[c, r] = T.if_then_else(
                    r < n_rows
                    and lse_s[r] != NEG_INF
                    and kb * BLOCK_N + c < len_k
                    and (causal == 0 or kb * BLOCK_N + c <= shift + t0 + rtok_s[r]),
                    T.exp2(acc_sT[c, r] * scale_log2 - lse_s[r] * LOG2E),
                    0,
                )
        T.clear(acc_dpT)
        T.gemm(V_s, dO_s, acc_dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.copy(acc_sT, pT_s)
        for c, r in T.Parallel(BLOCK_N, BM):
            dsT_s[c, r] = T.cast(acc_sT[c, r] * (acc_dpT[c, r] - delta_s[r]), dtype)
        T.gemm(pT_s, dO_s, acc_dv, policy=T.GemmWarpPolicy.FullRow)
        T.gemm(dsT_s, Q_s, acc_dk, policy=T.GemmWarpPolicy.FullRow)

    @T.prim_func
    def dense_attn_bwd_dkdv(
        Q: T.Tensor([total_q, heads, D], dtype),
        K: T.Tensor([total_k, heads_k, D], dtype),
        V: T.Tensor([total_k, heads_k, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        LSE: T.Tensor([heads, total_q], accum),
        Delta: T.Tensor([heads, total_q], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        dK: T.Tensor([total_k, heads_k, D], dtype),
        dV: T.Tensor([total_k, heads_k, D], dtype),
        batch: T.int32,
        max_kblocks: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        causal: T.int32,
        scale_log2: T.float32,
    ):
        # key blocks outermost: with causal masking the first blocks of every sequence have the
        # most query tiles and must start in the first wave, not at the end of the grid
        with T.Kernel(heads_k, batch, max_kblocks, threads=threads) as (hk, b, kb):
            K_s = T.alloc_shared([BLOCK_N, D], dtype)
            V_s = T.alloc_shared([BLOCK_N, D], dtype)
            Q_s0 = T.alloc_shared([BM, D], dtype)
            dO_s0 = T.alloc_shared([BM, D], dtype)
            lse_s0 = T.alloc_shared([BM], accum)
            delta_s0 = T.alloc_shared([BM], accum)
            Q_s1 = T.alloc_shared([BM if prefetch else 1, D], dtype)
            dO_s1 = T.alloc_shared([BM if prefetch else 1, D], dtype)
            lse_s1 = T.alloc_shared([BM if prefetch else 1], accum)
            delta_s1 = T.alloc_shared([BM if prefetch else 1], accum)
            # row r's token offset and head, computed once: as expressions they put run-time
            # integer divisions by G into every load of every query tile
            rtok_s = T.alloc_shared([BM], "int32")
            rhead_s = T.alloc_shared([BM], "int32")
            tile0 = T.alloc_var("int32")
            n_m = T.alloc_var("int32")
            acc_sT = T.alloc_fragment([BLOCK_N, BM], accum)
            acc_dpT = T.alloc_fragment([BLOCK_N, BM], accum)
            # P^T and dS^T go through shared memory: as register operands their layout would
            # have to match both the score GEMM's output and the next GEMM's A operand.
            pT_s = T.alloc_shared([BLOCK_N, BM], dtype)
            dsT_s = T.alloc_shared([BLOCK_N, BM], dtype)
            acc_dk = T.alloc_fragment([BLOCK_N, D], accum)
            acc_dv = T.alloc_fragment([BLOCK_N, D], accum)

            tx = T.get_thread_binding()
            q0 = cu_seqlens_q[b]
            k0 = cu_seqlens_k[b]
            len_q = cu_seqlens_q[b + 1] - q0
            len_k = cu_seqlens_k[b + 1] - k0
            shift = len_k - len_q
            n_tiles = T.ceildiv(len_q, tile_tokens)
            # causal: queries at positions before this block's first key cannot see it
            tile0 = T.if_then_else(causal != 0, T.max(kb * BLOCK_N - shift, 0) // tile_tokens, 0)

            if kb * BLOCK_N < len_k:
                for r in T.Parallel(BM):
                    rtok_s[r] = r // groups
                    rhead_s[r] = hk * groups + r % groups
                T.copy(K[k0 + kb * BLOCK_N : k0 + (kb + 1) * BLOCK_N, hk, :], K_s)
                T.copy(V[k0 + kb * BLOCK_N : k0 + (kb + 1) * BLOCK_N, hk, :], V_s)
                T.fill(acc_dk, 0)
                T.fill(acc_dv, 0)
                n_m = T.max(n_tiles - tile0, 0)
                if n_m > 0:
                    load_tile(Q, dO, LSE, Delta, q0, tile0 * tile_tokens,
                              T.min(tile_tokens, len_q - tile0 * tile_tokens) * groups, rtok_s, rhead_s, tx,
                              Q_s0, dO_s0, lse_s0, delta_s0)
                    T.ptx_commit_group()
                for j in T.serial(n_m):
                    if prefetch:
                        if j + 1 < n_m:
                            tn = (tile0 + j + 1) * tile_tokens
                            if j % 2 == 0:
                                load_tile(Q, dO, LSE, Delta, q0, tn, T.min(tile_tokens, len_q - tn) * groups, rtok_s,
                                          rhead_s, tx, Q_s1, dO_s1, lse_s1, delta_s1)
                            else:
                                load_tile(Q, dO, LSE, Delta, q0, tn, T.min(tile_tokens, len_q - tn) * groups, rtok_s,
                                          rhead_s, tx, Q_s0, dO_s0, lse_s0, delta_s0)
                            T.ptx_commit_group()
                            T.ptx_wait_group(1)
                        else:
                            T.ptx_wait_group(0)
                    else:
                        if j > 0:
                            tn = (tile0 + j) * tile_tokens
                            load_tile(Q, dO, LSE, Delta, q0, tn, T.min(tile_tokens, len_q - tn) * groups, rtok_s,
                                      rhead_s, tx, Q_s0, dO_s0, lse_s0, delta_s0)
                            T.ptx_commit_group()
                        T.ptx_wait_group(0)
                    T.sync_threads()
                    t0 = (tile0 + j) * tile_tokens
                    n_rows = T.min(tile_tokens, len_q - t0) * groups
                    if prefetch:
                        if j % 2 == 0:
                            compute(t0, n_rows, kb, shift, len_k, causal, scale_log2, rtok_s, K_s, V_s, pT_s, dsT_s,
                                    acc_sT, acc_dpT, acc_dk, acc_dv, Q_s0, dO_s0, lse_s0, delta_s0)
                        else:
                            compute(t0, n_rows, kb, shift, len_k, causal, scale_log2, rtok_s, K_s, V_s, pT_s, dsT_s,
                                    acc_sT, acc_dpT, acc_dk, acc_dv, Q_s1, dO_s1, lse_s1, delta_s1)
                    else:
                        compute(t0, n_rows, kb, shift, len_k, causal, scale_log2, rtok_s, K_s, V_s, pT_s, dsT_s,
                                acc_sT, acc_dpT, acc_dk, acc_dv, Q_s0, dO_s0, lse_s0, delta_s0)
                    # the next step's loads overwrite this step's buffers
                    T.sync_threads()
                for c, d in T.Parallel(BLOCK_N, D):
                    if kb * BLOCK_N + c < len_k:
                        dK[k0 + kb * BLOCK_N + c, hk, d] = T.cast(acc_dk[c, d] * (scale_log2 / LOG2E), dtype)
                        dV[k0 + kb * BLOCK_N + c, hk, d] = T.cast(acc_dv[c, d], dtype)

    return dense_attn_bwd_dkdv
