"""sparse_decode: stage 2's forward split over the selected blocks, for few queries a sequence.

The same function as sparse_attn's forward (O and the natural-log LSE of each query over the
keys of its group's selected 64-token blocks, bottom-right causal), for calls whose query tiles
alone leave most of the GPU idle: one decoding token per sequence against a long cache makes one
tile per (sequence, KV head), 2 thread blocks for a batch of one with Hk = 2, each walking all
its K selected blocks. Here each tile's union of blocks is cut into `splits` contiguous ranges,
one thread block each, and a second kernel merges their partial results (split-KV decoding).

Kernels (one PrimFunc each):
  fwd      each (tile, split) builds its tile's union as sparse_attn's forward does, walks its
           range of it and writes the range's O (normalised, fp32) and LSE into the
           partial buffers at rows split * total_q + token; an empty range writes O = 0 and
           LSE = -inf                                         grid (tiles x splits, batch, Hk)
  combine  per query row: LSE = log sum_s exp(LSE_s), O = sum_s exp(LSE_s - LSE) O_s, cast to
           the output dtype; a row no split saw gets O = 0, LSE = -inf   grid (rows / 4, heads)
Every sum runs in a fixed order: the result is deterministic.
"""

import tilelang.language as T

from dsl import EXP_NVCC_FLAGS
from dsl.group_rows import load_rows
from dsl.spans import seq_span
from dsl.sparse_attn import (BLOCK_M, BLOCK_N, K_MAX, NEG_INF, SMALL_TOKENS, LOG2E, _fwd_signature, _fwd_state, _make_tile_union,
                             _union_buffers, store_out, walk_partial_blocks, walk_tile_union, walk_tile_union_tma)

OP = "sparse_decode"
NVCC_FLAGS = EXP_NVCC_FLAGS

# Tokens a tile: decoding has one (or a few, speculative) queries a sequence, so the union
# buffers stay small (64 KB a tile at D = 128 fits every arch's shared memory).
T_MAX = SMALL_TOKENS
COMBINE_ROWS = 4  # query rows (token, head) a combine block merges: a warp each
MAX_SPLITS = 64

KERNELS = ("fwd", "kvcache", "combine")
VARIANTS = [
    {"kernel": kernel, "dtype": dtype, "head_dim": head_dim}
    for kernel in KERNELS
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
]


def variant_name(kernel, dtype, head_dim):
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{OP}_{kernel}_{short}_d{head_dim}"


def pass_configs(kernel, arch, dtype=None, head_dim=None):
    # as sparse_attn's forward: the union prologue indexes by thread, so no warp specialisation
    from tilelang import PassConfigKey

    return {PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True} if kernel != "combine" else {}


def unit_constants(kernel, arch, dtype=None, head_dim=None):
    if kernel != "combine":
        return {"block_m": BLOCK_M, "t_max": T_MAX, "max_splits": MAX_SPLITS}
    return {"rows": COMBINE_ROWS}


def program(kernel, arch, dtype, head_dim):
    if kernel == "combine":
        return _combine(dtype, head_dim)
    # sm_90a: each block's K and V load by TMA while the block before is computed (a split walks
    # a few blocks, each otherwise a whole load latency; TileLang's two-stage cp.async pipeline
    # cannot lower a run-time trip count here, TILELANG.md)
    return {"fwd": _fwd, "kvcache": _kvcache}[kernel](dtype, head_dim, arch == "sm_90a")


@T.macro
def _split_tile(Q, K, V, topk_idx, O_part, LSE_part, tile_union, bx, b, hk, q0, k0, len_q, len_k, groups, tile_tokens,
                scale_log2, splits, tma, cache_row=None):
    """One (tile, split) of the split forward: the tile's union, this split's range of it walked,
    the range's normalised O and LSE written to the partial rows split * total_q + token.
    ``cache_row`` maps a block to its first row of K and V in a cache (None: packed keys);
    ``tma``: the walk's loads by TMA (sm_90a), the next block's in flight."""
    threads = 128
    dtype = Q.dtype
    D = Q.shape[2]
    Q_s = T.alloc_shared([BLOCK_M, D], dtype)
    K_s = T.alloc_shared([BLOCK_N, D], dtype)
    V_s = T.alloc_shared([BLOCK_N, D], dtype)
    idx_s, keep_s, ublk_s, umask_s, n_union, my_keep, my_mask, bm_s = _union_buffers(T_MAX, threads)
    n_it = T.alloc_var("int32")
    lo = T.alloc_var("int32")
    if cache_row is not None:
        n_full = T.alloc_var("int32")
        part_at = T.alloc_shared([1], "int32")
        rows_s = T.alloc_shared([T_MAX * K_MAX], "int32")
    acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum = _fwd_state(dtype, D)
    rtok = T.alloc_fragment([BLOCK_M], "int32")
    full = T.alloc_barrier([threads, threads]) if tma else None  # K_s, V_s landed

    tx = T.get_thread_binding()
    # computed once: as expressions, every use of t0 would divide by the run-time splits
    t0 = T.alloc_var("int32")
    split = T.alloc_var("int32")
    t0 = (bx // splits) * tile_tokens
    split = bx % splits
    n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
    p0 = len_k - len_q + t0
    total_q = Q.shape[0]

    if n_tok > 0:
        load_rows(Q, Q_s, q0 + t0, hk, n_tok, groups)
        tile_union(topk_idx, hk, q0 + t0, n_tok, p0, tx, idx_s, keep_s, ublk_s, umask_s,
                   n_union, my_keep, my_mask, bm_s)
        # this split's range of the union, moved to the front of the (now free) scratch
        # buffers: ranges differ by at most one block
        n_it = n_union[0] // splits + T.if_then_else(split < n_union[0] % splits, 1, 0)
        lo = split * (n_union[0] // splits) + T.min(split, n_union[0] % splits)
        if cache_row is None:
            for e in T.serial(T.ceildiv(n_it, threads)):
                i = e * threads + tx
                if i < n_it:
                    idx_s[i] = ublk_s[lo + i]
                    keep_s[i] = umask_s[lo + i]
        else:
            # a cache's partial last block, if in the range, goes last: walk_tile_union loads it
            # apart (rows past the keys as zeros), the others by pipelined copies
            if tx == 0:
                part_at[0] = n_it
            T.sync_threads()
            for e in T.serial(T.ceildiv(n_it, threads)):
                i = e * threads + tx
                if i < n_it and len_k % BLOCK_N != 0 and ublk_s[lo + i] == len_k // BLOCK_N:
                    part_at[0] = i
            T.sync_threads()
            for e in T.serial(T.ceildiv(n_it, threads)):
                i = e * threads + tx
                src = T.if_then_else(i < part_at[0], i, T.if_then_else(i == n_it - 1, part_at[0], i + 1))
                if i < n_it:
                    idx_s[i] = ublk_s[lo + src]
                    keep_s[i] = umask_s[lo + src]
                    # each block's cache row, looked up by all threads at once: read by the walk
                    # block by block, every table read would delay its block's copies
                    rows_s[i] = cache_row(ublk_s[lo + src])
            n_full = n_it - T.if_then_else(part_at[0] < n_it, 1, 0)
        T.sync_threads()
        for r in T.Parallel(BLOCK_M):
            rtok[r] = T.if_then_else(r < n_tok * groups, r // groups, 31)
        T.fill(acc_o, 0)
        T.fill(l_sum, 0)
        T.fill(m_cur, NEG_INF)
        if not tma:
            walk_tile_union(K, V, k0, hk, Q_s, K_s, V_s, idx_s, keep_s, n_it, n_tok, p0, rtok, acc_s, acc_s_cast,
                            acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, 1,
                            None if cache_row is None else (lambda it, blk: rows_s[it]),
                            None if cache_row is None else len_k, None if cache_row is None else n_full)
        elif cache_row is None:
            walk_tile_union_tma(K, V, k0, hk, Q_s, K_s, V_s, full, idx_s, keep_s, n_it, n_tok, p0, rtok, acc_s,
                                acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2)
        else:
            # the whole blocks by TMA (an empty walk still loads one: row 0, inside the cache),
            # then the partial one
            walk_tile_union_tma(K, V, k0, hk, Q_s, K_s, V_s, full, idx_s, keep_s, n_full, n_tok, p0, rtok, acc_s,
                                acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2,
                                lambda it, blk: T.if_then_else(it < n_full, rows_s[it], 0))
            walk_partial_blocks(K, V, hk, Q_s, K_s, V_s, idx_s, keep_s, n_full, n_it, n_tok, p0, rtok, acc_s,
                                acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2,
                                lambda it, blk: rows_s[it], len_k)
        store_out(acc_o, l_sum, m_cur, O_part, LSE_part, split * total_q + q0 + t0, hk, n_tok, groups,
                  scale_log2)


def _fwd(dtype, D, tma):
    threads = 128
    accum = "float32"
    topk, sig = _fwd_signature(dtype, D)
    del sig["O"], sig["LSE"]
    part_rows = T.dynamic("part_rows")  # splits x total_q
    heads = sig["Q"].shape[1]
    tile_union = _make_tile_union(topk, threads, T_MAX, lone_token_path=True)

    @T.prim_func
    def sparse_decode_fwd(
        Q: sig["Q"], K: sig["K"], V: sig["V"], topk_idx: sig["topk_idx"], cu_seqlens_q: sig["cu_seqlens_q"],
        cu_seqlens_k: sig["cu_seqlens_k"],
        O_part: T.Tensor([part_rows, heads, D], accum),
        LSE_part: T.Tensor([heads, part_rows], accum),
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        scale_log2: T.float32,
        splits: T.int32,
    ):
        with T.Kernel(max_tiles * splits, batch, sig["K"].shape[1], threads=threads) as (bx, b, hk):
            q0, len_q = seq_span(cu_seqlens_q, b, Q.shape[0])
            k0, len_k = seq_span(cu_seqlens_k, b, K.shape[0])
            _split_tile(Q, K, V, topk_idx, O_part, LSE_part, tile_union, bx, b, hk, q0, k0, len_q, len_k, groups,
                        tile_tokens, scale_log2, splits, tma)

    return sparse_decode_fwd


def cache_key_row(block_table, b, t, page_size, pages_per_seq, num_pages):
    """The cache row of key t of sequence b, for a paged cache or a padded one (pages_per_seq 0:
    page b); page numbers are clamped into the cache, so a bad table reads wrong keys, never past
    it. An expression (no statement), for every kernel that reads a KV cache."""
    page = T.if_then_else(pages_per_seq > 0,
                          T.clamp(block_table[b * pages_per_seq + t // page_size], 0, num_pages - 1), b)
    return page * page_size + t % page_size


def _cache_rows(block_table, b, page_size, pages_per_seq, num_pages):
    """The first cache row of block blk of sequence b."""

    def cache_row(blk):
        return cache_key_row(block_table, b, blk * BLOCK_N, page_size, pages_per_seq, num_pages)

    return cache_row


def _kvcache(dtype, D, tma):
    """fwd over a KV cache: each sequence's keys are rows of pages (block_table) or its own rows
    of a padded cache, cache_seqlens[b] of them."""
    threads = 128
    accum = "float32"
    topk, sig = _fwd_signature(dtype, D)
    del sig["O"], sig["LSE"], sig["cu_seqlens_k"]
    part_rows = T.dynamic("part_rows")  # splits x total_q
    table_len = T.dynamic("table_len")
    heads = sig["Q"].shape[1]
    batch_dim = T.dynamic("batch")
    tile_union = _make_tile_union(topk, threads, T_MAX, lone_token_path=True)

    @T.prim_func
    def sparse_decode_kvcache(
        Q: sig["Q"], K: sig["K"], V: sig["V"], topk_idx: sig["topk_idx"], cu_seqlens_q: sig["cu_seqlens_q"],
        block_table: T.Tensor([table_len], "int32"),
        cache_seqlens: T.Tensor([batch_dim], "int32"),
        O_part: T.Tensor([part_rows, heads, D], accum),
        LSE_part: T.Tensor([heads, part_rows], accum),
        max_tiles: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        scale_log2: T.float32,
        splits: T.int32,
        page_size: T.int32,
        pages_per_seq: T.int32,
        num_pages: T.int32,
    ):
        with T.Kernel(max_tiles * splits, batch_dim, sig["K"].shape[1], threads=threads) as (bx, b, hk):
            q0, len_q = seq_span(cu_seqlens_q, b, Q.shape[0])
            # a padded cache (pages_per_seq 0) is one page a sequence; lengths past the
            # sequence's capacity are clamped so that no load leaves its pages
            cap = T.alloc_var("int32")
            cap = page_size * T.max(pages_per_seq, 1)

            _split_tile(Q, K, V, topk_idx, O_part, LSE_part, tile_union, bx, b, hk, q0, 0, len_q,
                        T.max(T.min(cache_seqlens[b], cap), 0), groups, tile_tokens, scale_log2, splits, tma,
                        _cache_rows(block_table, b, page_size, pages_per_seq, num_pages))

    return sparse_decode_kvcache


def _combine(dtype, D):
    accum = "float32"
    threads = COMBINE_ROWS * 32
    per_lane = D // 32
    total_q = T.dynamic("total_q")
    heads = T.dynamic("heads")
    part_rows = T.dynamic("part_rows")
    batch_plus_one = T.dynamic("batch_plus_one")

    @T.prim_func
    def sparse_decode_combine(
        O_part: T.Tensor([part_rows, heads, D], accum),
        LSE_part: T.Tensor([heads, part_rows], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        O: T.Tensor([total_q, heads, D], dtype),
        LSE: T.Tensor([heads, total_q], accum),
        batch: T.int32,
        splits: T.int32,
    ):
        with T.Kernel(T.ceildiv(total_q, COMBINE_ROWS), heads, threads=threads) as (bx, h):
            tx = T.get_thread_binding()
            m = T.alloc_var(accum)
            l = T.alloc_var(accum)
            w = T.alloc_var(accum)
            acc = T.alloc_local([per_lane], accum)
            row = bx * COMBINE_ROWS + tx // 32
            lane = tx % 32
            # rows past the last sequence belong to no query: the forward writes them nowhere
            if row < cu_seqlens_q[batch]:
                m = NEG_INF
                for s in T.serial(splits):
                    m = T.max(m, LSE_part[h, s * total_q + row])
                l = 0
                for e in T.serial(per_lane):
                    acc[e] = 0
                if m != NEG_INF:
                    for s in T.serial(splits):
                        w = T.exp2((LSE_part[h, s * total_q + row] - m) * LOG2E)
                        l += w
                        for e in T.serial(per_lane):
                            acc[e] += w * O_part[s * total_q + row, h, lane * per_lane + e]
                for e in T.serial(per_lane):
                    O[row, h, lane * per_lane + e] = T.cast(T.if_then_else(l > 0, acc[e] / l, 0), dtype)
                if lane == 0:
                    LSE[h, row] = T.if_then_else(l > 0, m + T.log(l), NEG_INF)

    return sparse_decode_combine
