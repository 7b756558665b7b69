"""sparse_attn: stage 2 of InfLLM-V2, block-sparse attention over selected 64-token blocks.

For the query at position p of a sequence and query head h of KV group g = h // G:

    O[p, h]   = sum_t softmax_t(scale * q[p, h] . k[t, g]) v[t, g]
    LSE[h, p] = log sum_t exp(scale * q[p, h] . k[t, g])          (natural log, fp32)

over keys t with t // 64 in topk_idx[g, p, :] and t <= p (bottom-right causal alignment,
p = Lk - Lq + i for the i-th of Lq queries); an empty set gives O = 0, LSE = -inf.

Tiling. A query tile is T consecutive tokens x the G heads of one KV group: BLOCK_M = 64 GEMM
rows, row r = token r // G, head r % G, so small groups need no padding to 16 heads (T =
min(64 // G, T_MAX) tokens; G and T are run-time ints, one kernel serves every group size
up to 64). The tile iterates over the UNION of its tokens' selected blocks, so a K/V block
that several tokens picked (the local window, and most of the rest for adjacent tokens) is
loaded and multiplied once for all of them; each (row, block) is masked by whether the row's
token picked the block. The union is built in the prologue from the sorted selection rows:
each token sets its bit for its blocks in a shared bitmap, entry (t, k) is kept if no earlier
token's bit is set for its block, with the mask of the tokens that picked it; a prefix sum
compacts the kept entries.

Kernels (one PrimFunc each):
  fwd             O, LSE                                  grid (tiles, batch, Hk)
                  (sm_90a, G >= 16: pairs of 4-token tiles as 2-block clusters, _fwd_pair)
  bwd_preprocess  Delta[h, p] = dO[p, h] . O[p, h]        grid (ceil(total_q / 64), Hq)
                  Stats[p, h] = (LSE[h, p] log2(e), Delta[h, p])
  bwd_dq          dQ, tiles and union as fwd (sm_90a also  grid (tiles, batch, Hk)
                  has a unit of 4-token tiles for G >= 16; there the next block's K and V
                  load by TMA while the current one is computed, see _bwd_dq)
  bwd_members     the inverse index of the selections:     grid (CHUNKS x windows, Hk, batch)
                  each key block's member queries,
                  ascending (counted with fill = 0, written with fill = 1)
  bwd_members_scan  counts -> list offsets                grid (Hk)
  bwd_dkdv        dK, dV per 64-key block, over the       grid (key blocks, Hk, batch)
                  queries in its member list, BM // G at a time (BM = 64 rows), so rows of
                  tokens that did not pick the block cost no work; the next group's
                  rows load by cp.async while the current one is computed (sm_90a; its unit
                  for G = 16 loads them as TMA boxes of one token's 16 heads instead); the
                  first SPLIT_BLOCKS blocks of long sequences in pieces of PIECE queries
  bwd_dkdv_reduce dK, dV of those blocks, their pieces'   grid (SPLIT_BLOCKS, Hk, batch)
                  fp32 partials summed in piece order
Every gradient is summed in a fixed order, by one thread block or from fixed pieces: the
backward is deterministic, with no atomics.

Selection rows must be sorted ascending over their valid entries with -1 padding last (the
format select_blocks writes; the torch layer sorts other inputs). Entries < 0 or beyond the
token's own block are ignored.
"""

import math

import tilelang.language as T

from dsl import EXP_NVCC_FLAGS
from dsl.group_rows import load_rows, store_rows
from dsl.spans import seq_span

OP = "sparse_attn"
NVCC_FLAGS = EXP_NVCC_FLAGS

BLOCK_N = 64  # keys per selected block (the InfLLM-V2 block size)
BLOCK_M = 64  # GEMM rows per query tile: T tokens x G heads
T_MAX_BY_ARCH = {"sm_90a": 16}  # tokens per query tile at most (G < 64 // T_MAX leaves rows idle);
T_MAX_DEFAULT = 8  # 8 elsewhere, so the union buffers fit 99 KB of shared memory with the tiles
K_MAX = 128  # selected blocks per token at most
CHUNKS = 64  # bwd_members: slices of a sequence's queries counted apart (so the counts are linear in keys)
WINDOW = 4096  # bwd_members: key blocks a thread block counts (16 KB of shared memory)
ROT_ROWS = 2048  # bwd_dkdv visits a key block's members from one in a packed row that is a multiple of this
# bwd_dkdv: the first SPLIT_BLOCKS key blocks of a sequence of more than PIECE queries (the init
# blocks every query picks) are shared among one thread block per PIECE packed query rows
# (see _bwd_dkdv); bwd_dkdv_reduce sums their fp32 partial dK/dV.
SPLIT_BLOCKS = 4
PIECE = 8192
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")
POS_INF = float("inf")

KERNELS = ("fwd", "bwd_preprocess", "bwd_dq", "bwd_members", "bwd_members_scan", "bwd_dkdv", "bwd_dkdv_reduce")
# fwd and bwd_dq come with a cap on their tiles' tokens; sm_90a also builds a 4-token unit of
# each, for G >= 16: the forward's runs two tiles as a thread-block cluster (see _fwd_pair), dQ's
# fits three tiles an SM (see _bwd_dq). The host takes, of an arch's units, the one with the
# largest min_groups that the call's G reaches (unit_constants).
SMALL_TOKENS = 4
TILED = ("fwd", "bwd_dq")
# bwd_dkdv has a unit for every G ("boxes": 0, its rows a gather) and, on sm_90a, one for G =
# DKDV_BOXES (MiniCPM4's group) whose rows load as TMA boxes of one token's heads (see
# _bwd_dkdv's load_tile); the host takes that one where G equals its "boxes".
DKDV_BOXES = 16
VARIANTS = [
    {"kernel": kernel, "dtype": dtype, "head_dim": head_dim}
    for kernel in KERNELS
    if kernel not in TILED and kernel not in ("bwd_dkdv", "bwd_members", "bwd_members_scan")
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
] + [
    {"kernel": "bwd_dkdv", "dtype": dtype, "head_dim": head_dim, "boxes": boxes}
    for boxes in (0, DKDV_BOXES)
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
] + [
    {"kernel": kernel, "dtype": dtype, "head_dim": head_dim, "tokens": tokens}
    for kernel in TILED
    for tokens in sorted({SMALL_TOKENS, T_MAX_DEFAULT, *T_MAX_BY_ARCH.values()})
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
] + [{"kernel": "bwd_members"}, {"kernel": "bwd_members_scan"}]  # read only selections: one unit an arch


def _tile_tokens(arch):
    """The token caps of the fwd and bwd_dq units built for arch."""
    return (SMALL_TOKENS, tile_tokens_max(arch)) if arch == "sm_90a" else (tile_tokens_max(arch),)


def _is_pair(kernel, arch, tokens):
    """Whether the unit runs two query tiles as a thread-block cluster (sm_90a's small forward)."""
    return kernel == "fwd" and arch == "sm_90a" and tokens == SMALL_TOKENS


def builds(kernel, arch, dtype=None, head_dim=None, tokens=None, boxes=0):
    """Whether the build step lowers this variant for arch."""
    return (kernel not in TILED or tokens in _tile_tokens(arch)) and (not boxes or arch == "sm_90a")


def pass_configs(kernel, arch, dtype=None, head_dim=None, tokens=None, boxes=0):
    # Warp specialisation on sm_90a launches an extra producer warpgroup, but TileLang still
    # assumes threadIdx.x < threads when it simplifies the index arithmetic of the per-thread
    # (SIMT) union prologue, which then races (seen on an H100: wrong rows, non-determinism).
    from tilelang import PassConfigKey

    if kernel in ("fwd", "bwd_dq"):
        return {PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}
    if kernel in ("bwd_members", "bwd_members_scan"):
        # their barriers are placed by hand: the planner added two more to every row step of
        # bwd_members, between a counter's read and its write by the same thread
        return {PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
    if kernel == "bwd_dkdv" and _prefetch(arch):
        # its group loop's barriers are placed by hand, one a step: the planner added two to
        # three more (before the next group's copies and after their commit)
        return {PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
    return {}


def tile_tokens_max(arch):
    return T_MAX_BY_ARCH.get(arch, T_MAX_DEFAULT)


def unit_constants(kernel, arch, dtype=None, head_dim=None, tokens=None, boxes=0):
    """What the host wrapper needs to size the grid: T = min(block_m // G, t_max) tokens a tile
    (for bwd_dkdv, tokens a group of member rows: block_m // G, uncapped, and how its first key
    blocks are split); for fwd and bwd_dq also the smallest group size the unit is meant for (a
    small unit would leave rows idle below it) and how many tiles run as one cluster (the grid is
    rounded up to whole clusters)."""
    if kernel in TILED:
        small = tokens < tile_tokens_max(arch)
        return {"block_m": BLOCK_M, "t_max": tokens, "min_groups": BLOCK_M // tokens if small else 1,
                "cluster": 2 if _is_pair(kernel, arch, tokens) else 1}
    if kernel == "bwd_dkdv":
        return {"block_m": BLOCK_M, "t_max": BLOCK_M, "split_blocks": SPLIT_BLOCKS, "piece": PIECE}
    if kernel == "bwd_members":
        return {"chunks": CHUNKS, "window": WINDOW}
    if kernel == "bwd_members_scan":
        return {"chunks": CHUNKS}
    return {"block_m": BLOCK_M, "t_max": tile_tokens_max(arch)}


def variant_name(kernel, dtype=None, head_dim=None, tokens=None, boxes=0):
    if dtype is None:
        return f"{OP}_{kernel}"
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    pair = "x2" if kernel == "fwd" and tokens == SMALL_TOKENS else ""  # two tiles a cluster (_fwd_pair)
    boxed = f"_g{boxes}" if boxes else ""  # bwd_dkdv's unit for G = boxes
    return f"{OP}_{kernel}_{short}_d{head_dim}" + (f"_t{tokens}{pair}" if tokens else "") + boxed


def _stages(arch):
    # TileLang 0.1.15 cannot software-pipeline a loop with a run-time trip count without warp
    # specialisation (codegen aborts: "Downcast from tirx.Sub to ir.IntImm"), and the union
    # prologue rules warp specialisation out (see pass_configs): T.Pipelined does not overlap
    # the block loop's loads with its work. On sm_90a the forward and dQ walks overlap them by
    # hand instead (TMA and mbarriers: _fwd_pair, walk_tile_union_tma, _bwd_dq's dq_block).
    return 1


def _prefetch(arch):
    # bwd_dkdv loads the next member query tile by cp.async into a second buffer while the
    # current one is computed. sm_80 code also runs on sm_86 parts, which like sm_89 have 99 KB
    # of shared memory per block, too little for the second buffers: one buffer there, loaded
    # and waited for in turn.
    return arch.startswith("sm_90")


VEC = 8  # elements per 16-byte cp.async (2-byte dtypes)


def program(kernel, arch, dtype=None, head_dim=None, tokens=None, boxes=0):
    if kernel == "bwd_members":
        return _bwd_members()
    if kernel == "bwd_members_scan":
        return _bwd_members_scan()
    if kernel == "bwd_dkdv":
        return _bwd_dkdv(dtype, head_dim, arch, boxes)
    if kernel == "bwd_dq":
        return _bwd_dq(dtype, head_dim, arch, tokens)
    if kernel == "fwd":
        return _fwd_pair(dtype, head_dim) if _is_pair(kernel, arch, tokens) else _fwd(dtype, head_dim, arch, tokens)
    return {
        "bwd_preprocess": _bwd_preprocess,
        "bwd_dkdv_reduce": _bwd_dkdv_reduce,
    }[kernel](dtype, head_dim, arch)


UW = 2048  # blocks per window of the tile union's bitmap (8 KB of shared memory)


def _bitmap_windows(qblk0, n_tok, uw):
    """How many windows of uw blocks the tile union's bitmap takes for a tile's visible blocks."""
    return T.ceildiv((qblk0 + n_tok - 1) // BLOCK_N + 1, uw)


def _make_tile_union(topk, threads, T_MAX, lone_token_path=False, pack=1):
    """A macro: the union of the selected blocks of tokens t0 .. t0+n_tok-1 of a tile.

    Writes ublk_s[0 .. n) (the blocks, in the order of the entries that first list them) and
    umask_s (bit t set if token t picked the block) and returns nothing; n is left in
    n_union[0]. Entries < 0, beyond the token's own block, or repeated in a row are dropped.

    Each token sets its bit for each block it picked in a shared bitmap (bm_s, one int per
    block, uw blocks at a time), so finding who else picked a block is one read. (A binary
    search per entry in every other token's row cost T^2 K log K steps a tile: measured on an
    H100 at 32K x 8, 11.6 of the forward's 51.3 ms at G = 16 and 46.3 of 86.5 ms at G = 4,
    whose tiles have 16 tokens.)

    ``lone_token_path`` (decoding's tiles, mostly of one token): a tile of one token skips the
    bitmap (its row is the union, every kept entry its own), and the scatter visits only the
    entries of the tile's tokens. Both loops hold block barriers that TileLang's planner puts in
    every iteration; a decoding split spends microseconds in them.

    ``pack`` blocks share one int of bm_s, T_MAX bits each (pack * T_MAX <= 32), so bm_s holds
    UW // pack ints. A window is a pass of seven block barriers and the union needs one per UW
    blocks up to the tile's own, so with a small bitmap the work a tile grows with the sequence:
    dQ's 4-token unit, with 256 blocks in its 1 KB, took 8 passes at 128K keys (2 at 32K). (On
    an H200 dropping them to 1 changed dQ's time by nothing measurable up to 128K keys.)"""
    TK = T_MAX * K_MAX
    uw = UW
    assert pack * T_MAX <= 32 and uw % (pack * threads) == 0
    mask_bits = (1 << T_MAX) - 1

    # pack == 1 keeps one plain int a block (the expressions, and so every other unit's
    # generated text, as before)
    def bm_add(bm_s, slot, bit):
        # distinct tokens' bits never carry into the next block's field (a token lists a block
        # once); pack * T_MAX = 32 sets bit 31, a defined shift in C++14 and later
        if pack == 1:
            return T.atomic_add(bm_s[slot], bit)
        return T.atomic_add(bm_s[slot // pack], bit << (T_MAX * (slot % pack)))

    def bm_get(bm_s, slot):
        if pack == 1:
            return bm_s[slot]
        return (bm_s[slot // pack] >> (T_MAX * (slot % pack))) & mask_bits

    @T.macro
    def tile_union(topk_idx, hk, row0, n_tok, qblk0, tx, idx_s, keep_s, ublk_s, umask_s, n_union, my_keep, my_mask,
                   bm_s):
        # The per-entry loops index by thread: kernels using this run without warp
        # specialisation (see pass_configs), so exactly `threads` threads execute them.
        if tx < threads:
            for e in T.serial(TK // threads):
                i = e * threads + tx
                idx_s[i] = T.if_then_else(
                    i // K_MAX < n_tok and i % K_MAX < topk, topk_idx[hk, row0 + i // K_MAX, i % K_MAX], -1
                )
        T.sync_threads()
        if tx < threads:
            for e in T.serial(TK // threads):
                i = e * threads + tx
                v = idx_s[i]
                my_mask[e] = T.if_then_else(n_tok == 1, 1, 0) if lone_token_path else 0
                # rows ascend, so a repeat sits right after its first copy
                my_keep[e] = T.if_then_else(
                    v >= 0 and v <= (qblk0 + i // K_MAX) // BLOCK_N and (i % K_MAX == 0 or idx_s[i - 1] != v), 1, 0
                )
        for w in T.serial(T.if_then_else(n_tok == 1, 0, _bitmap_windows(qblk0, n_tok, uw)) if lone_token_path
                          else _bitmap_windows(qblk0, n_tok, uw)):
            if tx < threads:
                for e in T.serial(uw // pack // threads):
                    bm_s[e * threads + tx] = 0
            T.sync_threads()
            if tx < threads:
                for e in T.serial(TK // threads):
                    i = e * threads + tx
                    if my_keep[e] == 1 and idx_s[i] // uw == w:
                        # an add sets the bit: a token lists a block once (repeats are dropped).
                        # (TileLang 0.1.15's atomic_or emits red.global, wrong on shared memory.)
                        bm_add(bm_s, idx_s[i] - w * uw, 1 << (i // K_MAX))
            T.sync_threads()
            if tx < threads:
                for e in T.serial(TK // threads):
                    i = e * threads + tx
                    if my_keep[e] == 1 and idx_s[i] // uw == w:
                        my_mask[e] = bm_get(bm_s, idx_s[i] - w * uw)
            T.sync_threads()
        if tx < threads:
            for e in T.serial(TK // threads):
                i = e * threads + tx
                # the block is listed by the first token that picked it (the lowest bit)
                keep_s[i] = T.if_then_else(
                    my_keep[e] == 1 and (my_mask[e] & ((1 << (i // K_MAX)) - 1)) == 0, 1, 0
                )
        T.sync_threads()
        T.cumsum(src=keep_s, dst=keep_s, dim=0)
        T.sync_threads()
        if tx < threads:
            for e in T.serial(T.ceildiv(n_tok * K_MAX, threads) if lone_token_path else TK // threads):
                i = e * threads + tx
                if keep_s[i] > T.if_then_else(i > 0, keep_s[i - 1], 0):
                    ublk_s[keep_s[i] - 1] = idx_s[i]
                    umask_s[keep_s[i] - 1] = my_mask[e]
        if tx == 0:
            n_union[0] = keep_s[TK - 1]
        T.sync_threads()

    return tile_union


def _tile_sees_block(blk, p0):
    """Whether every token of a tile (the first at position p0) sees all of block blk."""
    return (blk + 1) * BLOCK_N <= p0 + 1


def _whole_block(umask, n_tok, blk, p0):
    """Whether every token of a tile (the first at position p0) picked block blk and sees all of
    it: such blocks (most of a tile's union when neighbouring tokens' selections agree) skip the
    per-element mask. Rows past the tile's tokens then get unmasked scores, confined to rows
    that are never written. (T.And: outside a prim_func body Python's `and` would drop a term.)"""
    return T.And(umask == (1 << n_tok) - 1, _tile_sees_block(blk, p0))


def _dyn():
    return dict(
        total_q=T.dynamic("total_q"),
        total_k=T.dynamic("total_k"),
        heads=T.dynamic("heads"),
        heads_k=T.dynamic("heads_k"),
        topk=T.dynamic("topk"),
        batch_plus_one=T.dynamic("batch_plus_one"),
    )


@T.macro
def mask_scores(acc_s, um, n_tok, blk, p0, rtok):
    """acc_s = 0 where row r's token (rtok[r], bit of um) picked block blk and sees key c, else
    -inf; a block every token picked and sees whole needs no mask."""
    if _whole_block(um, n_tok, blk, p0):
        T.clear(acc_s)
    else:
        for r, c in T.Parallel(acc_s.shape[0], acc_s.shape[1]):
            # rows past the tile's tokens have rtok 31, a token bit no mask sets (T <= 16)
            acc_s[r, c] = T.if_then_else(((um >> rtok[r]) & 1) == 1 and blk * BLOCK_N + c <= p0 + rtok[r], 0, NEG_INF)


@T.macro
def softmax_step(acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2):
    """The online softmax between the two GEMMs of a block: acc_s (masked scores) becomes the
    block's probabilities in acc_s_cast, and acc_o and the row statistics are rescaled."""
    T.copy(m_cur, m_prev)
    T.reduce_max(acc_s, m_cur, dim=1, clear=False)
    for r in T.Parallel(acc_s.shape[0]):
        # rows with nothing visible yet stay at -inf; offset by 0 to avoid inf - inf
        m_safe[r] = T.if_then_else(m_cur[r] == NEG_INF, 0, m_cur[r])
        r_scale[r] = T.exp2((m_prev[r] - m_safe[r]) * scale_log2)
    for r, c in T.Parallel(acc_s.shape[0], acc_s.shape[1]):
        acc_s[r, c] = T.exp2((acc_s[r, c] - m_safe[r]) * scale_log2)
    T.reduce_sum(acc_s, r_sum, dim=1)
    for r in T.Parallel(acc_s.shape[0]):
        l_sum[r] = l_sum[r] * r_scale[r] + r_sum[r]
    T.copy(acc_s, acc_s_cast)
    for r, d in T.Parallel(acc_o.shape[0], acc_o.shape[1]):
        acc_o[r, d] *= r_scale[r]


@T.macro
def store_out(acc_o, l_sum, m_cur, O, LSE, row0, hk, n_tok, groups, scale_log2):
    """O and LSE of the tile's n_tok tokens; a row that saw no key gets O = 0, LSE = -inf."""
    for r, d in T.Parallel(acc_o.shape[0], acc_o.shape[1]):
        acc_o[r, d] = T.if_then_else(l_sum[r] > 0, acc_o[r, d] / l_sum[r], 0)
    store_rows(acc_o, O, row0, hk, n_tok, groups, 1.0)
    for r in T.Parallel(acc_o.shape[0]):
        if r < n_tok * groups:
            LSE[hk * groups + r % groups, row0 + r // groups] = T.if_then_else(
                l_sum[r] > 0, (m_cur[r] * scale_log2 + T.log2(l_sum[r])) * LN2, NEG_INF
            )


def _fwd_state(dtype, D):
    """The forward's per-tile fragments: scores, probabilities, output and row statistics."""
    accum = "float32"
    return (
        T.alloc_fragment([BLOCK_M, BLOCK_N], accum),  # acc_s
        T.alloc_fragment([BLOCK_M, BLOCK_N], dtype),  # acc_s_cast
        T.alloc_fragment([BLOCK_M, D], accum),  # acc_o
        *(T.alloc_fragment([BLOCK_M], accum) for _ in range(6)),  # m_prev m_cur m_safe r_scale r_sum l_sum
    )


def _union_buffers(T_MAX, threads):
    """The shared and local buffers of _make_tile_union's macro for tiles of T_MAX tokens."""
    TK = T_MAX * K_MAX
    return (
        *(T.alloc_shared([TK], "int32") for _ in range(4)),  # idx_s keep_s ublk_s umask_s
        T.alloc_shared([1], "int32"),  # n_union
        *(T.alloc_local([TK // threads], "int32") for _ in range(2)),  # my_keep my_mask
        T.alloc_shared([UW], "int32"),  # bm_s
    )


@T.macro
def block_step(Q_s, K_s, V_s, um, blk, n_tok, p0, rtok, acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum,
               l_sum, scale_log2):
    """The forward's work on one loaded K/V block: masked scores, online softmax, P V."""
    mask_scores(acc_s, um, n_tok, blk, p0, rtok)
    T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
    softmax_step(acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2)
    T.gemm(acc_s_cast, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)


@T.macro
def walk_tile_union(K, V, k0, hk, Q_s, K_s, V_s, ublk_s, umask_s, n_it, n_tok, p0, rtok, acc_s, acc_s_cast, acc_o,
                    m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, stages, key_row=None, len_k=None,
                    n_full=None):
    """The forward of one tile over its union's n_it blocks, each K and V block loaded by the
    tile itself (_fwd, and _fwd_pair's tiles that walk alone). ``key_row(it, blk)``, the row of K
    and V holding the first key of block blk (the it-th walked), is ``k0 + blk * BLOCK_N`` unless
    given (a paged cache).
    With ``len_k`` (a cache), only the first ``n_full`` blocks are whole: the one after them, if
    any, is the sequence's last block, whose rows past its keys load as zeros. In a cache they
    hold whatever the memory held (NaN too), and a masked score or probability times NaN is NaN;
    packed sequences need none of this (rows past one are the next one's keys). The whole blocks
    keep the pipelined copies, which a conditional load would serialise."""
    for it in T.Pipelined(n_it if n_full is None else n_full, num_stages=stages):
        blk = ublk_s[it]
        r0 = k0 + blk * BLOCK_N if key_row is None else key_row(it, blk)
        T.copy(K[r0 : r0 + BLOCK_N, hk, :], K_s)
        T.copy(V[r0 : r0 + BLOCK_N, hk, :], V_s)
        block_step(Q_s, K_s, V_s, umask_s[it], blk, n_tok, p0, rtok, acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe,
                   r_scale, r_sum, l_sum, scale_log2)
    if len_k is not None:
        walk_partial_blocks(K, V, hk, Q_s, K_s, V_s, ublk_s, umask_s, n_full, n_it, n_tok, p0, rtok, acc_s, acc_s_cast,
                            acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, key_row, len_k)


@T.macro
def walk_partial_blocks(K, V, hk, Q_s, K_s, V_s, ublk_s, umask_s, n_full, n_it, n_tok, p0, rtok, acc_s, acc_s_cast,
                        acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, key_row, len_k):
    """Blocks n_full .. n_it - 1 of a walk over a cache, whose rows past len_k load as zeros
    (walk_tile_union's ``len_k``): conditional loads, no pipeline."""
    for it in T.serial(n_full, n_it):
        blk = ublk_s[it]
        r0 = key_row(it, blk)
        for r, d in T.Parallel(BLOCK_N, K_s.shape[1]):
            K_s[r, d] = T.if_then_else(blk * BLOCK_N + r < len_k, K[r0 + r, hk, d], T.cast(0, K_s.dtype))
        for r, d in T.Parallel(BLOCK_N, V_s.shape[1]):
            V_s[r, d] = T.if_then_else(blk * BLOCK_N + r < len_k, V[r0 + r, hk, d], T.cast(0, V_s.dtype))
        block_step(Q_s, K_s, V_s, umask_s[it], blk, n_tok, p0, rtok, acc_s, acc_s_cast, acc_o, m_prev, m_cur,
                   m_safe, r_scale, r_sum, l_sum, scale_log2)


@T.macro
def load_first_kv(K, V, k0, hk, ublk_s, n_it, K_s, V_s, full, cluster_mask=None, key_row=None):
    """The TMA loads of a union walk's first K and V blocks onto full[0], full[1] (an empty
    union still loads, and waits for, one block: the sequence's first); cluster_mask multicasts
    them to a cluster pair. ``key_row`` as in walk_tile_union."""
    first = T.if_then_else(n_it > 0, ublk_s[0], 0)
    r0 = k0 + first * BLOCK_N if key_row is None else key_row(0, first)
    T.tma_copy(K[r0 : r0 + BLOCK_N, hk, :], K_s, barrier=full[0], cluster_mask=cluster_mask)
    T.mbarrier_arrive(full[0])
    T.tma_copy(V[r0 : r0 + BLOCK_N, hk, :], V_s, barrier=full[1], cluster_mask=cluster_mask)
    T.mbarrier_arrive(full[1])


@T.macro
def walk_tile_union_tma(K, V, k0, hk, Q_r, K_s, V_s, full, ublk_s, umask_s, n_it, n_tok, p0, rtok, acc_s, acc_s_cast,
                        acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, key_row=None):
    """walk_tile_union on sm_90a with its own TMA loads (_fwd_pair's tiles that walk alone; the
    query tile in registers, Q_r, as in the pair's shared walk): K is
    free once S is computed and V once P V is, so the next block's K loads during this block's
    softmax and P V, and its V during the next S GEMM, into the same two buffers (full[0] and
    full[1]: K_s's, V_s's load landed; fresh, phase 0). The copies are issued on every step with
    a clamped index, as in _fwd_pair's shared walk; the last one's phase is waited for after
    the loop. ``key_row`` as in walk_tile_union, for whole blocks only (a cache's partial last
    block goes through walk_partial_blocks after this walk)."""
    load_first_kv(K, V, k0, hk, ublk_s, n_it, K_s, V_s, full, key_row=key_row)
    for it in T.serial(n_it):
        blk = ublk_s[it]
        nxt = ublk_s[T.min(it + 1, n_it - 1)]
        r_nxt = k0 + nxt * BLOCK_N if key_row is None else key_row(T.min(it + 1, n_it - 1), nxt)
        mask_scores(acc_s, umask_s[it], n_tok, blk, p0, rtok)
        T.mbarrier_wait_parity(full[0], it % 2)
        T.gemm(Q_r, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        T.sync_threads()  # every warp's part of S has read K_s
        T.tma_copy(K[r_nxt : r_nxt + BLOCK_N, hk, :], K_s, barrier=full[0])
        T.mbarrier_arrive(full[0])
        softmax_step(acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2)
        T.mbarrier_wait_parity(full[1], it % 2)
        T.gemm(acc_s_cast, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
        T.sync_threads()  # every warp's part of P V has read V_s
        T.tma_copy(V[r_nxt : r_nxt + BLOCK_N, hk, :], V_s, barrier=full[1])
        T.mbarrier_arrive(full[1])
    T.mbarrier_wait_parity(full[0], n_it % 2)
    T.mbarrier_wait_parity(full[1], n_it % 2)


def _fwd_signature(dtype, D):
    accum = "float32"
    dyn = _dyn()
    total_q, total_k, heads, heads_k, topk, batch_plus_one = (
        dyn["total_q"], dyn["total_k"], dyn["heads"], dyn["heads_k"], dyn["topk"], dyn["batch_plus_one"])
    return topk, dict(
        Q=T.Tensor([total_q, heads, D], dtype),
        K=T.Tensor([total_k, heads_k, D], dtype),
        V=T.Tensor([total_k, heads_k, D], dtype),
        topk_idx=T.Tensor([heads_k, total_q, topk], "int32"),
        cu_seqlens_q=T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k=T.Tensor([batch_plus_one], "int32"),
        O=T.Tensor([total_q, heads, D], dtype),
        LSE=T.Tensor([heads, total_q], accum),
    )


def _fwd(dtype, D, arch, tokens):
    T_MAX = tokens
    threads = 128
    topk, sig = _fwd_signature(dtype, D)
    tile_union = _make_tile_union(topk, threads, T_MAX)

    @T.prim_func
    def sparse_attn_fwd(
        Q: sig["Q"], K: sig["K"], V: sig["V"], topk_idx: sig["topk_idx"], cu_seqlens_q: sig["cu_seqlens_q"],
        cu_seqlens_k: sig["cu_seqlens_k"], O: sig["O"], LSE: sig["LSE"],
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles, batch, sig["K"].shape[1], threads=threads) as (bx, b, hk):
            Q_s = T.alloc_shared([BLOCK_M, D], dtype)
            K_s = T.alloc_shared([BLOCK_N, D], dtype)
            V_s = T.alloc_shared([BLOCK_N, D], dtype)
            idx_s, keep_s, ublk_s, umask_s, n_union, my_keep, my_mask, bm_s = _union_buffers(T_MAX, threads)
            n_it = T.alloc_var("int32")
            acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum = _fwd_state(dtype, D)
            # each row's token, computed once: in the mask it would be a run-time division by G
            # per element and block
            rtok = T.alloc_fragment([BLOCK_M], "int32")

            tx = T.get_thread_binding()
            q0, len_q = seq_span(cu_seqlens_q, b, Q.shape[0])
            k0, len_k = seq_span(cu_seqlens_k, b, K.shape[0])
            t0 = bx * tile_tokens
            n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
            p0 = len_k - len_q + t0  # position of the tile's first token

            if n_tok > 0:
                load_rows(Q, Q_s, q0 + t0, hk, n_tok, groups)
                tile_union(topk_idx, hk, q0 + t0, n_tok, p0, tx, idx_s, keep_s, ublk_s, umask_s,
                           n_union, my_keep, my_mask, bm_s)
                n_it = n_union[0]
                for r in T.Parallel(BLOCK_M):
                    rtok[r] = T.if_then_else(r < n_tok * groups, r // groups, 31)
                T.fill(acc_o, 0)
                T.fill(l_sum, 0)
                T.fill(m_cur, NEG_INF)
                # (walk_tile_union_tma here would cost the SM its third tile: TMA-written buffers
                # share no memory with the union's, 88 KB a tile. H200, 32K x 8, G = 4, kernel
                # alone: 48.7 ms against 43.6.)
                walk_tile_union(K, V, k0, hk, Q_s, K_s, V_s, ublk_s, umask_s, n_it, n_tok, p0, rtok, acc_s, acc_s_cast,
                                acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum, scale_log2, _stages(arch))
                store_out(acc_o, l_sum, m_cur, O, LSE, q0 + t0, hk, n_tok, groups, scale_log2)

    return sparse_attn_fwd


def _fwd_pair(dtype, D):
    """The forward on sm_90a for G >= 16: two adjacent 4-token tiles run as a cluster of two
    thread blocks and walk the union of both tiles' selections together.

    The forward is bound by reading K/V blocks from L2 (Nsight Compute on an H100: L2 throughput
    at 73% of peak, 98% hits): the 16 tiles of a 64-token query block read nearly the same
    blocks. Here the lower-ranked block of the pair loads each K and V block once by TMA and
    multicasts it into both blocks' shared memory, halving those reads. Four barriers keep the
    pair in step: `full` (each block's own: its K or V has landed; every thread arrives, the TMA
    bytes complete the phase) and `empty` (the rank-0 copy of a cluster barrier: every warp of
    both blocks is done with the current K or V, so the next may overwrite it). The next
    block's K loads during this block's softmax and its V during the next S GEMM. 128-row tiles
    (two warpgroups) would halve the reads too, but lost more in latency hiding (H100, 32K x 8:
    51.6 ms against 44.7); the pair keeps 4-token tiles, 74 KB a tile, three tiles an SM.

    The query tile is the A operand of the S GEMM from registers (Q_r, read once from Q_s), not
    from shared memory: a 64 x 64 x 128 wgmma with both operands in shared memory reads 32 KB
    of it for 1 MFLOP, and every block step also takes the TMA's 32 KB of K and V. ptxas, held
    to 168 registers for three tiles an SM, then spills 12 bytes (68 bytes of reloads). H200,
    32K x 8 and 128K x 2, forward alone, O and LSE bitwise equal: 40.97, 40.98 ->
    40.11, 40.31 ms and 43.46, 43.79 -> 42.58, 42.61 ms; with two tiles an SM and no spill,
    50.2 and 52.4 ms.

    Both blocks compute the same union (8 tokens' rows); a block's own tokens are bits
    rank * tile_tokens .. of its masks. A block whose tokens are past the sequence still runs
    the loop (its partner multicasts into it) and stores nothing. The copies are issued with a
    clamped index on every step, the last one re-loading the last block, whose phase is waited
    for after the loop: under a condition, TileLang 0.1.15 places a __syncthreads() inside the
    elected thread's branch of the copy, which deadlocks.

    Walking the pair's union pays only where the two tiles picked nearly the same blocks (as
    neighbouring tokens of a model do): with unrelated picks the union is nearly twice a tile's
    own blocks (H100, 32K x 8, independent selections: 98.1 ms against 77.7 for single tiles).
    So each pair counts its tiles' own blocks, and if the union exceeds 9/8 of the larger count
    both blocks walk their own tile's union instead, loading K/V themselves by TMA
    (walk_tile_union_tma). Both reach the same decision from the same data."""
    T_MAX = SMALL_TOKENS
    PAIR = 2 * T_MAX
    threads = 128
    warps = threads // 32
    topk, sig = _fwd_signature(dtype, D)
    pair_union = _make_tile_union(topk, threads, PAIR)
    tile_union = _make_tile_union(topk, threads, T_MAX)

    @T.prim_func
    def sparse_attn_fwd(
        Q: sig["Q"], K: sig["K"], V: sig["V"], topk_idx: sig["topk_idx"], cu_seqlens_q: sig["cu_seqlens_q"],
        cu_seqlens_k: sig["cu_seqlens_k"], O: sig["O"], LSE: sig["LSE"],
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        scale_log2: T.float32,
    ):
        # max_tiles is even (the host rounds it up): tiles 2c and 2c + 1 are cluster c
        with T.Kernel(max_tiles, batch, sig["K"].shape[1], threads=threads, cluster_dims=(2, 1, 1)) as (bx, b, hk):
            # three tiles an SM (74 KB each): ptxas would take 176 registers, which fits two
            T.annotate_min_blocks_per_sm(3)
            Q_s = T.alloc_shared([BLOCK_M, D], dtype)
            Q_r = T.alloc_fragment([BLOCK_M, D], dtype)
            K_s = T.alloc_shared([BLOCK_N, D], dtype)
            V_s = T.alloc_shared([BLOCK_N, D], dtype)
            idx_s, keep_s, ublk_s, umask_s, n_union, my_keep, my_mask, bm_s = _union_buffers(PAIR, threads)
            own_s = T.alloc_shared([2], "int32")  # blocks of the union the first / second tile picked
            full = T.alloc_barrier([threads, threads])  # K, V landed in this block
            empty = T.alloc_cluster_barrier([2 * warps, 2 * warps])  # K, V free in both (rank 0's copy)
            n_it = T.alloc_var("int32")
            shared_walk = T.alloc_var("int32")
            acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum = _fwd_state(dtype, D)
            rtok = T.alloc_fragment([BLOCK_M], "int32")

            tx = T.get_thread_binding()
            rank = bx % 2
            q0, len_q = seq_span(cu_seqlens_q, b, Q.shape[0])
            k0, len_k = seq_span(cu_seqlens_k, b, K.shape[0])
            tp0 = (bx - rank) * tile_tokens  # the pair's first token
            n_pair = T.max(T.min(2 * tile_tokens, len_q - tp0), 0)
            t0 = bx * tile_tokens
            n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
            p0 = len_k - len_q + t0
            own = (1 << tile_tokens) - 1

            # both blocks of a cluster take this branch or neither
            if n_pair > 0:
                load_rows(Q, Q_s, q0 + t0, hk, T.max(n_tok, 1), groups)
                if tx < 2:
                    own_s[tx] = 0
                pair_union(topk_idx, hk, q0 + tp0, n_pair, len_k - len_q + tp0, tx, idx_s, keep_s, ublk_s, umask_s,
                           n_union, my_keep, my_mask, bm_s)
                n_it = n_union[0]
                for e in T.serial(T.ceildiv(PAIR * K_MAX, threads)):
                    if e * threads + tx < n_it:
                        if (umask_s[e * threads + tx] & own) != 0:
                            T.atomic_add(own_s[0], 1)
                        if ((umask_s[e * threads + tx] >> tile_tokens) & own) != 0:
                            T.atomic_add(own_s[1], 1)
                T.sync_threads()
                shared_walk = T.if_then_else(8 * n_it <= 9 * T.max(own_s[0], own_s[1]), 1, 0)
                for r in T.Parallel(BLOCK_M):
                    rtok[r] = T.if_then_else(r < n_tok * groups, r // groups, 31)
                T.fill(acc_o, 0)
                T.fill(l_sum, 0)
                T.fill(m_cur, NEG_INF)
                T.copy(Q_s, Q_r)
                if shared_walk == 1:
                    load_first_kv(K, V, k0, hk, ublk_s, n_it, K_s, V_s, full, cluster_mask=0b11)
                    for it in T.serial(n_it):
                        blk = ublk_s[it]
                        nxt = ublk_s[T.min(it + 1, n_it - 1)]
                        mask_scores(acc_s, (umask_s[it] >> (rank * tile_tokens)) & own, n_tok, blk, p0, rtok)
                        T.mbarrier_wait_parity(full[0], it % 2)
                        T.gemm(Q_r, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        if tx % 32 == 0:
                            T.mbarrier_arrive(empty[0], 0)
                        if rank == 0:
                            T.mbarrier_wait_parity(empty[0], it % 2)
                        T.tma_copy(K[k0 + nxt * BLOCK_N : k0 + (nxt + 1) * BLOCK_N, hk, :], K_s, barrier=full[0],
                                   cluster_mask=0b11)
                        T.mbarrier_arrive(full[0])
                        softmax_step(acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum,
                                     scale_log2)
                        T.mbarrier_wait_parity(full[1], it % 2)
                        T.gemm(acc_s_cast, V_s, acc_o, policy=T.GemmWarpPolicy.FullRow)
                        if tx % 32 == 0:
                            T.mbarrier_arrive(empty[1], 0)
                        if rank == 0:
                            T.mbarrier_wait_parity(empty[1], it % 2)
                        T.tma_copy(V[k0 + nxt * BLOCK_N : k0 + (nxt + 1) * BLOCK_N, hk, :], V_s, barrier=full[1],
                                   cluster_mask=0b11)
                        T.mbarrier_arrive(full[1])
                    T.mbarrier_wait_parity(full[0], n_it % 2)
                    T.mbarrier_wait_parity(full[1], n_it % 2)
                    if n_tok > 0:
                        store_out(acc_o, l_sum, m_cur, O, LSE, q0 + t0, hk, n_tok, groups, scale_log2)
                    # neither block leaves while the other may still multicast into it or arrive on
                    # it (walking alone, a block leaves when done: its partner's work differs)
                    T.cluster_sync()
                else:
                    T.sync_threads()  # every thread has read the pair's union before it is overwritten
                    tile_union(topk_idx, hk, q0 + t0, n_tok, p0, tx, idx_s, keep_s, ublk_s, umask_s, n_union,
                               my_keep, my_mask, bm_s)
                    n_it = n_union[0]
                    walk_tile_union_tma(K, V, k0, hk, Q_r, K_s, V_s, full, ublk_s, umask_s, n_it, n_tok, p0, rtok,
                                        acc_s, acc_s_cast, acc_o, m_prev, m_cur, m_safe, r_scale, r_sum, l_sum,
                                        scale_log2)
                    if n_tok > 0:
                        store_out(acc_o, l_sum, m_cur, O, LSE, q0 + t0, hk, n_tok, groups, scale_log2)

    return sparse_attn_fwd


@T.macro
def row_dots(O, dO, row0, h, total_q, prod, delta):
    """delta[r] = dO[row0 + r, h] . O[row0 + r, h] in fp32 (0 past total_q), prod its scratch."""
    for r, d in T.Parallel(prod.shape[0], prod.shape[1]):
        prod[r, d] = T.if_then_else(
            row0 + r < total_q, T.cast(O[row0 + r, h, d], "float32") * T.cast(dO[row0 + r, h, d], "float32"), 0)
    T.reduce_sum(prod, delta, dim=1)


def _bwd_preprocess(dtype, D, arch):
    accum = "float32"
    total_q = T.dynamic("total_q")
    heads = T.dynamic("heads")
    ROWS = 32
    HEADS = 4  # heads a thread block: a row's Stats are then written as one 32-byte sector

    @T.prim_func
    def sparse_attn_bwd_preprocess(
        O: T.Tensor([total_q, heads, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        LSE: T.Tensor([heads, total_q], accum),
        Delta: T.Tensor([heads, total_q], accum),
        Stats: T.Tensor([total_q, heads, 2], accum),
    ):
        # Delta as bwd_dq reads it (a tile's rows of one head), and each row's (LSE log2(e), Delta)
        # as bwd_dkdv does: a group's rows are a few tokens' G heads, so there a token's stats
        # are one 8 * G-byte run instead of 2 * G sectors; the LSE comes scaled for exp2, which
        # takes a multiply a row off every group step of bwd_dkdv
        with T.Kernel(T.ceildiv(total_q, ROWS), T.ceildiv(heads, HEADS), threads=128) as (bx, by):
            prod = T.alloc_fragment([ROWS, D], accum)
            delta = T.alloc_fragment([ROWS], accum)
            st_s = T.alloc_shared([ROWS, HEADS, 2], accum)
            for hh in T.serial(HEADS):
                # the last block's heads past `heads` (heads % HEADS != 0) are skipped, not
                # recomputed as the last head: their Stats entries are never stored
                if by * HEADS + hh < heads:
                    h = by * HEADS + hh
                    row_dots(O, dO, bx * ROWS, h, total_q, prod, delta)
                    for r in T.Parallel(ROWS):
                        if bx * ROWS + r < total_q:
                            Delta[h, bx * ROWS + r] = delta[r]
                        st_s[r, hh, 0] = LSE[h, T.min(bx * ROWS + r, total_q - 1)] * LOG2E
                        st_s[r, hh, 1] = delta[r]
            for r, hh, j in T.Parallel(ROWS, HEADS, 2):
                if bx * ROWS + r < total_q and by * HEADS + hh < heads:
                    Stats[bx * ROWS + r, by * HEADS + hh, j] = st_s[r, hh, j]

    return sparse_attn_bwd_preprocess


def _bwd_dq(dtype, D, arch, tokens):
    accum = "float32"
    dyn = _dyn()
    total_q, total_k, heads, heads_k, topk, batch_plus_one = (
        dyn["total_q"], dyn["total_k"], dyn["heads"], dyn["heads_k"], dyn["topk"], dyn["batch_plus_one"])
    T_MAX = tokens
    # The 4-token unit's union buffers are small enough for three tiles an H100 SM if ptxas keeps
    # to 168 registers: H100, this kernel alone at G = 16, 67.6 -> 57.9 ms at 32K x 8 and 73 ->
    # 59.6 ms at 128K x 2, dQ bitwise equal (72 KB a tile then; 74 KB + 1 KB with the TMA walk
    # below, 167 registers, no spill). The 16-token unit takes two tiles an SM (104 KB on sm_90a).
    tiles_per_sm = 3 if tokens == SMALL_TOKENS and arch == "sm_90a" else None
    # sm_90a walks the union with TMA loads into two buffers whose roles alternate (dq_block)
    rotate = arch == "sm_90a"
    TK = T_MAX * K_MAX
    threads = 128
    # TileLang's allocator overlaps no other shared buffer with one that TMA writes, so the
    # union's scratch no longer shares K_s's and V_s's memory, and the barriers take 1 KB of
    # static shared memory: a 1 KB bitmap keeps the 4-token unit within a third of an SM (74 KB
    # + 1 KB). Its 256 ints hold UW blocks, 8 to an int (4 token bits each), so the union takes
    # one pass up to 128K keys.
    pack = 32 // T_MAX if tiles_per_sm is not None else 1  # tiles_per_sm: sm_90a's 4-token unit
    tile_union = _make_tile_union(topk, threads, T_MAX, pack=pack)
    S_REGS = BLOCK_M * BLOCK_N // threads
    DQ_REGS = BLOCK_M * D // threads

    @T.macro
    def probabilities(acc_s, um, n_tok, blk, p0, rtok, lse_r, scale_log2):
        """Scores to P = exp(scale S - LSE) where the row's token picked block blk and sees the
        key, else 0."""
        if _whole_block(um, n_tok, blk, p0):
            # every token picked and sees the block, so its rows' LSEs are finite
            for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                acc_s[r, c] = T.exp2(acc_s[r, c] * scale_log2 - lse_r[r])
        elif _tile_sees_block(blk, p0):
            # every token sees the whole block, so only the rows decide: a row whose token did not
            # pick it (or an empty row) takes +inf for its LSE and exp2 gives 0, two selects a
            # thread instead of a test on every element
            for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                acc_s[r, c] = T.exp2(acc_s[r, c] * scale_log2 - T.if_then_else(
                    lse_r[r] != NEG_INF and ((um >> rtok[r]) & 1) == 1, lse_r[r], POS_INF))
        else:
            for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                acc_s[r, c] = T.if_then_else(
                    lse_r[r] != NEG_INF
                    and ((um >> rtok[r]) & 1) == 1
                    and blk * BLOCK_N + c <= p0 + rtok[r],
                    T.exp2(acc_s[r, c] * scale_log2 - lse_r[r]),
                    0,
                )

    @T.macro
    def dq_block(it, n_it, K, V, k0, hk, Kb, Vb, full, iK, iV, Q_s, dO_s, ublk_s, umask_s, n_tok, p0, rtok, lse_r,
                 delta_r, acc_s, acc_dp, dS_r, acc_dq, scale_log2):
        """Block it of the union, its K in Kb and its V in Vb (sm_90a). V is free once dP is
        computed and K once dQ is, so the next block's K loads into Vb during dS and the dQ
        GEMM, and its V into Kb during the next S GEMM and exponentials: both loads overlap
        work, with no third buffer (which would cost the SM its third tile). The GEMMs for S and
        dP are issued together, so dP runs while P is taken. The copies are issued on every
        step with a clamped index (the last step reloads the last block, waited for after the
        loop): under a condition TileLang 0.1.15 can put a barrier inside the issuing thread's
        branch, which deadlocks."""
        blk = ublk_s[it]
        nxt = ublk_s[T.min(it + 1, n_it - 1)]
        T.mbarrier_wait_parity(full[iK], it % 2)
        T.wgmma_gemm(Q_s, Kb, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
        T.mbarrier_wait_parity(full[iV], it % 2)
        T.wgmma_gemm(dO_s, Vb, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
        T.wait_wgmma(1)
        T.warpgroup_fence_operand(acc_s, num_regs=S_REGS)
        probabilities(acc_s, umask_s[it], n_tok, blk, p0, rtok, lse_r, scale_log2)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_dp, num_regs=S_REGS)
        T.sync_threads()  # every warp's part of dP has read Vb
        T.tma_copy(K[k0 + nxt * BLOCK_N : k0 + (nxt + 1) * BLOCK_N, hk, :], Vb, barrier=full[iV])
        T.mbarrier_arrive(full[iV])
        for r, c in T.Parallel(BLOCK_M, BLOCK_N):
            dS_r[r, c] = T.cast(acc_s[r, c] * (acc_dp[r, c] - delta_r[r]), dtype)
        T.warpgroup_fence_operand(acc_dq, num_regs=DQ_REGS)
        T.wgmma_gemm(dS_r, Kb, acc_dq, policy=T.GemmWarpPolicy.FullRow)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_dq, num_regs=DQ_REGS)
        T.sync_threads()  # every warp's part of dQ has read Kb
        T.tma_copy(V[k0 + nxt * BLOCK_N : k0 + (nxt + 1) * BLOCK_N, hk, :], Kb, barrier=full[iK])
        T.mbarrier_arrive(full[iK])

    @T.prim_func
    def sparse_attn_bwd_dq(
        Q: T.Tensor([total_q, heads, D], dtype),
        K: T.Tensor([total_k, heads_k, D], dtype),
        V: T.Tensor([total_k, heads_k, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        LSE: T.Tensor([heads, total_q], accum),
        Delta: T.Tensor([heads, total_q], accum),
        topk_idx: T.Tensor([heads_k, total_q, topk], "int32"),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        dQ: T.Tensor([total_q, heads, D], dtype),
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles, batch, heads_k, threads=threads) as (bx, b, hk):
            if tiles_per_sm is not None:
                T.annotate_min_blocks_per_sm(tiles_per_sm)
            Q_s = T.alloc_shared([BLOCK_M, D], dtype)
            dO_s = T.alloc_shared([BLOCK_M, D], dtype)
            # K_s, V_s: on sm_90a the two buffers whose roles alternate (dq_block)
            K_s = T.alloc_shared([BLOCK_N, D], dtype)
            V_s = T.alloc_shared([BLOCK_N, D], dtype)
            full = T.alloc_barrier([threads, threads]) if rotate else None  # K_s, V_s landed
            # dS stays in registers as the A operand of dS.K (no shared round trip, no barrier)
            dS_r = T.alloc_fragment([BLOCK_M, BLOCK_N], dtype)
            idx_s = T.alloc_shared([TK], "int32")
            keep_s = T.alloc_shared([TK], "int32")
            ublk_s = T.alloc_shared([TK], "int32")
            umask_s = T.alloc_shared([TK], "int32")
            n_union = T.alloc_shared([1], "int32")
            my_keep = T.alloc_local([TK // threads], "int32")
            my_mask = T.alloc_local([TK // threads], "int32")
            bm_s = T.alloc_shared([UW // pack], "int32")
            n_it = T.alloc_var("int32")
            acc_s = T.alloc_fragment([BLOCK_M, BLOCK_N], accum)
            acc_dp = T.alloc_fragment([BLOCK_M, BLOCK_N], accum)
            acc_dq = T.alloc_fragment([BLOCK_M, D], accum)
            lse_r = T.alloc_fragment([BLOCK_M], accum)
            delta_r = T.alloc_fragment([BLOCK_M], accum)
            rtok = T.alloc_fragment([BLOCK_M], "int32")  # as in the forward

            tx = T.get_thread_binding()
            q0, len_q = seq_span(cu_seqlens_q, b, Q.shape[0])
            k0, len_k = seq_span(cu_seqlens_k, b, K.shape[0])
            t0 = bx * tile_tokens
            n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
            n_rows = n_tok * groups
            p0 = len_k - len_q + t0

            if n_tok > 0:
                load_rows(Q, Q_s, q0 + t0, hk, n_tok, groups)
                load_rows(dO, dO_s, q0 + t0, hk, n_tok, groups)
                for r in T.Parallel(BLOCK_M):
                    # -inf LSE (an empty row) stays -inf and its probabilities are forced to 0
                    lse_r[r] = T.if_then_else(
                        r < n_rows, LSE[hk * groups + r % groups, q0 + t0 + r // groups] * LOG2E, NEG_INF
                    )
                    delta_r[r] = T.if_then_else(r < n_rows, Delta[hk * groups + r % groups, q0 + t0 + r // groups], 0)
                    rtok[r] = T.if_then_else(r < n_rows, r // groups, 31)
                tile_union(topk_idx, hk, q0 + t0, n_tok, p0, tx, idx_s, keep_s, ublk_s, umask_s, n_union,
                           my_keep, my_mask, bm_s)
                n_it = n_union[0]
                T.fill(acc_dq, 0)
                if rotate:
                    load_first_kv(K, V, k0, hk, ublk_s, n_it, K_s, V_s, full)
                    for it in T.serial(n_it):
                        if it % 2 == 0:
                            dq_block(it, n_it, K, V, k0, hk, K_s, V_s, full, 0, 1, Q_s, dO_s, ublk_s, umask_s,
                                     n_tok, p0, rtok, lse_r, delta_r, acc_s, acc_dp, dS_r, acc_dq, scale_log2)
                        else:
                            dq_block(it, n_it, K, V, k0, hk, V_s, K_s, full, 1, 0, Q_s, dO_s, ublk_s, umask_s,
                                     n_tok, p0, rtok, lse_r, delta_r, acc_s, acc_dp, dS_r, acc_dq, scale_log2)
                    T.mbarrier_wait_parity(full[0], n_it % 2)
                    T.mbarrier_wait_parity(full[1], n_it % 2)
                else:
                    for it in T.Pipelined(n_it, num_stages=_stages(arch)):
                        blk = ublk_s[it]
                        T.copy(K[k0 + blk * BLOCK_N : k0 + (blk + 1) * BLOCK_N, hk, :], K_s)
                        T.copy(V[k0 + blk * BLOCK_N : k0 + (blk + 1) * BLOCK_N, hk, :], V_s)
                        T.clear(acc_s)
                        T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        probabilities(acc_s, umask_s[it], n_tok, blk, p0, rtok, lse_r, scale_log2)
                        T.clear(acc_dp)
                        T.gemm(dO_s, V_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                        for r, c in T.Parallel(BLOCK_M, BLOCK_N):
                            dS_r[r, c] = T.cast(acc_s[r, c] * (acc_dp[r, c] - delta_r[r]), dtype)
                        T.gemm(dS_r, K_s, acc_dq, policy=T.GemmWarpPolicy.FullRow)
                store_rows(acc_dq, dQ, q0 + t0, hk, n_tok, groups, scale_log2 / LOG2E)

    return sparse_attn_bwd_dq


def _listed(rows_s, r, tx, blk, t, t_end, topk, kb0, n_win, shift):
    """Whether entry tx (block blk) of query t's selection row, staged as rows_s[r], goes into a
    list: an entry of a row of the slice (t < t_end, tx < topk: the staging zero-fills the rest),
    a block of the window kb0 .. kb0 + n_win - 1 whose first key the query sees, not a repeat of
    the entry before it in the sorted row. (T.And / T.Or: this runs as Python, where `and` would
    drop a term.)"""
    return T.And(T.And(T.And(t < t_end, tx < topk), T.And(blk >= kb0, blk < kb0 + n_win)),
                 T.And(blk * BLOCK_N <= shift + t, T.Or(tx == 0, rows_s[r, T.max(tx, 1) - 1] != blk)))


def _bwd_members():
    """The inverse index of the selections, for bwd_dkdv: for KV head g and key block kb of
    sequence b, members[g, offsets[g, gb] .. offsets[g, gb + 1]] are the positions in the
    sequence of the queries that picked the block and see its first key, ascending, where gb =
    cu_seqlens_k[b] // 64 + b + kb (a sequence's blocks and one spare index after them: every
    sequence gets an index range of its own without a prefix sum over the batch).

    Built in three launches in which no atomic decides an order, so the lists, and the gradient
    sums that follow their order, are the same on every run: this kernel with fill = 0 counts
    (shared-memory atomic adds, whose sum is the same in any order), for each of the CHUNKS
    slices of a sequence's queries (slice c: rows c * ceil(Lq / CHUNKS) ..), how many of its
    queries picked each block, into cnt[g, c, gb]; bwd_members_scan turns the counts into each
    slice's first slot in each list (and `offsets`); this kernel with fill = 1 writes the
    positions. A thread block takes one slice and a window of WINDOW blocks; filling, it walks
    its rows in order, one row a step, a thread an entry: a row lists a block at most once
    (repeats are skipped), so the step's counter updates never collide, and the barrier between
    steps orders the queries of one list."""
    total_q = T.dynamic("total_q")
    heads_k = T.dynamic("heads_k")
    topk = T.dynamic("topk")
    batch_plus_one = T.dynamic("batch_plus_one")
    n_gb = T.dynamic("n_gb")
    n_entries = T.dynamic("n_entries")
    threads = K_MAX  # one thread an entry of a selection row
    RB = 16  # rows loaded at a time

    @T.macro
    def stage_rows(topk_idx, hk, q0, r_lo, r_hi, rb, topk, tx, rows_s):
        # 4-byte copies, one an entry; entries past the row or the slice are zero-filled, which
        # _listed tells apart by position
        for r in T.unroll(RB):
            t = r_lo + rb * RB + r
            T.ptx_cp_async(T.access_ptr(rows_s[r, tx], "w", 1),
                           T.access_ptr(topk_idx[hk, q0 + T.min(t, r_hi - 1), T.min(tx, topk - 1)], "r", 1), 1,
                           predicate=T.And(tx < topk, t < r_hi))
        T.ptx_commit_group()

    @T.macro
    def walk_rows(rows_s, rb, r_lo, r_hi, topk, tx, kb0, n_win, shift, fill, cnt_s, members, hk, blk, p):
        if fill == 0:
            # a count needs no order: the batch's entries at once
            for r in T.unroll(RB):
                if _listed(rows_s, r, tx, rows_s[r, tx], r_lo + rb * RB + r, r_hi, topk, kb0, n_win, shift):
                    T.atomic_add(cnt_s[rows_s[r, tx] - kb0], 1)
            T.sync_threads()
        else:
            for r in T.serial(RB):
                blk = rows_s[r, tx]
                if _listed(rows_s, r, tx, blk, r_lo + rb * RB + r, r_hi, topk, kb0, n_win, shift):
                    p = cnt_s[blk - kb0]
                    cnt_s[blk - kb0] = p + 1
                    # cu_seqlens are trusted, but a caller's bad ones must not write outside the lists
                    if p >= 0 and p < n_entries:
                        members[hk, p] = r_lo + rb * RB + r
                T.sync_threads()

    @T.prim_func
    def sparse_attn_bwd_members(
        topk_idx: T.Tensor([heads_k, total_q, topk], "int32"),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        cnt: T.Tensor([heads_k, CHUNKS, n_gb], "int32"),
        members: T.Tensor([heads_k, n_entries], "int32"),
        batch: T.int32,
        windows: T.int32,
        fill: T.int32,
    ):
        # windows: of WINDOW blocks, enough for the longest sequence's (the host passes it)
        with T.Kernel(CHUNKS * windows, heads_k, batch, threads=threads) as (bx, hk, b):
            cnt_s = T.alloc_shared([WINDOW], "int32")
            # two batches of RB rows: the next one loads while this one is counted or listed
            rows_s0 = T.alloc_shared([RB, K_MAX], "int32")
            rows_s1 = T.alloc_shared([RB, K_MAX], "int32")
            blk = T.alloc_var("int32")
            p = T.alloc_var("int32")
            tx = T.get_thread_binding()
            c = bx % CHUNKS
            kb0 = (bx // CHUNKS) * WINDOW
            q0, len_q = seq_span(cu_seqlens_q, b, total_q)  # the span bwd_dkdv takes
            # the key offsets only index the lists (gbase and span below, clamped into cnt), as given:
            # this kernel has no key tensor to clamp them into (bwd_dkdv does)
            k0 = cu_seqlens_k[b]
            shift = cu_seqlens_k[b + 1] - k0 - len_q
            gbase = k0 // BLOCK_N + b
            # this sequence's indices, its blocks and the spare one (clamped into cnt)
            span = T.min(cu_seqlens_k[b + 1] // BLOCK_N + b + 1, n_gb) - gbase
            n_win = T.if_then_else(gbase >= 0, T.max(T.min(span - kb0, WINDOW), 0), 0)
            rows = T.ceildiv(len_q, CHUNKS)
            r_lo = c * rows
            r_hi = T.min(len_q, r_lo + rows)
            for i in T.serial(WINDOW // threads):
                e = i * threads + tx
                cnt_s[e] = T.if_then_else(fill == 1 and e < n_win, cnt[hk, c, gbase + kb0 + T.min(e, n_win - 1)], 0)
            T.sync_threads()
            n_rb = T.ceildiv(T.if_then_else(n_win > 0, T.max(r_hi - r_lo, 0), 0), RB)
            if n_rb > 0:
                stage_rows(topk_idx, hk, q0, r_lo, r_hi, 0, topk, tx, rows_s0)
            for rb in T.serial(n_rb):
                # batch rb + 1 loads while batch rb is walked; rb's copies are then the older group
                if rb + 1 < n_rb:
                    if rb % 2 == 0:
                        stage_rows(topk_idx, hk, q0, r_lo, r_hi, rb + 1, topk, tx, rows_s1)
                    else:
                        stage_rows(topk_idx, hk, q0, r_lo, r_hi, rb + 1, topk, tx, rows_s0)
                    T.ptx_wait_group(1)
                else:
                    T.ptx_wait_group(0)
                T.sync_threads()
                if rb % 2 == 0:
                    walk_rows(rows_s0, rb, r_lo, r_hi, topk, tx, kb0, n_win, shift, fill, cnt_s, members, hk, blk, p)
                else:
                    walk_rows(rows_s1, rb, r_lo, r_hi, topk, tx, kb0, n_win, shift, fill, cnt_s, members, hk, blk, p)
            if fill == 0:
                for i in T.serial(WINDOW // threads):
                    e = i * threads + tx
                    if e < n_win:
                        cnt[hk, c, gbase + kb0 + e] = cnt_s[e]

    return sparse_attn_bwd_members


def _bwd_members_scan():
    """bwd_members' counts cnt[g, c, gb] become the slots where slice c's queries go in list gb,
    offsets[g, gb] + (the counts of slices before c), with offsets[g, gb] the first slot of list
    gb: one thread block a KV head, `threads` lists at a time, in order, so the sums are fixed."""
    heads_k = T.dynamic("heads_k")
    n_gb = T.dynamic("n_gb")
    batch_plus_one = T.dynamic("batch_plus_one")
    threads = 256

    @T.prim_func
    def sparse_attn_bwd_members_scan(
        cnt: T.Tensor([heads_k, CHUNKS, n_gb], "int32"),
        offsets: T.Tensor([heads_k, n_gb + 1], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        batch: T.int32,
    ):
        with T.Kernel(heads_k, threads=threads) as hk:
            sum_s = T.alloc_shared([threads], "int32")
            vals = T.alloc_local([CHUNKS], "int32")
            tot = T.alloc_var("int32")
            run = T.alloc_var("int32")
            carry = T.alloc_var("int32")
            tx = T.get_thread_binding()
            # the indices the batch's sequences own (bwd_members writes every one of them),
            # clamped into the counts: offsets[n_used] is written whatever cu_seqlens_k holds
            n_used = T.max(T.min(cu_seqlens_k[batch] // BLOCK_N + batch, n_gb), 0)
            carry = 0
            for it in T.serial(T.ceildiv(n_used, threads)):
                gb = it * threads + tx
                tot = 0
                for c in T.unroll(CHUNKS):
                    vals[c] = T.if_then_else(gb < n_used, cnt[hk, c, T.min(gb, n_gb - 1)], 0)
                    tot = tot + vals[c]
                sum_s[tx] = tot
                T.sync_threads()
                T.cumsum(src=sum_s, dst=sum_s, dim=0)
                T.sync_threads()
                run = carry + sum_s[tx] - tot
                if gb < n_used:
                    offsets[hk, gb] = run
                    for c in T.unroll(CHUNKS):
                        cnt[hk, c, gb] = run
                        run = run + vals[c]
                carry = carry + sum_s[threads - 1]
                T.sync_threads()
            if tx == 0:
                offsets[hk, n_used] = carry

    return sparse_attn_bwd_members_scan


@T.macro
def lower_bound(members, hk, lo, hi, target, pos):
    """pos[0] = the first index in lo .. hi - 1 whose entry of the ascending members[hk] is >=
    target (hi if none): log2(hi - lo) dependent loads."""
    pos[0] = lo
    for s in T.serial(31):
        if (1 << (30 - s)) <= hi - pos[0]:
            if members[hk, pos[0] + (1 << (30 - s)) - 1] < target:
                pos[0] = pos[0] + (1 << (30 - s))


def _bwd_dkdv(dtype, D, arch, boxes=0):
    accum = "float32"
    dyn = _dyn()
    total_q, total_k, heads, heads_k, topk, batch_plus_one = (
        dyn["total_q"], dyn["total_k"], dyn["heads"], dyn["heads_k"], dyn["topk"], dyn["batch_plus_one"])
    n_off = T.dynamic("n_off")  # bwd_members_scan's n_gb + 1
    n_entries = T.dynamic("n_entries")
    n_pieces = T.dynamic("n_pieces")
    # sm_90a: one warpgroup on 64-row groups, P^T and dS^T in its registers as the A operands
    # of the dV and dK wgmma (H100, 32K x 8, this kernel alone: 123 -> 108 ms at G = 16, 134 ->
    # 106 ms at G = 4). Two warpgroups on 128-row groups had split each GEMM's N between them,
    # so both needed all of P^T and dS^T, which went through shared memory. Elsewhere eight
    # warps share the 64 rows and P^T, dS^T go through shared memory: with one warpgroup ptxas
    # needs all 255 registers (spilling on sm_80), and sm_89's 99 KB hold one block an SM.
    # A group is BM // G member tokens, taken from the block's member list, so small G fill it.
    reg_operands = _prefetch(arch)
    # boxes: the unit for G = boxes, whose rows load as TMA boxes (see load_tile)
    assert not boxes or (reg_operands and BLOCK_M % boxes == 0), (arch, boxes)
    BOX_D = 64  # elements of a box row: 128 bytes, the 128-byte swizzle of the tiles
    threads = 128 if reg_operands else 256
    BM = BLOCK_M  # the rows of one warpgroup's wgmma on sm_90a
    SLICE = 2048  # member tokens staged in shared memory at a time
    prefetch = _prefetch(arch)
    TPR = 4  # load_tile: threads a row
    VPT = D // VEC // TPR  # 16-byte vectors a thread copies of a row
    RPP = threads // TPR  # rows a pass
    PASSES = BM // RPP
    # every vector of every row is copied exactly once
    assert VPT * TPR == D // VEC and PASSES * RPP == BM, (D, threads)

    def member_row(q0, base, n_rows, tok_s, rtok_s, r):
        # Clamped into q: a list entry is a position in the sequence when the caller's offsets
        # agree with the tensors, but with offsets that do not (the C ABI cannot see them) the
        # lists may hold entries bwd_members never wrote, and cp.async is not bounds-checked.
        return T.min(T.max(q0 + T.if_then_else(r < n_rows, tok_s[base + rtok_s[r]], 0), 0), total_q - 1)

    @T.macro
    def row_lookup(q0, base, n_rows, tok_s, rtok_s, rhead_s, tx, rowl, headl):
        for p in T.unroll(PASSES):
            r = p * RPP + tx // TPR
            rowl[p] = member_row(q0, base, n_rows, tok_s, rtok_s, r)
            headl[p] = rhead_s[r]

    @T.macro
    def stat_lookup(q0, base, n_rows, tok_s, rtok_s, rhead_s, tx, rowl, headl):
        if tx < BM:
            rowl[PASSES] = member_row(q0, base, n_rows, tok_s, rtok_s, tx)
            headl[PASSES] = rhead_s[tx]

    @T.macro
    def gather_rows(Q, dO, n_rows, tx, Q_s, dO_s, row0, rowl, headl):
        for p in T.unroll(PASSES):
            for j in T.unroll(VPT):
                r = p * RPP + tx // TPR
                d = (j * TPR + tx % TPR) * VEC
                T.ptx_cp_async(T.access_ptr(Q_s[row0 + r, d], "w", VEC),
                               T.access_ptr(Q[rowl[p], headl[p], d], "r", VEC), VEC, predicate=r < n_rows)
                T.ptx_cp_async(T.access_ptr(dO_s[row0 + r, d], "w", VEC),
                               T.access_ptr(dO[rowl[p], headl[p], d], "r", VEC), VEC, predicate=r < n_rows)

    @T.macro
    def load_tile(Q, dO, Stats, q0, base, n_rows, tok_s, rtok_s, rhead_s, tx, Q_s, dO_s, Q_v, dO_v, st_s, rowl,
                  headl, hk, rbar, bi, boxl):
        # No wait: the next group's rows load while the current one is computed. Rows past the
        # member rows are zero-filled. Row r is head rhead_s[r] of member token
        # tok_s[base + rtok_s[r]]: a gather, one 16-byte cp.async a thread and vector, except in
        # the unit for G = `boxes` (sm_90a), where the group is its BM // G tokens' rows of Q and
        # dO, each a TMA box of the G heads and a 128-byte half of D issued onto rbar[bi] by one
        # lane of the warp that takes the token (the four warps issue side by side rather than
        # one thread all 16 boxes; alone this measured no change), tokens past the group reading
        # row total_q, out of bounds, which TMA fills with zeros. H100, dK/dV alone at G = 16,
        # two runs: 72.9 / 82.3 / 84.9 and 74.9 / 82.6 / 88.3 ms -> 68.8 / 79.3 / 82.1 and 70.9 /
        # 79.8 / 82.6 at 32K x 8 / 128K x 2 / 32K x 8 independent, gradients bitwise equal.
        # (Boxes for any G a multiple of 16 and the gather for other G in one kernel, chosen at
        # run time, spilled at 255 registers and took 88 / 98 / 103 ms.)
        # Each thread reads its rows' token and head into registers (rowl, headl; the last entry
        # is its LSE / Delta row; boxl the boxes' tokens) before any copy is issued: TileLang's
        # sync planner cannot tell the merged shared buffers apart, and with a read of tok_s
        # before each copy it put a __syncthreads() before every read and every copy, 25 a group
        # (H100, 32K x 8: half of the kernel's warp samples were in this macro), and with TMA
        # one inside the issuing thread's branch, which deadlocks. (Computing r -> token, head
        # here instead of reading rtok_s / rhead_s made the kernel 60% slower on an H100.) In
        # the gather TPR threads share a row, each copying VPT of its 16-byte vectors (TPR
        # adjacent vectors, 64 bytes, a copy instruction), so a thread has PASSES rows to look up.
        # The group goes to buffer bi: rows bi * BM .. of Q_s, dO_s and st_s.
        row0 = bi * BM
        if boxes:
            stat_lookup(q0, base, n_rows, tok_s, rtok_s, rhead_s, tx, rowl, headl)
            for j in T.unroll(BM // boxes):
                boxl[j] = T.if_then_else(j * boxes < n_rows, q0 + tok_s[base + j], total_q)
            run = BM // boxes  # the group's tokens
            halves = D // BOX_D
            if n_rows == BM and boxl[run - 1] - boxl[0] == run - 1:
                # Consecutive tokens (the local window's members, and most runs of a query block
                # that picked the block): one box of all of them per half of D and tensor, 4 TMA
                # loads instead of 16, warp w issuing load w. The rows land where the per-token
                # boxes put them (row j * boxes + head), so the group is the same, bitwise. H100,
                # dK/dV alone, two runs: 70.6, 71.8 -> 68.7, 67.7 ms at 32K x 8, 74.5, 74.7 ->
                # 73.4, 73.8 at 128K x 2 (benchmarks/NOTES.md, "Session 36"). Q_v, dO_v: Q_s, dO_s
                # viewed as (token, head, D).
                for w in T.unroll(2 * halves):
                    h0 = (w % halves) * BOX_D
                    if tx // 32 == w % (threads // 32):
                        if w // halves == 0:
                            T.tma_copy(Q[boxl[0] : boxl[0] + run, hk * boxes : hk * boxes + boxes, h0 : h0 + BOX_D],
                                       Q_v[bi * run : bi * run + run, 0:boxes, h0 : h0 + BOX_D], barrier=rbar[bi],
                                       leader_scope_threads=32)
                        else:
                            T.tma_copy(dO[boxl[0] : boxl[0] + run, hk * boxes : hk * boxes + boxes, h0 : h0 + BOX_D],
                                       dO_v[bi * run : bi * run + run, 0:boxes, h0 : h0 + BOX_D], barrier=rbar[bi],
                                       leader_scope_threads=32)
            else:
                for j in T.unroll(run):
                    # box j: rows j * boxes .., the heads of group hk of the group's token j
                    if tx // 32 == j % (threads // 32):
                        for hf in T.unroll(halves):
                            T.tma_copy(Q[boxl[j], hk * boxes : hk * boxes + boxes, hf * BOX_D : hf * BOX_D + BOX_D],
                                       Q_s[row0 + j * boxes : row0 + j * boxes + boxes, hf * BOX_D : hf * BOX_D + BOX_D],
                                       barrier=rbar[bi], leader_scope_threads=32)
                            T.tma_copy(dO[boxl[j], hk * boxes : hk * boxes + boxes, hf * BOX_D : hf * BOX_D + BOX_D],
                                       dO_s[row0 + j * boxes : row0 + j * boxes + boxes, hf * BOX_D : hf * BOX_D + BOX_D],
                                       barrier=rbar[bi], leader_scope_threads=32)
            T.mbarrier_arrive(rbar[bi])
        else:
            row_lookup(q0, base, n_rows, tok_s, rtok_s, rhead_s, tx, rowl, headl)
            stat_lookup(q0, base, n_rows, tok_s, rtok_s, rhead_s, tx, rowl, headl)
            gather_rows(Q, dO, n_rows, tx, Q_s, dO_s, row0, rowl, headl)
        if tx < BM:
            # the row's (LSE log2(e), Delta), one 8-byte copy: a token's G heads are 8 * G adjacent
            # bytes of Stats, where LSE and Delta laid out (head, row) put each head's in its own
            # sector
            T.ptx_cp_async(T.access_ptr(st_s[row0 + tx, 0], "w", 2),
                           T.access_ptr(Stats[rowl[PASSES], headl[PASSES], 0], "r", 2), 2, predicate=tx < n_rows)

    @T.macro
    def scores(K_s, V_s, acc_sT, acc_dpT, acc_dk, acc_dv, Q_s, dO_s, off):
        # sm_90a: S^T and dP^T issued together, so dP^T runs while the exponentials of S^T are
        # taken. Issued as soon as the group's rows have landed, behind the previous group's dV
        # and dK: wgmma groups complete in order, so the wait for S^T also drains those two.
        T.wgmma_gemm(K_s, Q_s[off : off + BM, :], acc_sT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                     clear_accum=True)
        T.wgmma_gemm(V_s, dO_s[off : off + BM, :], acc_dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                     clear_accum=True)
        T.wait_wgmma(1)
        T.warpgroup_fence_operand(acc_dv, num_regs=BLOCK_N * D // threads)
        T.warpgroup_fence_operand(acc_dk, num_regs=BLOCK_N * D // threads)
        T.warpgroup_fence_operand(acc_sT, num_regs=BLOCK_N * BM // threads)

    @T.macro
    def compute(base, n_rows, full_rows, kb, shift, scale_log2, tok_s, rtok_s, K_s, V_s, pT, dsT,
                acc_sT, acc_dpT, acc_dk, acc_dv, Q_s, dO_s, st_s, off):
        # The group's rows are rows off .. off + BM of Q_s, dO_s and st_s. S^T and dP^T: issued
        # by scores() on sm_90a.
        if not reg_operands:
            T.clear(acc_sT)
            T.gemm(K_s, Q_s[off : off + BM, :], acc_sT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        if n_rows == full_rows and (kb + 1) * BLOCK_N <= shift + tok_s[base] + 1:
            # a full group whose first (earliest) token sees the whole key block: no mask, and
            # every row's LSE is finite (rows past a group of BM // G tokens are zero-filled
            # and never read back)
            for c, r in T.Parallel(BLOCK_N, BM):
                acc_sT[c, r] = T.exp2(acc_sT[c, r] * scale_log2 - st_s[off + r, 0])
        else:
            for c, r in T.Parallel(BLOCK_N, BM):
                acc_sT[c, r] = T.if_then_else(
                    r < n_rows
                    and st_s[off + r, 0] != NEG_INF
                    and kb * BLOCK_N + c <= shift + tok_s[base + rtok_s[r]],
                    T.exp2(acc_sT[c, r] * scale_log2 - st_s[off + r, 0]),
                    0,
                )
        if reg_operands:
            T.copy(acc_sT, pT)
            T.warpgroup_fence_operand(acc_dv, num_regs=BLOCK_N * D // threads)
            T.wgmma_gemm(pT, dO_s[off : off + BM, :], acc_dv, policy=T.GemmWarpPolicy.FullRow)
            T.wait_wgmma(1)
            T.warpgroup_fence_operand(acc_dpT, num_regs=BLOCK_N * BM // threads)
            for c, r in T.Parallel(BLOCK_N, BM):
                dsT[c, r] = T.cast(acc_sT[c, r] * (acc_dpT[c, r] - st_s[off + r, 1]), dtype)
            T.warpgroup_fence_operand(acc_dk, num_regs=BLOCK_N * D // threads)
            T.wgmma_gemm(dsT, Q_s[off : off + BM, :], acc_dk, policy=T.GemmWarpPolicy.FullRow)
            # no wait here: dV and dK run on while the next group's rows land and its S^T and dP^T
            # are issued (scores)
        else:
            T.clear(acc_dpT)
            T.gemm(V_s, dO_s[off : off + BM, :], acc_dpT, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc_sT, pT)
            for c, r in T.Parallel(BLOCK_N, BM):
                dsT[c, r] = T.cast(acc_sT[c, r] * (acc_dpT[c, r] - st_s[off + r, 1]), dtype)
            T.gemm(pT, dO_s[off : off + BM, :], acc_dv, policy=T.GemmWarpPolicy.FullRow)
            T.gemm(dsT, Q_s[off : off + BM, :], acc_dk, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def drain_gemms(acc_dk, acc_dv):
        # the last group's dV and dK wgmma, left running by compute: done before the member slice
        # is overwritten or the sums are stored (within a slice, the next step's wait for its S^T
        # drains them)
        if reg_operands:
            T.wait_wgmma(0)
            T.warpgroup_fence_operand(acc_dv, num_regs=BLOCK_N * D // threads)
            T.warpgroup_fence_operand(acc_dk, num_regs=BLOCK_N * D // threads)

    @T.prim_func
    def sparse_attn_bwd_dkdv(
        Q: T.Tensor([total_q, heads, D], dtype),
        K: T.Tensor([total_k, heads_k, D], dtype),
        V: T.Tensor([total_k, heads_k, D], dtype),
        dO: T.Tensor([total_q, heads, D], dtype),
        Stats: T.Tensor([total_q, heads, 2], accum),
        offsets: T.Tensor([heads_k, n_off], "int32"),
        members: T.Tensor([heads_k, n_entries], "int32"),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        dK: T.Tensor([total_k, heads_k, D], dtype),
        dV: T.Tensor([total_k, heads_k, D], dtype),
        partial: T.Tensor([SPLIT_BLOCKS, heads_k, n_pieces, 2, 2, BLOCK_N, D], accum),
        batch: T.int32,
        max_kblocks: T.int32,
        pieces: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        scale_log2: T.float32,
    ):
        # key blocks innermost: the blocks of one sequence and KV head run side by side and
        # share most member queries, whose rows then come from L2 (H100, 32K x 8, this kernel
        # alone, when it found its members by scanning the selection rows: 143.3 -> 134.4 ms at
        # G = 16, 254.3 -> 164.6 ms at G = 4, whose 8 KV heads' rows are 537 MB).
        # The first SPLIT_BLOCKS blocks lead each sequence, each as `pieces` thread blocks: every
        # query picks its init block, so one thread block would take all of a long sequence's
        # queries in turn (H100, 128K x 2, this kernel alone: 168.8 ms, 108.8 without an init
        # block). In a sequence of more than PIECE queries, piece j of such a block takes the
        # member queries among the packed rows of the j-th PIECE-row piece that the sequence
        # overlaps and writes fp32 partial dK/dV to slot (block, hk, piece, side): side 1 for the
        # piece the sequence starts in, 0 for the later ones (a piece meets at most two such
        # sequences: the one that starts in it and one that started before).
        # bwd_dkdv_reduce sums them in piece order, so gradients stay deterministic.
        with T.Kernel(max_kblocks + SPLIT_BLOCKS * (pieces - 1), heads_k, batch, threads=threads) as (bx, hk, b):
            K_s = T.alloc_shared([BLOCK_N, D], dtype)
            V_s = T.alloc_shared([BLOCK_N, D], dtype)
            # the member rows' buffers, two with the prefetch (rows 0 .. BM and BM .. 2 BM), so
            # that a group's GEMMs address either by a run-time offset: one code path for both,
            # where two (a branch on the step's parity) made ptxas serialise every wgmma (C7512)
            NBUF = 2 if prefetch else 1
            Q_s = T.alloc_shared([NBUF * BM, D], dtype)
            dO_s = T.alloc_shared([NBUF * BM, D], dtype)
            st_s = T.alloc_shared([NBUF * BM, 2], accum)
            # the box unit's 4-token boxes write the row tiles as (token, head, D); views made
            # here because views made in load_tile got TileLang's names in a different order on
            # each build
            Q_v = T.reshape(Q_s, [NBUF * BM // boxes, boxes, D]) if boxes else None
            dO_v = T.reshape(dO_s, [NBUF * BM // boxes, boxes, D]) if boxes else None
            # a slice of the block's member tokens (positions in the sequence), in order; BM
            # spare entries keep the last group's reads past the end in bounds
            tok_s = T.alloc_shared([SLICE + BM], "int32")
            m_a = T.alloc_local([1], "int32")
            m_b = T.alloc_local([1], "int32")
            m_rot = T.alloc_local([1], "int32")
            n_m = T.alloc_var("int32")
            n_toks = T.alloc_var("int32")
            # row r's token offset and head, computed once: as expressions they put run-time
            # integer divisions by G into every load and mask of every query tile
            rtok_s = T.alloc_shared([BM], "int32")
            rhead_s = T.alloc_shared([BM], "int32")
            rowl = T.alloc_local([PASSES + 1], "int32")
            # the box unit's: buffer 0's, 1's boxes landed; the boxes' tokens; rbar[0]'s, rbar[1]'s phase
            rbar = T.alloc_barrier([threads, threads]) if boxes else None
            boxl = T.alloc_local([BM // boxes], "int32") if boxes else None
            ph0 = T.alloc_var("int32") if boxes else None
            ph1 = T.alloc_var("int32") if boxes else None
            headl = T.alloc_local([PASSES + 1], "int32")
            acc_sT = T.alloc_fragment([BLOCK_N, BM], accum)
            acc_dpT = T.alloc_fragment([BLOCK_N, BM], accum)
            if reg_operands:
                pT = T.alloc_fragment([BLOCK_N, BM], dtype)
                dsT = T.alloc_fragment([BLOCK_N, BM], dtype)
            else:
                pT = T.alloc_shared([BLOCK_N, BM], dtype)
                dsT = T.alloc_shared([BLOCK_N, BM], dtype)
            acc_dk = T.alloc_fragment([BLOCK_N, D], accum)
            acc_dv = T.alloc_fragment([BLOCK_N, D], accum)

            tx = T.get_thread_binding()
            # the spans as bwd_members and bwd_dkdv_reduce take them: cu_seqlens_q past total_q
            # (a caller's bug) must not take a piece past the partial slots. (bwd_members, which
            # has no key tensor, indexes the lists by the key offset as given: where that lies
            # outside K the lists read here are another block's, wrong values but inside them.)
            q0, len_q = seq_span(cu_seqlens_q, b, total_q)
            k0, len_k = seq_span(cu_seqlens_k, b, total_k)
            shift = len_k - len_q
            # computed once into registers: as expressions, the divisions by `pieces` were inlined
            # into every use (H100, 32K x 8, no init block: 97.0 -> 104.8 ms, 12 bytes spilled)
            kb = T.alloc_var("int32")
            j = T.alloc_var("int32")
            split = T.alloc_var("int32")
            t_a = T.alloc_var("int32")
            t_b = T.alloc_var("int32")
            t_rot = T.alloc_var("int32")
            kb = bx
            j = 0
            if bx < SPLIT_BLOCKS * pieces:
                kb = bx // pieces
                j = bx % pieces
            else:
                kb = bx - SPLIT_BLOCKS * (pieces - 1)
            # pieces == 1: the host found no sequence longer than PIECE and allotted no partial slots
            split = T.if_then_else(bx < SPLIT_BLOCKS * pieces and len_q > PIECE and pieces > 1, 1, 0)
            piece = q0 // PIECE + j
            # the block's member list (bwd_members), of a piece's queries t_a .. t_b - 1 if split
            t_a = T.max(piece * PIECE - q0, 0)
            t_b = T.min(len_q, (piece + 1) * PIECE - q0)
            # with the key span inside K, a block with keys (kb * 64 < len_k) has gb < n_off - 1
            gb = k0 // BLOCK_N + b + kb
            # tile_tokens: member tokens a group, BM // G (the host passes it)
            full_rows = tile_tokens * groups

            if kb * BLOCK_N < len_k and (j == 0 or (split == 1 and piece * PIECE < q0 + len_q)):
                for r in T.Parallel(BM):
                    rtok_s[r] = r // groups
                    rhead_s[r] = hk * groups + r % groups
                T.copy(K[k0 + kb * BLOCK_N : k0 + (kb + 1) * BLOCK_N, hk, :], K_s)
                T.copy(V[k0 + kb * BLOCK_N : k0 + (kb + 1) * BLOCK_N, hk, :], V_s)
                T.fill(acc_dk, 0)
                T.fill(acc_dv, 0)
                if boxes:
                    ph0 = 0
                    ph1 = 0
                # A list holds each query of the sequence at most once. Offsets that disagree with
                # the tensors can leave list bounds unwritten (bwd_members_scan writes those of the
                # indices below cu_seqlens_k[batch] // 64 + batch): clamped, a block visits at
                # most len_q entries of the lists, and the call's time stays bounded.
                m_a[0] = T.min(T.max(offsets[hk, gb], 0), n_entries)
                m_b[0] = T.max(T.min(T.min(offsets[hk, gb + 1], n_entries), m_a[0] + T.max(len_q, 0)), m_a[0])
                if split == 1:
                    lower_bound(members, hk, m_a[0], m_b[0], t_b, m_rot)
                    m_b[0] = m_rot[0]
                    lower_bound(members, hk, m_a[0], m_b[0], t_a, m_rot)
                    m_a[0] = m_rot[0]
                # The members are visited from the first in a ROT_ROWS-aligned row at or after
                # the first member's, then from the start: every thread block of a sequence's
                # key blocks begins its local window (the first members) on the same rows, so
                # neighbouring blocks, started close together, read the same member rows close
                # together and find them in L2. Each of the two segments ascends, so a group's
                # first token stays its earliest (compute's unmasked test).
                m_rot[0] = m_a[0]
                if m_a[0] < m_b[0]:
                    t_rot = T.ceildiv(q0 + members[hk, m_a[0]], ROT_ROWS) * ROT_ROWS - q0
                    lower_bound(members, hk, m_a[0], m_b[0], t_rot, m_rot)
                    if m_rot[0] == m_b[0]:
                        m_rot[0] = m_a[0]
                for seg in T.serial(2):
                    seg0 = T.if_then_else(seg == 0, m_rot[0], m_a[0])
                    seg_len = T.if_then_else(seg == 0, m_b[0] - m_rot[0], m_rot[0] - m_a[0])
                    for sl in T.serial(T.ceildiv(seg_len, SLICE)):
                        n_toks = T.min(SLICE, seg_len - sl * SLICE)
                        for i in T.serial(SLICE // threads):
                            if i * threads + tx < n_toks:
                                tok_s[i * threads + tx] = members[hk, seg0 + sl * SLICE + i * threads + tx]
                        T.sync_threads()
                        n_m = T.ceildiv(n_toks, tile_tokens)
                        if n_m > 0:
                            load_tile(Q, dO, Stats, q0, 0, T.min(tile_tokens, n_toks) * groups, tok_s, rtok_s,
                                      rhead_s, tx, Q_s, dO_s, Q_v, dO_v, st_s, rowl, headl, hk,
                                      rbar, 0, boxl)
                            T.ptx_commit_group()
                        for m in T.serial(n_m):
                            off = (m % NBUF) * BM  # the group's buffer
                            if prefetch:
                                # this group's rows (the only copies in flight)
                                T.ptx_wait_group(0)
                                if boxes:
                                    # this group's boxes; the phase flips with each use
                                    if m % 2 == 0:
                                        T.mbarrier_wait_parity(rbar[0], ph0)
                                        ph0 = ph0 ^ 1
                                    else:
                                        T.mbarrier_wait_parity(rbar[1], ph1)
                                        ph1 = ph1 ^ 1
                                # Two barriers a step. The first: every thread's copies of this
                                # group have landed (the gather's rows, and in both units the rows'
                                # LSE and Delta, come by cp.async). Its S^T and dP^T then go in
                                # behind the previous group's dV and dK, with no drain between
                                # (scores). The second: every warp is done with the previous group,
                                # whose buffer the next group's rows then load into while this one
                                # is computed (benchmarks/NOTES.md, "Session 54"; the gather unit
                                # since session 56, where the run-time buffer offset costs it 40
                                # bytes of spill at D = 128 and no time). (With the prefetch issued
                                # before this wait and the barriers TileLang's planner added, a
                                # step had four. H100 at base clocks, this kernel alone: 18.74 ->
                                # 18.17 ms at 32K x 2, 39.34 -> 38.23 at 128K x 1, 18.66 -> 18.50
                                # at G = 4.)
                                T.sync_threads()
                                scores(K_s, V_s, acc_sT, acc_dpT, acc_dk, acc_dv, Q_s, dO_s, off)
                                T.sync_threads()
                                if m + 1 < n_m:
                                    nb = (m + 1) * tile_tokens
                                    # two calls that differ only in the buffer: one call with bi =
                                    # (m + 1) % 2 (a run-time barrier index and TMA destination)
                                    # made dK/dV 1-3 ms slower at G = 16 (NOTES, "Session 56", v2)
                                    if m % 2 == 0:
                                        load_tile(Q, dO, Stats, q0, nb,
                                                  T.min(tile_tokens, n_toks - nb) * groups, tok_s, rtok_s,
                                                  rhead_s, tx, Q_s, dO_s, Q_v, dO_v, st_s, rowl,
                                                  headl, hk, rbar, 1, boxl)
                                    else:
                                        load_tile(Q, dO, Stats, q0, nb,
                                                  T.min(tile_tokens, n_toks - nb) * groups, tok_s, rtok_s,
                                                  rhead_s, tx, Q_s, dO_s, Q_v, dO_v, st_s, rowl,
                                                  headl, hk, rbar, 0, boxl)
                                    T.ptx_commit_group()
                            else:
                                if m > 0:
                                    load_tile(Q, dO, Stats, q0, m * tile_tokens,
                                              T.min(tile_tokens, n_toks - m * tile_tokens) * groups, tok_s, rtok_s,
                                              rhead_s, tx, Q_s, dO_s, Q_v, dO_v, st_s, rowl, headl, hk,
                                              rbar, 0, boxl)
                                    T.ptx_commit_group()
                                T.ptx_wait_group(0)
                                T.sync_threads()
                            base = m * tile_tokens
                            n_rows = T.min(tile_tokens, n_toks - base) * groups
                            compute(base, n_rows, full_rows, kb, shift, scale_log2, tok_s, rtok_s, K_s, V_s, pT,
                                    dsT, acc_sT, acc_dpT, acc_dk, acc_dv, Q_s, dO_s, st_s, off)
                            if not prefetch:
                                # the next group's load overwrites this group's buffer
                                T.sync_threads()
                        # the next slice overwrites tok_s
                        drain_gemms(acc_dk, acc_dv)
                        T.sync_threads()
                if split == 1:
                    for c, d in T.Parallel(BLOCK_N, D):
                        partial[kb, hk, piece, T.if_then_else(j == 0, 1, 0), 0, c, d] = acc_dk[c, d] * (
                            scale_log2 / LOG2E)
                        partial[kb, hk, piece, T.if_then_else(j == 0, 1, 0), 1, c, d] = acc_dv[c, d]
                else:
                    for c, d in T.Parallel(BLOCK_N, D):
                        if kb * BLOCK_N + c < len_k:
                            dK[k0 + kb * BLOCK_N + c, hk, d] = T.cast(acc_dk[c, d] * (scale_log2 / LOG2E), dtype)
                            dV[k0 + kb * BLOCK_N + c, hk, d] = T.cast(acc_dv[c, d], dtype)

    return sparse_attn_bwd_dkdv


def _bwd_dkdv_reduce(dtype, D, arch):
    """dK, dV of the first SPLIT_BLOCKS key blocks of the sequences of more than PIECE queries:
    the sums, in piece order, of the fp32 partials bwd_dkdv's pieces wrote (see its slots)."""
    accum = "float32"
    total_k = T.dynamic("total_k")
    heads_k = T.dynamic("heads_k")
    n_pieces = T.dynamic("n_pieces")
    batch_plus_one = T.dynamic("batch_plus_one")

    @T.prim_func
    def sparse_attn_bwd_dkdv_reduce(
        partial: T.Tensor([SPLIT_BLOCKS, heads_k, n_pieces, 2, 2, BLOCK_N, D], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        dK: T.Tensor([total_k, heads_k, D], dtype),
        dV: T.Tensor([total_k, heads_k, D], dtype),
        batch: T.int32,
        total_q: T.int32,
    ):
        with T.Kernel(SPLIT_BLOCKS, heads_k, batch, threads=128) as (kb, hk, b):
            acc_dk = T.alloc_fragment([BLOCK_N, D], accum)
            acc_dv = T.alloc_fragment([BLOCK_N, D], accum)
            q0, len_q = seq_span(cu_seqlens_q, b, total_q)  # as bwd_dkdv takes it
            k0, len_k = seq_span(cu_seqlens_k, b, total_k)
            if len_q > PIECE and kb * BLOCK_N < len_k:
                T.clear(acc_dk)
                T.clear(acc_dv)
                for j in T.serial((q0 + len_q - 1) // PIECE - q0 // PIECE + 1):
                    for c, d in T.Parallel(BLOCK_N, D):
                        acc_dk[c, d] += partial[kb, hk, q0 // PIECE + j, T.if_then_else(j == 0, 1, 0), 0, c, d]
                        acc_dv[c, d] += partial[kb, hk, q0 // PIECE + j, T.if_then_else(j == 0, 1, 0), 1, c, d]
                for c, d in T.Parallel(BLOCK_N, D):
                    if kb * BLOCK_N + c < len_k:
                        dK[k0 + kb * BLOCK_N + c, hk, d] = T.cast(acc_dk[c, d], dtype)
                        dV[k0 + kb * BLOCK_N + c, hk, d] = T.cast(acc_dv[c, d], dtype)

    return sparse_attn_bwd_dkdv_reduce
