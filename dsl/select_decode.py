"""select_decode: stage 1 (select_blocks' function) split over the compressed keys, for few queries a sequence.

The same selection as select_blocks (SPEC.md stage 1: probabilities over the fine keys C1
normalised by the coarse keys, or by C1 itself, summed over the head group, max-pooled to 64-key
blocks, init and local blocks forced, the K best ascending), for calls whose query tiles alone
leave the GPU idle. Decoding makes one tile per (sequence, KV head): select_blocks then runs 2
thread blocks for a batch of one with Hk = 2, each walking 8K fine and 2K coarse keys at 128K
serially (245 us on an H100, ten times stage 2's split decode). Here each tile's keys are cut into
`splits` contiguous ranges of 64-key chunks, one thread block each.

Kernels (one PrimFunc each; `splits` ranges a tile, tile-major in grid x):
  lse     each (tile, split) runs the online log-sum-exp of its range of normaliser chunks and
          writes the partial row max and sum (M_part, L_part); split 0 also writes the exact
          fallback (M_fine, L_fine) of rows too early to see a coarse key
                                                          grid (tiles x splits, batch, Hk)
  scores  each (tile, split) merges the partials in split order (every split the same way, so
          every split sees the same normaliser), computes the probabilities of its range of
          fine chunks, sums each token's G rows and max-pools them into block scores SC
          (Hk, total_q, n_blocks) fp32. A block's pool takes the last key of the chunk before,
          so a split recomputes its range's previous chunk (one chunk more per split) rather
          than depending on another split.          grid (tiles x splits, batch, Hk)
  topk    per tile: the scores into shared memory (blocks past the computed ones -inf), then
          select_blocks' radix top-K, by the whole thread block a token
                                                          grid (tiles, batch, Hk)
Every sum runs in a fixed order: the result is deterministic, and independent of `splits` up
to the rounding of the normaliser's merge (ties at the K-th score then may resolve otherwise).
"""

import tilelang.language as T

from dsl import EXP_NVCC_FLAGS
from dsl.group_rows import load_rows
from dsl.spans import seq_len, seq_start
from dsl.select_blocks import (BLOCK, BLOCK_M, BN, BPC, FINE_S, FINE_W, KEY_NEG_INF, NEG_INF, P_PAD, POOL, THREADS,
                               T_MAX, UNROLL, _n_visible, _score_cap, fetch, key_into,
                               lse_pass)

OP = "select_decode"
NVCC_FLAGS = EXP_NVCC_FLAGS
MAX_SPLITS = 64
# The top-K's thread block: a decoding token's 2048 block scores at 128K are 4 a thread (measured
# with 128 threads, 16 a thread: 19 us, most of a 128K step's selection)
TOPK_THREADS = 512
TOPK_WARPS = TOPK_THREADS // 32
# the top-K's int32 registers
RS_CNT, RS_KLEFT, RS_GPREV, RS_EPREV, RS_BIN, RS_A, RS_B, RS_C, RS_GT, RS_EQ = range(10)

KERNELS = ("lse", "scores")
VARIANTS = [
    {"kernel": kernel, "dtype": dtype, "head_dim": head_dim}
    for kernel in KERNELS
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
] + [{"kernel": "topk", "dtype": "float32", "head_dim": 0}]


def variant_name(kernel, dtype, head_dim):
    if kernel == "topk":
        return f"{OP}_topk"
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{OP}_{kernel}_{short}_d{head_dim}"


def pass_configs(kernel, dtype, head_dim, arch):
    # as select_blocks: the pooling and top-K code index by thread
    from tilelang import PassConfigKey

    return {PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def unit_constants(kernel, dtype, head_dim, arch):
    if kernel == "topk":
        return {"score_cap": _score_cap(arch), "block": BLOCK}
    return {"block_m": BLOCK_M, "t_max": T_MAX, "fine_w": FINE_W, "fine_s": FINE_S, "block": BLOCK,
            "max_splits": MAX_SPLITS}


def program(kernel, dtype, head_dim, arch):
    if kernel == "topk":
        return _topk(arch)
    return {"lse": _lse, "scores": _scores}[kernel](dtype, head_dim)


def _n_load(p_last, n_c, local_blocks):
    """Fine chunks a tile needs (as select_blocks): from the last token's local window on, every
    block is forced or in the future for every token, and block b needs keys 4b-1 .. 4b+3."""
    return T.ceildiv(T.min(_n_visible(p_last, n_c, FINE_W, FINE_S), T.max(p_last // BLOCK - local_blocks, 0) * POOL),
                     BN)


# Index of each scalar a kernel keeps in its int32 register array `iv`. Held in registers, not
# as expressions: TileLang inlines a Python-level expression wherever it is used, so the split
# range (two run-time divisions) would be recomputed, in 64 bits, for every element of every
# chunk's copy (measured: 14 us a chunk instead of about 1.5).
Q0, T0, N_TOK, P0, P_LAST, SLOT, SPLIT, LO, HI, START, N_LOAD, N_VIS, N_VIS0, N_FINE, C0, NK0 = range(16)
N_IV = 16


@T.macro
def tile_scalars(iv, cu_seqlens_q, cu_seqlens_k, total_q, tile_tokens, max_tiles, splits, bx, b):
    """iv[Q0, T0, N_TOK, P0, P_LAST, SLOT, SPLIT] of thread block bx of sequence b, for a grid of
    (tiles x splits): query tile bx // splits (bottom-right causal), split bx % splits. The key
    offsets give positions only: the loops run over the compressed keys' spans."""
    iv[SPLIT] = bx % splits
    iv[T0] = (bx // splits) * tile_tokens
    iv[SLOT] = b * max_tiles + bx // splits
    iv[Q0] = seq_start(cu_seqlens_q, b, total_q)
    len_q = seq_len(cu_seqlens_q, b, total_q, iv[Q0])
    iv[N_TOK] = T.max(T.min(tile_tokens, len_q - iv[T0]), 0)
    iv[P0] = cu_seqlens_k[b + 1] - cu_seqlens_k[b] - len_q + iv[T0]
    iv[P_LAST] = iv[P0] + iv[N_TOK] - 1


@T.macro
def split_range(iv, n_chunks, splits):
    """iv[LO], iv[HI]: chunks [lo, hi) of split iv[SPLIT] when n_chunks are cut into `splits`
    ceil-sized ranges (empty ones past the end)."""
    iv[HI] = n_chunks  # the count, then the end
    iv[START] = T.ceildiv(iv[HI], splits)  # chunks a range
    iv[LO] = T.min(iv[SPLIT] * iv[START], iv[HI])
    iv[HI] = T.min(iv[LO] + iv[START], iv[HI])


def _signature(dtype, D):
    accum = "float32"
    total_q = T.dynamic("total_q")
    total_c = T.dynamic("total_c")
    heads = T.dynamic("heads")
    heads_k = T.dynamic("heads_k")
    batch_plus_one = T.dynamic("batch_plus_one")
    part_rows = T.dynamic("part_rows")  # batch x max_tiles x splits
    tile_rows = T.dynamic("tile_rows")  # batch x max_tiles
    # one T.Tensor object per parameter: the launcher's argument list goes wrong when two share one
    return {
        "Q": lambda: T.Tensor([total_q, heads, D], dtype),
        "CK": lambda: T.Tensor([total_c, heads_k, D], dtype),
        "cu": lambda: T.Tensor([batch_plus_one], "int32"),
        "part": lambda: T.Tensor([heads_k, part_rows, BLOCK_M], accum),
        "fine": lambda: T.Tensor([heads_k, tile_rows, BLOCK_M], accum),
        "heads_k": heads_k,
        "total_q": total_q,
    }


def _lse(dtype, D):
    accum = "float32"
    sig = _signature(dtype, D)
    total_n = T.dynamic("total_n")
    NK_t = T.Tensor([total_n, sig["heads_k"], D], dtype)

    @T.prim_func
    def select_decode_lse(
        Q: sig["Q"](), CK: sig["CK"](), NK: NK_t, cu_seqlens_q: sig["cu"](), cu_seqlens_k: sig["cu"](),
        cu_seqlens_c: sig["cu"](), cu_seqlens_n: sig["cu"](), M_part: sig["part"](), L_part: sig["part"](),
        M_fine: sig["fine"](), L_fine: sig["fine"](),
        batch: T.int32, max_tiles: T.int32, splits: T.int32, groups: T.int32, tile_tokens: T.int32,
        norm_window: T.int32, norm_stride: T.int32, approx: T.int32, scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles * splits, batch, sig["heads_k"], threads=THREADS) as (bx, b, hk):
            Q_s = T.alloc_shared([BLOCK_M, D], dtype)
            Q_f = T.alloc_fragment([BLOCK_M, D], dtype)
            K_s = T.alloc_shared([BN, D], dtype)
            acc_s = T.alloc_fragment([BLOCK_M, BN], accum)
            m_run = T.alloc_fragment([BLOCK_M], accum)
            l_run = T.alloc_fragment([BLOCK_M], accum)
            m_prev = T.alloc_fragment([BLOCK_M], accum)
            m_safe = T.alloc_fragment([BLOCK_M], accum)
            r_scale = T.alloc_fragment([BLOCK_M], accum)
            r_sum = T.alloc_fragment([BLOCK_M], accum)
            rowpos = T.alloc_fragment([BLOCK_M], "int32")
            iv = T.alloc_local([N_IV], "int32")
            tile_scalars(iv, cu_seqlens_q, cu_seqlens_k, Q.shape[0], tile_tokens, max_tiles, splits, bx, b)
            iv[NK0] = seq_start(cu_seqlens_n, b, NK.shape[0])
            iv[C0] = seq_start(cu_seqlens_c, b, CK.shape[0])
            n_n = seq_len(cu_seqlens_n, b, NK.shape[0], iv[NK0])
            n_c = seq_len(cu_seqlens_c, b, CK.shape[0], iv[C0])
            if iv[N_TOK] > 0:
                load_rows(Q, Q_s, iv[Q0] + iv[T0], hk, iv[N_TOK], groups)
                T.copy(Q_s, Q_f)
                T.sync_threads()
                for r in T.Parallel(BLOCK_M):
                    rowpos[r] = T.if_then_else(r < iv[N_TOK] * groups, iv[P0] + r // groups, -1)
                iv[N_VIS] = _n_visible(iv[P_LAST], n_n, norm_window, norm_stride)
                iv[N_VIS0] = _n_visible(iv[P0], n_n, norm_window, norm_stride)
                split_range(iv, T.ceildiv(iv[N_VIS], BN), splits)
                lse_pass(NK, iv[NK0], iv[LO], iv[HI], iv[N_VIS], iv[N_VIS0], norm_window, norm_stride, hk, rowpos,
                           scale_log2, Q_f, K_s, acc_s, m_run, l_run, m_prev, m_safe, r_scale, r_sum)
                for r in T.Parallel(BLOCK_M):
                    M_part[hk, iv[SLOT] * splits + iv[SPLIT], r] = m_run[r]
                    L_part[hk, iv[SLOT] * splits + iv[SPLIT], r] = l_run[r]
                if iv[SPLIT] == 0 and approx != 0 and iv[P0] < norm_window - 1:
                    # rows too early to see a coarse key use the exact normaliser (as select_blocks):
                    # a handful of fine keys, so split 0 takes them all
                    iv[N_VIS] = _n_visible(T.min(iv[P_LAST], norm_window - 2), n_c, FINE_W, FINE_S)
                    iv[N_VIS0] = _n_visible(T.min(iv[P0], norm_window - 2), n_c, FINE_W, FINE_S)
                    lse_pass(CK, iv[C0], 0, T.ceildiv(iv[N_VIS], BN), iv[N_VIS], iv[N_VIS0], FINE_W, FINE_S, hk,
                               rowpos, scale_log2, Q_f, K_s, acc_s, m_run, l_run, m_prev, m_safe, r_scale, r_sum)
                    for r in T.Parallel(BLOCK_M):
                        M_fine[hk, iv[SLOT], r] = m_run[r]
                        L_fine[hk, iv[SLOT], r] = l_run[r]

    return select_decode_lse


def _scores(dtype, D):
    accum = "float32"
    sig = _signature(dtype, D)
    score_stride = T.dynamic("score_stride")

    @T.prim_func
    def select_decode_scores(
        Q: sig["Q"](), CK: sig["CK"](), cu_seqlens_q: sig["cu"](), cu_seqlens_k: sig["cu"](), cu_seqlens_c: sig["cu"](),
        M_part: sig["part"](), L_part: sig["part"](), M_fine: sig["fine"](), L_fine: sig["fine"](),
        SC: T.Tensor([sig["heads_k"], sig["total_q"], score_stride], accum),
        batch: T.int32, max_tiles: T.int32, splits: T.int32, groups: T.int32, tile_tokens: T.int32,
        local_blocks: T.int32, norm_window: T.int32, approx: T.int32, scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles * splits, batch, sig["heads_k"], threads=THREADS) as (bx, b, hk):
            Q_s = T.alloc_shared([BLOCK_M, D], dtype)
            Q_f = T.alloc_fragment([BLOCK_M, D], dtype)
            K_s = T.alloc_shared([BN, D], dtype)
            P_s = T.alloc_shared([BLOCK_M, BN + P_PAD], accum)
            # per token, the group sums of the chunk's columns from 1 on; column 0 holds the
            # previous chunk's last one
            G_s = T.alloc_shared([T_MAX, BN + 1], accum)
            Mp_s = T.alloc_shared([MAX_SPLITS, BLOCK_M], accum)
            Lp_s = T.alloc_shared([MAX_SPLITS, BLOCK_M], accum)
            acc_s = T.alloc_fragment([BLOCK_M, BN], accum)
            m_run = T.alloc_fragment([BLOCK_M], accum)
            l_run = T.alloc_fragment([BLOCK_M], accum)
            m_safe = T.alloc_fragment([BLOCK_M], accum)
            lse2 = T.alloc_fragment([BLOCK_M], accum)
            rowpos = T.alloc_fragment([BLOCK_M], "int32")
            vw = T.alloc_local([1], accum)  # a block's running max
            colv = T.alloc_local([T_MAX * BN // THREADS], accum)  # this thread's columns' group sums
            iv = T.alloc_local([N_IV], "int32")
            tx = T.get_thread_binding()
            tile_scalars(iv, cu_seqlens_q, cu_seqlens_k, Q.shape[0], tile_tokens, max_tiles, splits, bx, b)
            iv[C0] = seq_start(cu_seqlens_c, b, CK.shape[0])
            n_c = seq_len(cu_seqlens_c, b, CK.shape[0], iv[C0])
            iv[N_FINE] = _n_visible(iv[P_LAST], n_c, FINE_W, FINE_S)
            iv[N_LOAD] = _n_load(iv[P_LAST], n_c, local_blocks)
            split_range(iv, iv[N_LOAD], splits)
            iv[START] = T.max(iv[LO] - 1, 0)
            if iv[N_TOK] > 0 and iv[LO] < iv[HI]:
                load_rows(Q, Q_s, iv[Q0] + iv[T0], hk, iv[N_TOK], groups)
                T.copy(Q_s, Q_f)
                T.sync_threads()
                for r in T.Parallel(BLOCK_M):
                    rowpos[r] = T.if_then_else(r < iv[N_TOK] * groups, iv[P0] + r // groups, -1)
                # the normaliser: the splits' partial sums merged in split order. Staged through
                # shared memory by all threads at once: read in the merge loop, each split's load
                # would wait on the one before (30 us at 16 splits on an H100).
                for sp, r in T.Parallel(MAX_SPLITS, BLOCK_M):
                    Mp_s[sp, r] = T.if_then_else(sp < splits, M_part[hk, iv[SLOT] * splits + sp, r], NEG_INF)
                    Lp_s[sp, r] = T.if_then_else(sp < splits, L_part[hk, iv[SLOT] * splits + sp, r], 0)
                T.sync_threads()
                T.fill(m_run, NEG_INF)
                T.fill(l_run, 0)
                for s in T.serial(splits):
                    for r in T.Parallel(BLOCK_M):
                        m_run[r] = T.max(m_run[r], Mp_s[s, r])
                for r in T.Parallel(BLOCK_M):
                    m_safe[r] = T.if_then_else(m_run[r] == NEG_INF, 0, m_run[r])
                for s in T.serial(splits):
                    for r in T.Parallel(BLOCK_M):
                        l_run[r] += T.if_then_else(Lp_s[s, r] > 0,
                                                   Lp_s[s, r] * T.exp2((Mp_s[s, r] - m_safe[r]) * scale_log2), 0)
                for r in T.Parallel(BLOCK_M):
                    lse2[r] = m_run[r] * scale_log2 + T.log2(l_run[r])
                if approx != 0 and iv[P0] < norm_window - 1:
                    for r in T.Parallel(BLOCK_M):
                        if l_run[r] == 0:
                            lse2[r] = M_fine[hk, iv[SLOT], r] * scale_log2 + T.log2(L_fine[hk, iv[SLOT], r])
                for t in T.Parallel(T_MAX):
                    G_s[t, 0] = NEG_INF
                for i in T.serial(iv[HI] - iv[START]):
                    fetch(CK, iv[C0], hk, iv[START] + i, K_s)
                    T.clear(acc_s)
                    T.gemm(Q_f, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    for r, c in T.Parallel(BLOCK_M, BN):
                        # invisible columns get -inf so that a token's group sum is -inf there
                        P_s[r, c] = T.if_then_else(
                            (iv[START] + i) * BN + c < iv[N_FINE]
                            and ((iv[START] + i) * BN + c) * FINE_S + FINE_W - 1 <= rowpos[r],
                            T.exp2(acc_s[r, c] * scale_log2 - lse2[r]),
                            NEG_INF,
                        )
                    T.sync_threads()
                    # every column's group sums at once (a serial sum of a token's G rows each),
                    # then the pools read them: the pool of a (token, block) summing its five
                    # columns itself kept most threads idle for a decoding token
                    # (summed into registers first: TileLang's barrier planner put two barriers
                    # into every step of a loop that read P_s and wrote G_s)
                    for e in T.unroll(T_MAX * BN // THREADS):
                        colv[e] = 0
                        if e * THREADS + tx < iv[N_TOK] * BN:
                            for h in T.serial(groups):
                                colv[e] += P_s[((e * THREADS + tx) // BN) * groups + h, (e * THREADS + tx) % BN]
                    for e in T.unroll(T_MAX * BN // THREADS):
                        if e * THREADS + tx < iv[N_TOK] * BN:
                            G_s[(e * THREADS + tx) // BN, (e * THREADS + tx) % BN + 1] = colv[e]
                    T.sync_threads()
                    if iv[START] + i >= iv[LO]:
                        # block (start + i) * BPC + bb pools the group sums of keys 4bb - 1 .. 4bb + 3
                        for e in T.serial(T.ceildiv(iv[N_TOK] * BPC, THREADS)):
                            if e * THREADS + tx < iv[N_TOK] * BPC:
                                vw[0] = G_s[(e * THREADS + tx) // BPC, ((e * THREADS + tx) % BPC) * POOL]
                                for k in T.serial(POOL):
                                    vw[0] = T.max(vw[0], G_s[(e * THREADS + tx) // BPC,
                                                              ((e * THREADS + tx) % BPC) * POOL + k + 1])
                                if ((iv[START] + i) * BPC + (e * THREADS + tx) % BPC
                                        <= (iv[P0] + (e * THREADS + tx) // BPC) // BLOCK
                                        and (iv[START] + i) * BPC + (e * THREADS + tx) % BPC < score_stride):
                                    SC[hk, iv[Q0] + iv[T0] + (e * THREADS + tx) // BPC,
                                       (iv[START] + i) * BPC + (e * THREADS + tx) % BPC] = vw[0]
                    T.sync_threads()  # the carry is read above before it is replaced
                    if tx < iv[N_TOK]:
                        G_s[tx, 0] = G_s[tx, BN]
                if iv[HI] == iv[N_LOAD] and tx < iv[N_TOK]:
                    # the block after the last chunk sees only that chunk's last key
                    if iv[N_LOAD] * BPC <= (iv[P0] + tx) // BLOCK and iv[N_LOAD] * BPC < score_stride:
                        SC[hk, iv[Q0] + iv[T0] + tx, iv[N_LOAD] * BPC] = G_s[tx, 0]

    return select_decode_scores


def _make_block_top_k(topk):
    """A macro: per token, the topk best of its block scores, ascending, -1 padded, by the whole
    thread block (TOPK_THREADS). select_blocks' top-K gives each token one warp, which leaves the
    other warps idle for a decoding token (40 us for 2048 blocks on an H100). Same keys, same 8-bit
    radix select and the same rule (key > threshold, or == threshold among the first k_left in
    block order), with every thread histogramming its blocks into one shared histogram and the
    ordered output written TOPK_THREADS blocks a round. A block's slot is the blocks above the
    threshold before it plus min(the blocks equal to it before it, k_left): each round needs the
    warps' two counts once (one barrier; the counts are double-buffered by round).

    rs: see RS_* ; ru = [prefix, mask, key, threshold]; cnt_s (3, 2, TOPK_WARPS) int32 per-warp
    counts (rounds by parity, and the candidate count in slot 2)."""

    @T.macro
    def warp_prefix(cnt_s, j, kind, rs, out, tot, warp, lane):
        """rs[out] = the sum of cnt_s[j, kind, w] over warps w < warp, rs[tot] = over all warps."""
        rs[out] = T.if_then_else(lane < TOPK_WARPS, cnt_s[j, kind, T.min(lane, TOPK_WARPS - 1)], 0)
        for sh in T.serial(5):
            rs[tot] = T.shfl_up(rs[out], 1 << sh)
            if lane >= (1 << sh):
                rs[out] += rs[tot]
        rs[tot] = T.shfl_sync(rs[out], 31)
        rs[out] = T.shfl_sync(rs[out], T.max(warp - 1, 0))
        if warp == 0:
            rs[out] = 0

    @T.macro
    def block_top_k(topk_idx, SC_s, hist_s, st_s, cnt_s, rs, ru, kk, bins, tx, hk, row0, n_tok, p0, score_stride,
                    init_blocks, local_blocks):
        warp = tx // 32
        lane = tx % 32
        below = (T.uint32(1) << T.cast(lane, "uint32")) - T.uint32(1)
        for t in T.serial(n_tok):
            qb = (p0 + t) // BLOCK
            nbt = T.min(qb + 1, score_stride)
            # the scores become their keys in place, once, and the candidates are counted
            rs[RS_CNT] = 0
            for i in T.serial(T.ceildiv(nbt, TOPK_THREADS)):
                if i * TOPK_THREADS + tx < nbt:
                    key_into(ru, SC_s, t * score_stride, i * TOPK_THREADS + tx, qb, init_blocks, local_blocks)
                    SC_s[t * score_stride + i * TOPK_THREADS + tx] = T.reinterpret(ru[2], "float32")
                    if ru[2] > T.uint32(KEY_NEG_INF):
                        rs[RS_CNT] += 1
            rs[RS_CNT] = T.warp_reduce_sum(rs[RS_CNT])
            if lane == 0:
                cnt_s[2, 0, warp] = rs[RS_CNT]
            T.sync_threads()
            warp_prefix(cnt_s, 2, 0, rs, RS_A, RS_CNT, warp, lane)
            ru[3] = T.uint32(KEY_NEG_INF)
            rs[RS_KLEFT] = 0
            if rs[RS_CNT] > topk:
                ru[0] = T.uint32(0)
                ru[1] = T.uint32(0)
                rs[RS_KLEFT] = topk
                for dgt in T.serial(4):
                    if tx < 256:
                        hist_s[tx] = 0
                    T.sync_threads()
                    for i in T.serial(T.ceildiv(nbt, TOPK_THREADS * UNROLL)):
                        for u in T.unroll(UNROLL):
                            rs[RS_A] = (i * UNROLL + u) * TOPK_THREADS + tx
                            kk[u] = T.reinterpret(SC_s[t * score_stride + T.min(rs[RS_A], nbt - 1)], "uint32")
                            bins[u] = T.if_then_else(
                                rs[RS_A] < nbt and kk[u] > T.uint32(KEY_NEG_INF) and (kk[u] & ru[1]) == ru[0],
                                T.cast((kk[u] >> T.cast(24 - 8 * dgt, "uint32")) & T.uint32(255), "int32"),
                                256,
                            )
                        for u in T.unroll(UNROLL):
                            # one atomic a distinct bin a warp
                            rs[RS_A] = T.cast(T.match_any_sync(bins[u]), "int32")
                            if bins[u] < 256 and T.popcount(T.cast(rs[RS_A], "uint32") & below) == 0:
                                T.atomic_add(hist_s[bins[u]], T.popcount(T.cast(rs[RS_A], "uint32")))
                    T.sync_threads()
                    if warp == 0:
                        # lane l holds bins 8l .. 8l + 7; the threshold bin is where the count of
                        # keys in higher bins first reaches k_left
                        rs[RS_A] = 0
                        for q in T.serial(8):
                            rs[RS_A] += hist_s[lane * 8 + q]
                        rs[RS_B] = rs[RS_A]
                        for sh in T.serial(5):
                            rs[RS_C] = T.shfl_down(rs[RS_B], 1 << sh)
                            if lane + (1 << sh) < 32:
                                rs[RS_B] += rs[RS_C]
                        if rs[RS_B] - rs[RS_A] < rs[RS_KLEFT] and rs[RS_KLEFT] <= rs[RS_B]:
                            rs[RS_C] = rs[RS_B] - rs[RS_A]
                            rs[RS_BIN] = -1
                            for q in T.serial(8):
                                if rs[RS_BIN] < 0:
                                    rs[RS_A] = hist_s[lane * 8 + 7 - q]
                                    if rs[RS_C] + rs[RS_A] >= rs[RS_KLEFT]:
                                        rs[RS_BIN] = lane * 8 + 7 - q
                                        st_s[0] = rs[RS_BIN]
                                        st_s[1] = rs[RS_KLEFT] - rs[RS_C]
                                    else:
                                        rs[RS_C] += rs[RS_A]
                    T.sync_threads()
                    rs[RS_KLEFT] = st_s[1]
                    ru[0] = ru[0] | (T.cast(st_s[0], "uint32") << T.cast(24 - 8 * dgt, "uint32"))
                    ru[1] = ru[1] | (T.uint32(255) << T.cast(24 - 8 * dgt, "uint32"))
                ru[3] = ru[0]
            # ordered output, TOPK_THREADS blocks a round
            rs[RS_GPREV] = 0  # blocks above the threshold in earlier rounds
            rs[RS_EPREV] = 0  # blocks equal to it in earlier rounds
            for i in T.serial(T.ceildiv(nbt, TOPK_THREADS)):
                ru[2] = T.if_then_else(
                    i * TOPK_THREADS + tx < nbt,
                    T.reinterpret(SC_s[t * score_stride + T.min(i * TOPK_THREADS + tx, nbt - 1)], "uint32"),
                    T.uint32(0),
                )
                rs[RS_GT] = T.cast(T.ballot_sync(ru[2] > ru[3]), "int32")
                rs[RS_EQ] = T.cast(T.ballot_sync(ru[2] == ru[3] and ru[2] > T.uint32(KEY_NEG_INF)), "int32")
                if lane == 0:
                    cnt_s[i % 2, 0, warp] = T.popcount(T.cast(rs[RS_GT], "uint32"))
                    cnt_s[i % 2, 1, warp] = T.popcount(T.cast(rs[RS_EQ], "uint32"))
                T.sync_threads()
                warp_prefix(cnt_s, i % 2, 0, rs, RS_A, RS_B, warp, lane)
                rs[RS_A] += rs[RS_GPREV] + T.popcount(T.cast(rs[RS_GT], "uint32") & below)
                rs[RS_GPREV] += rs[RS_B]
                warp_prefix(cnt_s, i % 2, 1, rs, RS_C, RS_B, warp, lane)
                rs[RS_C] += rs[RS_EPREV] + T.popcount(T.cast(rs[RS_EQ], "uint32") & below)
                rs[RS_EPREV] += rs[RS_B]
                if ru[2] > ru[3] or (ru[2] == ru[3] and ru[2] > T.uint32(KEY_NEG_INF) and rs[RS_C] < rs[RS_KLEFT]):
                    topk_idx[hk, row0 + t, rs[RS_A] + T.min(rs[RS_C], rs[RS_KLEFT])] = i * TOPK_THREADS + tx
            rs[RS_A] = rs[RS_GPREV] + T.min(rs[RS_EPREV], rs[RS_KLEFT])  # the picks
            for i in T.serial(T.ceildiv(topk, TOPK_THREADS)):
                if i * TOPK_THREADS + tx >= rs[RS_A] and i * TOPK_THREADS + tx < topk:
                    topk_idx[hk, row0 + t, i * TOPK_THREADS + tx] = -1

    return block_top_k


def _topk(arch):
    accum = "float32"
    score_cap = _score_cap(arch)
    total_q = T.dynamic("total_q")
    heads_k = T.dynamic("heads_k")
    score_stride = T.dynamic("score_stride")
    batch_plus_one = T.dynamic("batch_plus_one")
    out_cols = T.dynamic("topk")
    top_k = _make_block_top_k(out_cols)

    @T.prim_func
    def select_decode_topk(
        SC: T.Tensor([heads_k, total_q, score_stride], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
        topk_idx: T.Tensor([heads_k, total_q, out_cols], "int32"),
        batch: T.int32, max_tiles: T.int32, tile_tokens: T.int32, init_blocks: T.int32, local_blocks: T.int32,
    ):
        with T.Kernel(max_tiles, batch, heads_k, threads=TOPK_THREADS) as (bx, b, hk):
            SC_s = T.alloc_shared([score_cap], accum)
            hist_s = T.alloc_shared([256], "int32")
            st_s = T.alloc_shared([2], "int32")
            cnt_s = T.alloc_shared([3, 2, TOPK_WARPS], "int32")
            rs = T.alloc_local([10], "int32")
            ru = T.alloc_local([4], "uint32")
            kk = T.alloc_local([UNROLL], "uint32")
            bins = T.alloc_local([UNROLL], "int32")
            iv = T.alloc_local([N_IV], "int32")
            tx = T.get_thread_binding()
            tile_scalars(iv, cu_seqlens_q, cu_seqlens_k, total_q, tile_tokens, max_tiles, 1, bx, b)
            # blocks past the scores kernel's last one hold no visible key for any token, or are
            # forced: -inf (no split wrote them). (Offsets past the compressed keys, which this
            # kernel does not see, make it read entries the scores kernel did not write: garbage
            # picks, inside SC.)
            iv[N_LOAD] = _n_load(iv[P_LAST], cu_seqlens_c[b + 1] - cu_seqlens_c[b], local_blocks)
            iv[HI] = T.if_then_else(iv[N_LOAD] > 0, iv[N_LOAD] * BPC + 1, 0)
            if iv[N_TOK] > 0:
                for e in T.serial(T.ceildiv(iv[N_TOK] * score_stride, TOPK_THREADS)):
                    if e * TOPK_THREADS + tx < iv[N_TOK] * score_stride:
                        SC_s[e * TOPK_THREADS + tx] = T.if_then_else(
                            (e * TOPK_THREADS + tx) % score_stride < iv[HI]
                            and (e * TOPK_THREADS + tx) % score_stride
                            <= (iv[P0] + (e * TOPK_THREADS + tx) // score_stride) // BLOCK,
                            SC[hk, iv[Q0] + iv[T0] + (e * TOPK_THREADS + tx) // score_stride,
                               (e * TOPK_THREADS + tx) % score_stride],
                            NEG_INF,
                        )
                T.sync_threads()
                top_k(topk_idx, SC_s, hist_s, st_s, cnt_s, rs, ru, kk, bins, tx, hk, iv[Q0] + iv[T0], iv[N_TOK],
                      iv[P0], score_stride, init_blocks, local_blocks)

    return select_decode_topk
