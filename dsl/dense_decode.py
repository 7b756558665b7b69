"""dense_decode: dense causal attention of few queries a sequence over a KV cache, split-KV.

The decoding step below `dense_len` (and compat's `infllmv2_attn_with_kvcache` without a
selection) attends every cached key. Selecting every block and running sparse_decode_kvcache
does that, but only up to its K_MAX = 128 blocks (8192 keys) a row, and each split first builds a
tile union it does not need. Here each (tile, split) walks a contiguous range of the blocks its
tile sees, as many as the sequence's cache_seqlens gives (read on the device: the caller only
sizes the split count), with sparse_decode's per-block step and its cache-row lookup; the
partial results merge in sparse_decode's combine kernel.

Kernels (one PrimFunc each):
  kvcache  each (tile, split) walks its range of blocks 0 .. ceil((p0 + n_tok) / 64) - 1, the
           blocks the tile's last token sees (p0: the first token's position, bottom-right
           causal against the cache's length), and writes the range's O (normalised, fp32) and
           LSE into the partial buffers at rows split * total_q + token; an empty range writes
           O = 0 and LSE = -inf                          grid (tiles x splits, batch, Hk)
Every sum runs in a fixed order: the result is deterministic.
"""

import tilelang.language as T

from dsl import EXP_NVCC_FLAGS
from dsl.group_rows import load_rows
from dsl.sparse_attn import (BLOCK_M, BLOCK_N, NEG_INF, _fwd_signature, _fwd_state, store_out, walk_partial_blocks,
                             walk_tile_union, walk_tile_union_tma)
from dsl.sparse_decode import T_MAX, _cache_rows

OP = "dense_decode"
NVCC_FLAGS = EXP_NVCC_FLAGS

# A batch-1 call has one tile a KV head: the splits alone fill the GPU, so there are more of
# them than sparse_decode's (whose rows hold at most 128 blocks). The combine loops over them.
MAX_SPLITS = 128
# Cache rows of a split's first ROWS_AHEAD blocks, looked up by all threads before the walk (as
# sparse_decode's kvcache kernel does for its union), so that no table read and division by the
# run-time page size sits between a step's GEMM and its next copies; blocks past them (a split
# of more than 64K keys) are looked up in the walk. Measured level with looking every block up
# in the walk (H200, within 3% either way; benchmarks/NOTES.md, "Session 47").
ROWS_AHEAD = 1024

KERNELS = ("kvcache",)
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
    # the walks are sparse_decode's, built for blocks whose order is known only at run time
    from tilelang import PassConfigKey

    return {PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def unit_constants(kernel, arch, dtype=None, head_dim=None):
    return {"block_m": BLOCK_M, "t_max": T_MAX, "max_splits": MAX_SPLITS}


def program(kernel, arch, dtype, head_dim):
    # sm_90a: TMA loads with the next block in flight, as sparse_decode's (TILELANG.md: a
    # two-stage cp.async pipeline cannot lower a run-time trip count)
    return _kvcache(dtype, head_dim, arch == "sm_90a")


class _Consecutive:
    """Stands in for a union walk's block list: its it-th block is lo + it."""

    def __init__(self, lo):
        self.lo = lo

    def __getitem__(self, it):
        return self.lo + it


class _Every:
    """Stands in for a union walk's token masks: every token of the tile takes every block (the
    causal mask still applies per key)."""

    def __init__(self, mask):
        self.mask = mask

    def __getitem__(self, it):
        return self.mask


def _rows_ahead(rows_s, cache_row):
    """A walk's key_row: the it-th block's cache row from rows_s where it was looked up ahead."""

    def key_row(it, blk):
        return T.if_then_else(it < ROWS_AHEAD, rows_s[T.min(it, ROWS_AHEAD - 1)], cache_row(blk))

    return key_row


@T.macro
def _dense_split_tile(Q, K, V, O_part, LSE_part, bx, hk, q0, len_q, len_k, groups, tile_tokens, scale_log2, splits,
                      tma, cache_row):
    threads = 128
    dtype = Q.dtype
    D = Q.shape[2]
    Q_s = T.alloc_shared([BLOCK_M, D], dtype)
    K_s = T.alloc_shared([BLOCK_N, D], dtype)
    V_s = T.alloc_shared([BLOCK_N, D], dtype)
    rows_s = T.alloc_shared([ROWS_AHEAD], "int32")
    acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum = _fwd_state(dtype, D)
    rtok = T.alloc_fragment([BLOCK_M], "int32")
    full = T.alloc_barrier([threads, threads]) if tma else None  # K_s, V_s landed
    tx = T.get_thread_binding()
    # computed once: as expressions, every use would divide by the run-time splits
    t0 = T.alloc_var("int32")
    split = T.alloc_var("int32")
    n_blk = T.alloc_var("int32")
    n_it = T.alloc_var("int32")
    lo = T.alloc_var("int32")
    n_full = T.alloc_var("int32")
    t0 = (bx // splits) * tile_tokens
    split = bx % splits
    n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
    p0 = len_k - len_q + t0
    total_q = Q.shape[0]

    if n_tok > 0:
        load_rows(Q, Q_s, q0 + t0, hk, n_tok, groups)
        # p0 + n_tok <= len_k, so no block past the cache's keys is walked
        n_blk = T.ceildiv(T.max(p0 + n_tok, 0), BLOCK_N)
        n_it = n_blk // splits + T.if_then_else(split < n_blk % splits, 1, 0)
        lo = split * (n_blk // splits) + T.min(split, n_blk % splits)
        # the cache's partial last block, when this range ends with it, is loaded apart (rows
        # past the keys as zeros: a cache holds whatever the memory held there)
        n_full = n_it - T.if_then_else(
            T.And(n_it > 0, T.And(lo + n_it == n_blk, T.And(len_k % BLOCK_N != 0, n_blk - 1 == len_k // BLOCK_N))),
            1, 0)
        for e in T.serial(T.ceildiv(T.min(n_it, ROWS_AHEAD), threads)):
            i = e * threads + tx
            if i < T.min(n_it, ROWS_AHEAD):
                rows_s[i] = cache_row(lo + i)
        T.sync_threads()
        for r in T.Parallel(BLOCK_M):
            rtok[r] = T.if_then_else(r < n_tok * groups, r // groups, 31)
        T.fill(acc_o, 0)
        T.fill(l_sum, 0)
        T.fill(m_cur, NEG_INF)
        blocks = _Consecutive(lo)
        masks = _Every((1 << n_tok) - 1)
        key_row = _rows_ahead(rows_s, cache_row)
        if not tma:
            walk_tile_union(K, V, 0, hk, Q_s, K_s, V_s, blocks, masks, n_it, n_tok, p0, rtok, acc_s, acc_s_cast,
                            acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, 1, key_row, len_k,
                            n_full)
        else:
            # the whole blocks by TMA (an empty walk still loads one: row 0, inside the cache),
            # then the partial one
            walk_tile_union_tma(K, V, 0, hk, Q_s, K_s, V_s, full, blocks, masks, n_full, n_tok, p0, rtok, acc_s,
                                acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2,
                                lambda it, blk: T.if_then_else(it < n_full, key_row(it, blk), 0))
            walk_partial_blocks(K, V, hk, Q_s, K_s, V_s, blocks, masks, n_full, n_it, n_tok, p0, rtok, acc_s,
                                acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, key_row,
                                len_k)
        store_out(acc_o, l_sum, m_cur, O_part, LSE_part, split * total_q + q0 + t0, hk, n_tok, groups,
                  scale_log2)


def _kvcache(dtype, D, tma):
    threads = 128
    accum = "float32"
    _, sig = _fwd_signature(dtype, D)
    part_rows = T.dynamic("part_rows")  # splits x total_q
    table_len = T.dynamic("table_len")
    heads = sig["Q"].shape[1]
    batch_dim = T.dynamic("batch")

    @T.prim_func
    def dense_decode_kvcache(
        Q: sig["Q"], K: sig["K"], V: sig["V"], cu_seqlens_q: sig["cu_seqlens_q"],
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
            q0 = cu_seqlens_q[b]
            # as sparse_decode_kvcache: a padded cache is a page a sequence, lengths clamped to
            # the capacity so that no load leaves the sequence's pages
            cap = T.alloc_var("int32")
            cap = page_size * T.max(pages_per_seq, 1)
            _dense_split_tile(Q, K, V, O_part, LSE_part, bx, hk, q0, cu_seqlens_q[b + 1] - q0,
                              T.max(T.min(cache_seqlens[b], cap), 0), groups, tile_tokens, scale_log2, splits, tma,
                              _cache_rows(block_table, b, page_size, pages_per_seq, num_pages))

    return dense_decode_kvcache
