"""Tiles of token x head rows: the GEMM rows of the stage-1 and stage-2 kernels.

A tile holds n_tok consecutive tokens x the G query heads of one KV group, row r = token r // G,
head r % G, BLOCK_M = 64 rows. G is a run-time int, so every row index divides by it: per
16-byte load or per stored element, a 32- and a 64-bit division with floor fix-ups, and a branch
around each access, which leaves one load in flight at a time. These macros branch once on G
instead: G in GROUP_SIZES gets code with G a compile-time constant (shifts and masks, loads with
no condition); any other G keeps the run-time path. Not an op: the op modules share it.
"""

import tilelang.language as T

BLOCK_M = 64
GROUP_SIZES = (16, 8, 4, 2, 1)


def _make_load(g):
    @T.macro
    def load_g(src, dst, row0, hk, n_tok):
        # rows past the tile's tokens repeat its last token: the kernels mask or never read them
        for r, d in T.Parallel(BLOCK_M, dst.shape[1]):
            dst[r, d] = src[row0 + T.min(r // g, n_tok - 1), hk * g + r % g, d]

    return load_g


def _make_store(g):
    @T.macro
    def store_g(src, dst, row0, hk, n_tok, scale):
        for r, d in T.Parallel(BLOCK_M, src.shape[1]):
            if r < n_tok * g:
                dst[row0 + r // g, hk * g + r % g, d] = T.cast(src[r, d] * scale, dst.dtype)

    return store_g


_load_16, _load_8, _load_4, _load_2, _load_1 = (_make_load(g) for g in GROUP_SIZES)
_store_16, _store_8, _store_4, _store_2, _store_1 = (_make_store(g) for g in GROUP_SIZES)


@T.macro
def load_rows(src, dst, row0, hk, n_tok, groups):
    """dst[r, :] = src[row0 + r // groups, hk * groups + r % groups, :] for the n_tok * groups
    rows of the tile (src: (tokens, heads, D) in global memory, dst: (BLOCK_M, D)). The rows past
    them hold the last token's (G in GROUP_SIZES) or zeros (other G)."""
    if groups == 16:
        _load_16(src, dst, row0, hk, n_tok)
    elif groups == 8:
        _load_8(src, dst, row0, hk, n_tok)
    elif groups == 4:
        _load_4(src, dst, row0, hk, n_tok)
    elif groups == 2:
        _load_2(src, dst, row0, hk, n_tok)
    elif groups == 1:
        _load_1(src, dst, row0, hk, n_tok)
    else:
        for r, d in T.Parallel(BLOCK_M, dst.shape[1]):
            dst[r, d] = T.if_then_else(
                r < n_tok * groups, src[row0 + r // groups, hk * groups + r % groups, d], T.cast(0, dst.dtype)
            )


@T.macro
def store_rows(src, dst, row0, hk, n_tok, groups, scale):
    """dst[row0 + r // groups, hk * groups + r % groups, :] = src[r, :] * scale, cast to dst's
    dtype, for the n_tok * groups rows of the tile (src: a (BLOCK_M, D) fragment)."""
    if groups == 16:
        _store_16(src, dst, row0, hk, n_tok, scale)
    elif groups == 8:
        _store_8(src, dst, row0, hk, n_tok, scale)
    elif groups == 4:
        _store_4(src, dst, row0, hk, n_tok, scale)
    elif groups == 2:
        _store_2(src, dst, row0, hk, n_tok, scale)
    elif groups == 1:
        _store_1(src, dst, row0, hk, n_tok, scale)
    else:
        for r, d in T.Parallel(BLOCK_M, src.shape[1]):
            if r < n_tok * groups:
                dst[row0 + r // groups, hk * groups + r % groups, d] = T.cast(src[r, d] * scale, dst.dtype)
