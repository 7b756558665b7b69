"""compress_keys_kvcache: stage 0 kept up to date over a serving KV cache (SPEC.md, Decode: "the
compressed caches C1/C2 grow incrementally as the cache grows").

Decoding with ``compress_keys`` recompresses a sequence's whole cache at every step (121 us of a
128K-key step on an H100, most of it), though a step of one token completes at most one new
compressed key a level. This kernel writes only the compressed keys that the last ``new_keys``
keys of each sequence completed, into a compressed cache the caller keeps across steps:

    L = min(cache_seqlens[b], capacity),   n(x) = (x - window) // stride + 1 if x >= window else 0
    C[b * cap_c + j, h, :] = mean(K[key j*stride .. j*stride + window - 1 of sequence b, h, :])
        for j in [n(max(L - new_keys, 0)), min(n(L), cap_c))

(at most ceil(new_keys / stride) of them). Key t of sequence b is row t % page_size of page
block_table[b * pages_per_seq + t / page_size] (a paged cache) or row t of page b (a padded one,
pages_per_seq 0), as sparse_decode_kvcache reads them; page numbers are clamped into the cache.
Entries outside the range are left as they are. A prefill from an empty cache passes new_keys
= L and writes every entry.

The sums are those of ``compress_keys``: runs of ``part`` = gcd(window, stride) keys summed in
key order, then each row's runs in order (or, where a block's rows need more than MAX_PARTS runs,
each row's keys in order). So wherever both kernels take the same path (always for 32/16, 128/64,
and whenever part is 1) an entry is bitwise the one ``compress_keys`` writes from the same keys
packed, and recomputing an entry gives the same bits.

PHSA (the ``phsa`` variants): each cache row's punctuation flag in ``punct`` (uint8, laid out as
the cache's rows) and the weight ``phsa_lambda``; each entry is summed directly over its window's
keys in key order, plain and punctuation sums and the count, as ``compress_keys``' PHSA kernel
sums them, so an entry is bitwise the one that kernel writes from the same keys and flags packed.
The keys and flags are staged CHUNK rows at a time as in the plain kernel. (Composed in torch
instead, a gather of the windows, ``compress_keys``' PHSA kernel and a masked write-back, the
update took about 30 launches a level and 150-210 us more of a decoding step on an H100.)

Two compressed caches in one launch: with ``levels`` = 2, grid z >= heads_k writes C2 (window2,
stride2) as the rest write C, so that a decoding step updates both of InfLLM-V2's levels (fine keys
and the coarse normaliser keys) in one launch: each update is a chain of dependent loads (length,
page, keys) that a second launch would only repeat after the first (about 7.5 us each on an H100
when an entry completes). With ``levels`` = 1, C2 and its parameters are not read.

Grid: (ceil(max_nc / BLOCK_C), batch, heads_k x levels), max_nc = ceil(new_keys / min_stride),
min_stride the smaller stride of the levels launched.
"""

import tilelang.language as T

from dsl.compress_keys import BLOCK_C, MAX_PARTS, THREADS
from dsl.sparse_decode import cache_key_row

OP = "compress_keys_kvcache"

VARIANTS = [
    {"dtype": dtype, "head_dim": head_dim, "phsa": phsa}
    for phsa in (0, 1)
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
]

CHUNK = 64  # keys staged in shared memory a step

# the block's scalars, held in registers (see select_decode's iv)
LEN, FIRST, ROW0, ROWS, PARTS, CAP, H, LVL, W, S, PART, CAPC = range(12)


def variant_name(dtype, head_dim, phsa):
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{OP}{'_phsa' if phsa else ''}_{short}_d{head_dim}"


def unit_constants(dtype, head_dim, phsa, arch):
    return {"block_c": BLOCK_C}


def program(dtype, head_dim, phsa):
    D = head_dim
    accum = "float32"
    cache_rows = T.dynamic("cache_rows")  # num_pages x page_size
    c_rows = T.dynamic("c_rows")  # batch x cap_c
    c2_rows = T.dynamic("c2_rows")  # batch x cap_c2
    heads_k = T.dynamic("heads_k")
    table_len = T.dynamic("table_len")
    batch = T.dynamic("batch")

    def key(K, block_table, b, t, h, d, page_size, pages_per_seq, num_pages):
        return T.cast(K[cache_key_row(block_table, b, t, page_size, pages_per_seq, num_pages), h, d], accum)

    def windows(n_keys, window, stride):
        """n(n_keys): the compressed keys of n_keys keys (an expression)."""
        return T.if_then_else(n_keys >= window, (n_keys - window) // stride + 1, 0)

    @T.macro
    def locate(iv, b, z, bx, cache_seqlens, new_keys, cap_c, window, stride, cap_c2, window2, stride2, page_size,
               pages_per_seq):
        # level z // heads_k: C (window, stride) or C2 (window2, stride2)
        iv[H] = z % heads_k
        iv[LVL] = z // heads_k
        iv[W] = T.if_then_else(iv[LVL] == 0, window, window2)
        iv[S] = T.if_then_else(iv[LVL] == 0, stride, stride2)
        iv[CAPC] = T.if_then_else(iv[LVL] == 0, cap_c, cap_c2)
        iv[CAP] = page_size * T.max(pages_per_seq, 1)
        iv[LEN] = T.max(T.min(cache_seqlens[b], iv[CAP]), 0)
        # the first entry the new keys completed: n(L - new_keys)
        iv[FIRST] = T.max(iv[LEN] - new_keys, 0)
        iv[FIRST] = windows(iv[FIRST], iv[W], iv[S])
        iv[ROW0] = iv[FIRST] + bx * BLOCK_C
        # rows up to n(L), and within the compressed cache's capacity
        iv[ROWS] = windows(iv[LEN], iv[W], iv[S])
        iv[ROWS] = T.min(T.min(BLOCK_C, iv[ROWS] - iv[ROW0]), iv[CAPC] - iv[ROW0])

    @T.macro
    def stage_keys(K, block_table, b, iv, n_keys, c, rows_s, K_s, page_size, pages_per_seq, num_pages):
        # chunk c of the n_keys keys from key ROW0 * S on, each row's page looked up once (the
        # last chunk repeats the last key)
        for r in T.Parallel(CHUNK):
            rows_s[r] = cache_key_row(block_table, b, T.min(iv[ROW0] * iv[S] + c * CHUNK + r,
                                                            iv[ROW0] * iv[S] + n_keys - 1),
                                      page_size, pages_per_seq, num_pages)
        for r, d in T.Parallel(CHUNK, D):
            K_s[r, d] = K[rows_s[r], iv[H], d]

    @T.prim_func
    def compress_keys_kvcache(
        K: T.Tensor([cache_rows, heads_k, D], dtype),
        block_table: T.Tensor([table_len], "int32"),
        cache_seqlens: T.Tensor([batch], "int32"),
        C: T.Tensor([c_rows, heads_k, D], dtype),
        C2: T.Tensor([c2_rows, heads_k, D], dtype),
        new_keys: T.int32,
        levels: T.int32,
        min_stride: T.int32,
        cap_c: T.int32,
        window: T.int32,
        stride: T.int32,
        part: T.int32,
        cap_c2: T.int32,
        window2: T.int32,
        stride2: T.int32,
        part2: T.int32,
        page_size: T.int32,
        pages_per_seq: T.int32,
        num_pages: T.int32,
    ):
        with T.Kernel(T.ceildiv(T.ceildiv(new_keys, min_stride), BLOCK_C), batch, heads_k * levels,
                      threads=THREADS) as (bx, b, z):
            acc = T.alloc_fragment([BLOCK_C, D], accum)
            S_s = T.alloc_shared([MAX_PARTS, D], accum)
            K_s = T.alloc_shared([CHUNK, D], dtype)
            rows_s = T.alloc_shared([CHUNK], "int32")
            S_l = T.alloc_local([MAX_PARTS], accum)  # the run sums of column tx
            run = T.alloc_local([2], "int32")
            tx = T.get_thread_binding()
            iv = T.alloc_local([12], "int32")
            locate(iv, b, z, bx, cache_seqlens, new_keys, cap_c, window, stride, cap_c2, window2, stride2, page_size,
                   pages_per_seq)
            iv[PART] = T.if_then_else(iv[LVL] == 0, part, part2)
            iv[PARTS] = (iv[ROWS] - 1) * (iv[S] // iv[PART]) + iv[W] // iv[PART]
            T.clear(acc)
            if iv[ROWS] > 0 and iv[PARTS] <= MAX_PARTS:
                # The runs' keys staged CHUNK rows at a time by all threads (each row's page looked
                # up once), then summed in key order from shared memory into each thread's own
                # column of run sums: a decoding step has one row, whose keys, read as the runs
                # layout of compress_keys reads them (a few threads, a chain of dependent table and
                # key loads each), took 0.1 ms, and summed into shared sums (a barrier a key) 15 us.
                if tx < D:
                    for p in T.serial(MAX_PARTS):
                        S_l[p] = 0
                run[0] = 0  # the run and the key within it that the next staged key adds to
                run[1] = 0
                for c in T.serial(T.ceildiv(iv[PARTS] * iv[PART], CHUNK)):
                    stage_keys(K, block_table, b, iv, iv[PARTS] * iv[PART], c, rows_s, K_s, page_size, pages_per_seq,
                               num_pages)
                    T.sync_threads()
                    if tx < D:
                        for t in T.serial(T.min(CHUNK, iv[PARTS] * iv[PART] - c * CHUNK)):
                            S_l[run[0]] += T.cast(K_s[t, tx], accum)
                            run[1] += 1
                            if run[1] == iv[PART]:
                                run[1] = 0
                                run[0] += 1
                    T.sync_threads()
                if tx < D:
                    for p in T.serial(MAX_PARTS):
                        S_s[p, tx] = S_l[p]
                T.sync_threads()
                for q in T.serial(iv[W] // iv[PART]):
                    for i, d in T.Parallel(BLOCK_C, D):
                        if i < iv[ROWS]:
                            acc[i, d] += S_s[i * (iv[S] // iv[PART]) + q, d]
            elif iv[ROWS] > 0:
                for t in T.serial(iv[W]):
                    for i, d in T.Parallel(BLOCK_C, D):
                        if i < iv[ROWS]:
                            acc[i, d] += key(K, block_table, b, (iv[ROW0] + i) * iv[S] + t, iv[H], d, page_size,
                                             pages_per_seq, num_pages)
            if iv[LVL] == 0:
                for i, d in T.Parallel(BLOCK_C, D):
                    if i < iv[ROWS]:
                        C[b * cap_c + iv[ROW0] + i, iv[H], d] = T.cast(acc[i, d] / T.cast(window, accum), dtype)
            else:
                for i, d in T.Parallel(BLOCK_C, D):
                    if i < iv[ROWS]:
                        C2[b * cap_c2 + iv[ROW0] + i, iv[H], d] = T.cast(acc[i, d] / T.cast(window2, accum), dtype)

    @T.prim_func
    def compress_keys_kvcache_phsa(
        K: T.Tensor([cache_rows, heads_k, D], dtype),
        block_table: T.Tensor([table_len], "int32"),
        cache_seqlens: T.Tensor([batch], "int32"),
        punct: T.Tensor([cache_rows], "uint8"),
        C: T.Tensor([c_rows, heads_k, D], dtype),
        C2: T.Tensor([c2_rows, heads_k, D], dtype),
        new_keys: T.int32,
        levels: T.int32,
        min_stride: T.int32,
        cap_c: T.int32,
        window: T.int32,
        stride: T.int32,
        cap_c2: T.int32,
        window2: T.int32,
        stride2: T.int32,
        page_size: T.int32,
        pages_per_seq: T.int32,
        num_pages: T.int32,
        phsa_lambda: T.float32,
    ):
        with T.Kernel(T.ceildiv(T.ceildiv(new_keys, min_stride), BLOCK_C), batch, heads_k * levels,
                      threads=THREADS) as (bx, b, z):
            K_s = T.alloc_shared([CHUNK, D], dtype)
            P_s = T.alloc_shared([CHUNK], "uint8")
            rows_s = T.alloc_shared([CHUNK], "int32")
            # column tx of each row's plain sum, punctuation sum and punctuation count
            acc = T.alloc_local([BLOCK_C], accum)
            acc_p = T.alloc_local([BLOCK_C], accum)
            n_p = T.alloc_local([BLOCK_C], accum)
            tx = T.get_thread_binding()
            iv = T.alloc_local([12], "int32")
            locate(iv, b, z, bx, cache_seqlens, new_keys, cap_c, window, stride, cap_c2, window2, stride2, page_size,
                   pages_per_seq)
            iv[PARTS] = (iv[ROWS] - 1) * iv[S] + iv[W]  # the block's keys, from key ROW0 * S on
            for i in T.unroll(BLOCK_C):
                acc[i] = 0
                acc_p[i] = 0
                n_p[i] = 0
            if iv[ROWS] > 0:
                for c in T.serial(T.ceildiv(iv[PARTS], CHUNK)):
                    stage_keys(K, block_table, b, iv, iv[PARTS], c, rows_s, K_s, page_size, pages_per_seq, num_pages)
                    for r in T.Parallel(CHUNK):
                        P_s[r] = punct[rows_s[r]]
                    T.sync_threads()
                    if tx < D:
                        # row i's keys in this chunk, in key order: chunk c's share of
                        # [i * S, i * S + W)
                        for i in T.unroll(BLOCK_C):
                            if i < iv[ROWS]:
                                lo = T.max(i * iv[S] - c * CHUNK, 0)
                                hi = T.min(T.min(i * iv[S] + iv[W] - c * CHUNK, CHUNK), iv[PARTS] - c * CHUNK)
                                for t in T.serial(T.max(hi - lo, 0)):
                                    x = T.cast(K_s[lo + t, tx], accum)
                                    is_punct = P_s[lo + t] != T.uint8(0)
                                    acc[i] += x
                                    acc_p[i] += T.if_then_else(is_punct, x, T.float32(0))
                                    n_p[i] += T.if_then_else(is_punct, T.float32(1), T.float32(0))
                    T.sync_threads()
                if tx < D:
                    # compress_keys' PHSA expression, term for term
                    for i in T.unroll(BLOCK_C):
                        if i < iv[ROWS]:
                            mean_all = acc[i] / T.cast(iv[W], accum)
                            val = T.cast(
                                T.if_then_else(
                                    n_p[i] > T.float32(0),
                                    phsa_lambda * mean_all
                                    + (T.float32(1) - phsa_lambda) * acc_p[i] / T.max(n_p[i], T.float32(1)),
                                    mean_all,
                                ),
                                dtype,
                            )
                            if iv[LVL] == 0:
                                C[b * cap_c + iv[ROW0] + i, iv[H], tx] = val
                            else:
                                C2[b * cap_c2 + iv[ROW0] + i, iv[H], tx] = val

    return compress_keys_kvcache_phsa if phsa else compress_keys_kvcache
