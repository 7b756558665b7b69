"""select_blocks: stage 1 of InfLLM-V2, block scoring and top-K selection, fused.

For the query at position p of a sequence (bottom-right aligned, p = Lk - Lq + i), KV group g
with query heads h = g*G .. g*G + G - 1, fine compressed keys C1 (window W = 32, stride S = 16)
and normaliser keys N (the coarse keys C2, window 128 stride 64, or C1 itself for the exact
normaliser; window and stride of N are run-time ints):

    visible(j)   = j*S + W - 1 <= p                              (likewise for N)
    LSE_h        = log sum_{visible n} exp(scale * q_h . N[n])   (C1 if no N key is visible)
    S(p, j)      = sum_h exp(scale * q_h . C1[j] - LSE_h)        visible j only
    score(p, b)  = max S(p, j), j in 4b-1 .. 4b+3, visible       (-inf if none)
    forced       = b < init_blocks or p//64 - local_blocks <= b <= p//64   (score +inf)
    topk_idx[g, p, :] = the K best blocks b <= p//64 with score > -inf, ascending, -1 padded

Kernels:
  select_blocks   everything above, in one pass: grid (tiles, batch, Hk). Neither the
                  per-head scores, nor S, nor the block scores reach device memory.
  group_scores    S itself, (Hk, total_q, width) fp32, 0 where invisible: the scores path for
                  callers who want them (the original stage-1 kernel's output).
  max_pool_blocks pooling + forcing of given S into (Hk, total_q, n_blocks) fp32.

Tiling (select_blocks, group_scores). A tile is T consecutive tokens x the G heads of one KV
group = 64 GEMM rows (row r = token r // G, head r % G), as in sparse_attn. Pass 1 runs an
online log-sum-exp over the normaliser keys visible to the tile in chunks of 64 keys. Pass 2
multiplies the same rows with chunks of 64 fine keys (16 blocks), turns the logits into
probabilities in registers, sums each token's G rows (in registers with warp shuffles for G in
1, 2, 4, 8, 16, see GROUP_SUM_CUDA; through shared memory otherwise) and max-pools the sums into
a per-token block-score row in shared memory (in registers too for G = 16 and 8; the key 4b-1
of a chunk's first block comes from the previous chunk). Chunks every row of the tile sees
whole skip the per-element visibility mask (all but the last one or two of a causal tile). The
query tile lives in registers (the GEMMs' A operand, staged once through shared memory), key
chunks are single-buffered (see fetch) and, with D = 128, the probabilities of the other group
sizes reuse the chunk's memory, which keeps a tile at 52 KB of shared memory on sm_90a (44 KB on sm_80/sm_89): four
tiles share an H100 SM (three an A100's, two an sm_89's), and each hides the others' load and
GEMM latency. The pooling loops have compile-time trip counts and keep the
previous chunk's last column in a register, so that TileLang's barrier planner, which cannot
tell the run-time-strided score rows from the group sums, adds no barriers inside them.
Pass 2 stops before the keys of the last token's local window: from there on every block is
forced (or in the future) for every token of the tile. Measured on an H100 at 32K x 8 (G = 16,
K = 96), the kernel went from 26.3 (three tiles of 100 KB per SM) to 16.3 (72 KB), 14.4 (52 KB,
no barriers in the loops), 13.4 (the local window skipped), 12.1 (the query tile loaded
without run-time divisions), 11.0 (group sums in registers) and 10.6 ms (pooling in
registers: two barriers a chunk instead of four). Top-K then runs per
token, one warp per token: the scores are turned in place into their order-preserving uint32
images, an 8-bit radix select
(four histogram passes in shared memory, warp-aggregated atomics) finds the K-th best, and a
ballot/popcount pass writes the picks in ascending block order (ties at the K-th score go to
the lower block index). The host picks T = min(64 // G, T_MAX) and lowers it until T * n_blocks
block scores fit the arch's score cap (8192 floats on sm_90a, 6144 on sm_80/sm_89, whose
99 KB of shared memory per block hold less).
"""

import math

import tilelang.language as T

from dsl import EXP_NVCC_FLAGS
from dsl.group_rows import load_rows
from dsl.spans import seq_span

OP = "select_blocks"
NVCC_FLAGS = EXP_NVCC_FLAGS

FINE_W = 32  # fine compression window (DSL parameter; C1 must be compressed with it)
FINE_S = 16  # fine compression stride
BLOCK = 64  # selection block size, tokens
POOL = BLOCK // FINE_S  # fine keys per block; the pool window is POOL + 1 (padding 1)
BLOCK_M = 64  # GEMM rows per tile: T tokens x G heads
BN = 64  # compressed keys per GEMM chunk
P_PAD = 8  # extra floats per probability row (unaliased P_s): the fragment's stores would conflict 8 ways on 64
BPC = BN // POOL  # blocks per chunk
# Block scores a tile keeps in shared memory (T * n_blocks <= score cap): 128K keys = 2048
# blocks at T = 4 (G = 16) on sm_90a; 8.6/8.9's 99 KB per block leave room for 6144.
SCORE_CAP_BY_ARCH = {"sm_90a": 8192}
SCORE_CAP_DEFAULT = 6144
TILES_PER_SM_BY_ARCH = {"sm_90a": 4, "sm_80": 3}
T_MAX = 16  # tokens per tile at most (bounds the group-sum buffer; G < 4 leaves rows idle)
THREADS = 128
POOL_STEPS = -(-T_MAX * BPC // THREADS)  # strides of the pooling loop over a tile's (token, block)s
WARPS = THREADS // 32
UNROLL = 4  # block scores per lane per step of the top-K passes
LOG2E = math.log2(math.e)
NEG_INF = float("-inf")
# order-preserving uint32 image of -inf: bits 0xFF800000 flipped
KEY_NEG_INF = 0x007FFFFF

KERNELS = ("select_blocks", "group_scores")
VARIANTS = [
    {"kernel": kernel, "dtype": dtype, "head_dim": head_dim}
    for kernel in KERNELS
    for dtype in ("bfloat16", "float16")
    for head_dim in (64, 128)
] + [{"kernel": "max_pool_blocks", "dtype": "float32", "head_dim": 0}]


def variant_name(kernel, dtype, head_dim):
    if kernel == "max_pool_blocks":
        return kernel
    short = {"bfloat16": "bf16", "float16": "fp16"}[dtype]
    return f"{kernel}_{short}_d{head_dim}"


def pass_configs(kernel, dtype, head_dim, arch):
    # The block-score and top-K code indexes by thread and by warp; warp specialisation would
    # add a producer warpgroup that TileLang's index simplification does not account for
    # (see sparse_attn.pass_configs).
    from tilelang import PassConfigKey

    return {PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


def unit_constants(kernel, dtype, head_dim, arch):
    return {"block_m": BLOCK_M, "score_cap": _score_cap(arch), "t_max": T_MAX, "fine_w": FINE_W, "fine_s": FINE_S,
            "block": BLOCK}


def _score_cap(arch):
    return SCORE_CAP_BY_ARCH.get(arch, SCORE_CAP_DEFAULT)


def program(kernel, dtype, head_dim, arch):
    if kernel == "max_pool_blocks":
        return _max_pool_blocks()
    return _scoring(kernel, dtype, head_dim, arch)


def _n_visible(p_last, n, window, stride):
    """How many of n compressed keys (window, stride) the position p_last sees."""
    return T.if_then_else(p_last >= window - 1, T.min(n, (p_last - window + 1) // stride + 1), 0)


# TileLang 0.1.15 cannot software-pipeline a loop with a run-time trip count (the cp.async wait
# of the epilogue must be a constant: codegen aborts "Downcast from tirx.Sub to ir.IntImm"), so
# chunks are fetched by hand. One buffer, not two: a second 16 KB buffer (measured) costs the
# SM its third resident tile, which hides the load better than the tile's own prefetch did.


@T.macro
def fetch(keys, key0, hk, ch, K_s):
    """Loads chunk ch (rows past the keys zero-filled); every thread must be done with the
    previous chunk (the loops end with a barrier)."""
    T.async_copy(keys[key0 + ch * BN : key0 + (ch + 1) * BN, hk, :], K_s)
    T.ptx_wait_group(0)
    T.sync_threads()


@T.macro
def lse_pass(keys, key0, lo, hi, n_vis, n_vis0, norm_window, norm_stride, hk, rowpos, scale_log2, Q_f, K_s, acc_s,
             m_run, l_run, m_prev, m_safe, r_scale, r_sum):
    """Online log-sum-exp, per tile row, over chunks [lo, hi) of the `n_vis` compressed keys
    starting at row `key0` of `keys` that the tile sees, masking per row by the window rule
    (n_vis0: the keys the tile's first token sees; chunks within them need no mask). Leaves the
    row max (in logits) in m_run and the sum of exp2((logit - max) * scale_log2) in l_run (0:
    nothing visible). select_blocks runs all chunks, select_decode a split's range."""
    T.fill(m_run, NEG_INF)
    T.fill(l_run, 0)
    for ch in T.serial(hi - lo):
        fetch(keys, key0, hk, lo + ch, K_s)
        T.clear(acc_s)
        T.gemm(Q_f, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
        if (lo + ch + 1) * BN > n_vis0:
            for r, c in T.Parallel(BLOCK_M, BN):
                acc_s[r, c] = T.if_then_else(
                    (lo + ch) * BN + c < n_vis and ((lo + ch) * BN + c) * norm_stride + norm_window - 1 <= rowpos[r],
                    acc_s[r, c],
                    NEG_INF,
                )
        T.copy(m_run, m_prev)
        T.reduce_max(acc_s, m_run, dim=1, clear=False)
        for r in T.Parallel(BLOCK_M):
            m_safe[r] = T.if_then_else(m_run[r] == NEG_INF, 0, m_run[r])
            r_scale[r] = T.exp2((m_prev[r] - m_safe[r]) * scale_log2)
        for r, c in T.Parallel(BLOCK_M, BN):
            acc_s[r, c] = T.exp2((acc_s[r, c] - m_safe[r]) * scale_log2)
        T.reduce_sum(acc_s, r_sum, dim=1)
        for r in T.Parallel(BLOCK_M):
            l_run[r] = l_run[r] * r_scale[r] + r_sum[r]
        T.sync_threads()  # every thread is done with this buffer before the next request refills it


def _rows_sum(P_s, r0, c, n):
    """P_s[r0, c] + ... + P_s[r0 + n - 1, c] as one balanced expression (n a Python int)."""
    if n == 1:
        return P_s[r0, c]
    return _rows_sum(P_s, r0, c, n // 2) + _rows_sum(P_s, r0 + n // 2, c, n - n // 2)


# A token's G rows of the GEMM accumulator are summed in registers, by a CUDA helper that TileLang
# emits into the kernel's source: its fragment abstraction has no way to say "add the value that
# lane l ^ m holds for the same element", which is what the sum needs.
#
# Layout (wgmma m64nNk16 on sm_90a; mma.m16n8k16 with a 16-row slab per warp under FullRow
# elsewhere): element i of lane l of warp w is row 16w + l/4 + 8*((i >> 1) & 1), column
# 8*(i >> 2) + 2*(l & 3) + (i & 1). Rows of one token (r // G) are lanes differing in the low
# log2(G) bits of l/4 (and, for G = 16, the two row halves of a thread). A butterfly over those
# lane bits in which each step hands half of the columns to the partner and keeps the other half
# ("transpose-reduce") leaves each lane with whole sums of 16 >> bits columns: 14 shuffles for
# G = 16, against writing the 16 KB of probabilities to shared memory and reading them back,
# which with two barriers around it was the shared-memory pipe's largest load.
GROUP_SUM_CUDA = r"""
template <int CNT, int J>
__device__ __forceinline__ void infllmv2_group_sum_step(float* s, int lane) {
  if constexpr (J >= 0) {
    const bool up = (lane >> (2 + J)) & 1;
#pragma unroll
    for (int k = 0; k < CNT / 2; ++k) {
      const float send = up ? s[k] : s[k + CNT / 2];
      const float keep = up ? s[k + CNT / 2] : s[k];
      s[k] = keep + __shfl_xor_sync(0xffffffffu, send, 4 << J);
    }
    infllmv2_group_sum_step<CNT / 2, J - 1>(s, lane);
  }
}

// lane bits (of l / 4) that tell a token's rows apart; G = 16 also folds the two row halves
template <int G>
__device__ __forceinline__ constexpr int infllmv2_group_bits() { return G >= 8 ? 3 : G == 4 ? 2 : G == 2 ? 1 : 0; }

// s[2n + b] = the sum over token (16w + 8h + l/4) / G's rows of column 8n + 2(l & 3) + b; the
// steps pair n's top bits with lane bits 2 + j. Leaves 16 >> BITS of them in s.
template <int G>
__device__ __forceinline__ void infllmv2_group_reduce(const float* acc, float* s, int lane, int h) {
  constexpr int BITS = infllmv2_group_bits<G>();
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const int n = i >> 1, b = i & 1;
    s[i] = G == 16 ? acc[4 * n + b] + acc[4 * n + 2 + b] : acc[4 * n + 2 * h + b];
  }
  infllmv2_group_sum_step<16, BITS - 1>(s, lane);
}

// gs[t * 64 + c] = token t's group sum of column c, for t < n_tok
template <int G>
__device__ __forceinline__ void infllmv2_group_sum(const float* acc, float* gs, int n_tok) {
  constexpr int BITS = infllmv2_group_bits<G>();
  constexpr int KEEP = 16 >> BITS;
  const int lane = threadIdx.x & 31;
  const int warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int h = 0; h < (G == 16 ? 1 : 2); ++h) {
    float s[16];
    infllmv2_group_reduce<G>(acc, s, lane, h);
    const int tok = (16 * warp + 8 * h + (lane >> 2)) / G;
    if (tok < n_tok) {
      const int n0 = (KEEP / 2) * ((lane >> 2) & ((1 << BITS) - 1));
#pragma unroll
      for (int m = 0; m < KEEP / 2; ++m)
        *reinterpret_cast<float2*>(gs + tok * 64 + 8 * (n0 + m) + 2 * (lane & 3)) = make_float2(s[2 * m], s[2 * m + 1]);
    }
  }
}

// G = 16 or 8: after the reduction lane l holds columns 2l and 2l + 1 of its token, so the
// pooling needs no shared memory either. Block blk0 + j takes columns 4j - 1 .. 4j + 3 (column
// -1 is the previous chunk's last, carried per row half in carry[h]); visible blocks of tokens
// t < n_tok go to sc[t * stride + block].
template <int G>
__device__ __forceinline__ void infllmv2_group_pool(const float* acc, float* sc, int stride, int n_tok, int blk0,
                                                   int p0, float* carry) {
  static_assert(G == 16 || G == 8, "the lanes hold whole columns for G = 16 and 8 only");
  const int lane = threadIdx.x & 31;
  const int warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int h = 0; h < (G == 16 ? 1 : 2); ++h) {
    float s[16];
    infllmv2_group_reduce<G>(acc, s, lane, h);
    const float m = fmaxf(s[0], s[1]);
    const float quad = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    const float left = __shfl_up_sync(0xffffffffu, s[1], 1);
    const float prev = lane == 0 ? carry[h] : left;
    carry[h] = __shfl_sync(0xffffffffu, s[1], 31);
    const int tok = (16 * warp + 8 * h) / G;
    const int blk = blk0 + (lane >> 1);
    if ((lane & 1) == 0 && tok < n_tok && blk <= (p0 + tok) / 64 && blk < stride)
      sc[tok * stride + blk] = fmaxf(quad, prev);
  }
}

// the block after the last chunk sees only that chunk's last column
template <int G>
__device__ __forceinline__ void infllmv2_group_pool_tail(float* sc, int stride, int n_tok, int blk, int p0,
                                                        const float* carry) {
  const int lane = threadIdx.x & 31;
  const int warp = (threadIdx.x >> 5) & 3;
#pragma unroll
  for (int h = 0; h < (G == 16 ? 1 : 2); ++h) {
    const int tok = (16 * warp + 8 * h) / G;
    if (lane == 0 && tok < n_tok && blk <= (p0 + tok) / 64 && blk < stride) sc[tok * stride + blk] = carry[h];
  }
}
"""


assert BLOCK_M == 64 and BN == 64 and BLOCK == 64 and POOL == 4, "GROUP_SUM_CUDA assumes this tiling"


def _group_sum_regs(g, acc_s, GS_s, n_tok):
    """GS_s[t, :] = the sum of token t's g rows of acc_s (for t < n_tok), see GROUP_SUM_CUDA."""
    return T.call_extern("handle", f"infllmv2_group_sum<{g}>", acc_s.data, T.address_of(GS_s[0, 0]), n_tok)


def _group_pool_regs(g, acc_s, SC_s, score_stride, n_tok, blk0, p0, carry):
    """The block scores of a chunk straight from acc_s, for g = 16 or 8 (see GROUP_SUM_CUDA)."""
    return T.call_extern("handle", f"infllmv2_group_pool<{g}>", acc_s.data, T.address_of(SC_s[0]), score_stride,
                         n_tok, blk0, p0, carry.data)


def _group_pool_tail(g, SC_s, score_stride, n_tok, blk, p0, carry):
    return T.call_extern("handle", f"infllmv2_group_pool_tail<{g}>", T.address_of(SC_s[0]), score_stride, n_tok,
                         blk, p0, carry.data)


def _scoring(kernel, dtype, D, arch):
    SCORE_CAP = _score_cap(arch)
    # the tiles whose shared memory (D = 128: about 52 KB on sm_90a, 44 KB elsewhere) fits an SM
    # (228, 164, 100 KB); the launch bound holds ptxas to the registers that many need
    TILES_PER_SM = TILES_PER_SM_BY_ARCH.get(arch, 2)
    accum = "float32"
    total_q = T.dynamic("total_q")
    total_c = T.dynamic("total_c")
    total_n = T.dynamic("total_n")
    heads = T.dynamic("heads")
    heads_k = T.dynamic("heads_k")
    batch_plus_one = T.dynamic("batch_plus_one")
    select = kernel == "select_blocks"
    ALIAS_P = BN * D * 2 == BLOCK_M * BN * 4  # 16-bit keys, D = 128: the chunk's bytes
    # output: topk_idx (Hk, total_q, topk) int32, or S (Hk, total_q, width) fp32
    out_cols = T.dynamic("topk") if select else T.dynamic("width")
    out_dtype = "int32" if select else accum
    if select:
        top_k = _make_top_k(out_cols)

    @T.macro
    def group_sums(acc_s, P_s, GS_s, n_tok, groups, tx):
        """GS_s[t, c] = the sum of token t's G rows of the probabilities in acc_s."""
        gsum = T.alloc_var(accum)
        if groups == 16:
            _group_sum_regs(16, acc_s, GS_s, n_tok)
        elif groups == 8:
            _group_sum_regs(8, acc_s, GS_s, n_tok)
        elif groups == 4:
            _group_sum_regs(4, acc_s, GS_s, n_tok)
        elif groups == 2:
            _group_sum_regs(2, acc_s, GS_s, n_tok)
        elif groups == 1:
            _group_sum_regs(1, acc_s, GS_s, n_tok)
        else:
            # other group sizes: through shared memory, G a run-time int
            if ALIAS_P:
                T.sync_threads()  # every warp's GEMM is done reading K_s
            for r, c in T.Parallel(BLOCK_M, BN):
                P_s[r, c] = acc_s[r, c]
            T.sync_threads()
            for e in T.serial(T.ceildiv(n_tok * BN, THREADS)):
                if e * THREADS + tx < n_tok * BN:
                    gsum = 0
                    # four independent loads per step
                    for h4 in T.serial(groups // 4):
                        gsum += (
                            _rows_sum(P_s, ((e * THREADS + tx) // BN) * groups + h4 * 4, (e * THREADS + tx) % BN, 2)
                            + _rows_sum(P_s, ((e * THREADS + tx) // BN) * groups + h4 * 4 + 2,
                                        (e * THREADS + tx) % BN, 2)
                        )
                    for h in T.serial(groups % 4):
                        gsum += _rows_sum(P_s, ((e * THREADS + tx) // BN) * groups + (groups // 4) * 4 + h,
                                          (e * THREADS + tx) % BN, 1)
                    GS_s[(e * THREADS + tx) // BN, (e * THREADS + tx) % BN] = gsum

    @T.macro
    def tile_scores(Q, CK, NK, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, cu_seqlens_n, Out, groups,
                    tile_tokens, score_stride, init_blocks, local_blocks, norm_window, norm_stride, approx,
                    scale_log2, bx, b, hk):
        # the query tile: loaded through shared memory (16-byte rows; as a fragment each thread's
        # scattered elements would each divide by the run-time G), then kept in registers
        Q_s = T.alloc_shared([BLOCK_M, D], dtype)
        Q_f = T.alloc_fragment([BLOCK_M, D], dtype)
        K_s = T.alloc_shared([BN, D], dtype)
        if ALIAS_P:
            # the probabilities overwrite the key chunk the GEMM has just read (a barrier
            # between them): 16 KB less per tile, so four tiles share an H100 SM instead of
            # three. The view inherits K_s's swizzled layout, which also spreads the stores
            # over the banks.
            P_s = T.view(K_s, [BLOCK_M, BN], accum)
        else:
            P_s = T.alloc_shared([BLOCK_M, BN + P_PAD], accum)
        # a chunk's group sums per token; the thread pooling a token's first block of a chunk
        # keeps the chunk's last column in a register for the next chunk (as a shared carry it
        # would need a copy and two barriers per chunk)
        GS_s = T.alloc_shared([T_MAX, BN], accum)
        last_r = T.alloc_local([POOL_STEPS], accum)
        pool_r = T.alloc_local([POOL_STEPS], accum)
        carry = T.alloc_local([2], accum)  # per row half: the last group-sum column of the previous chunk
        acc_s = T.alloc_fragment([BLOCK_M, BN], accum)
        m_run = T.alloc_fragment([BLOCK_M], accum)
        l_run = T.alloc_fragment([BLOCK_M], accum)
        m_fine = T.alloc_fragment([BLOCK_M], accum)
        l_fine = T.alloc_fragment([BLOCK_M], accum)
        m_prev = T.alloc_fragment([BLOCK_M], accum)
        m_safe = T.alloc_fragment([BLOCK_M], accum)
        r_scale = T.alloc_fragment([BLOCK_M], accum)
        r_sum = T.alloc_fragment([BLOCK_M], accum)
        lse2 = T.alloc_fragment([BLOCK_M], accum)
        rowpos = T.alloc_fragment([BLOCK_M], "int32")
        if select:
            SC_s = T.alloc_shared([SCORE_CAP], accum)
            hist_s = T.alloc_shared([WARPS, 256], "int32")
            st_s = T.alloc_shared([WARPS, 2], "int32")
            rs = T.alloc_local([8], "int32")  # radix-select registers, see below
            ru = T.alloc_local([4], "uint32")
            kk = T.alloc_local([UNROLL], "uint32")
            bins = T.alloc_local([UNROLL], "int32")

        tx = T.get_thread_binding()
        q0, len_q = seq_span(cu_seqlens_q, b, Q.shape[0])
        # the keys' offsets give positions only: every loop runs over the compressed keys' spans
        len_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
        c0, n_c = seq_span(cu_seqlens_c, b, CK.shape[0])
        nk0, n_n = seq_span(cu_seqlens_n, b, NK.shape[0])
        t0 = bx * tile_tokens
        n_tok = T.max(T.min(tile_tokens, len_q - t0), 0)
        n_rows = n_tok * groups
        p0 = len_k - len_q + t0
        p_last = p0 + n_tok - 1

        if n_tok > 0:
            # (dsl.group_rows) before it divided each row by the run-time G per 16-byte load, with
            # one load in flight at a time: 15% of the stall samples. H100, 32K x 8, G = 16:
            # 12.85 -> 12.14 ms (torch profiler, library against library).
            load_rows(Q, Q_s, q0 + t0, hk, n_tok, groups)
            T.copy(Q_s, Q_f)
            T.sync_threads()  # Q_s's memory may be reused by later buffers (TileLang merges them)
            # each row's query position, -1 for unused rows (sees nothing): computed once, as
            # the masks would otherwise divide by the run-time group size per element
            for r in T.Parallel(BLOCK_M):
                rowpos[r] = T.if_then_else(r < n_rows, p0 + r // groups, -1)
            # pass 1: the normaliser
            lse_pass(NK, nk0, 0, T.ceildiv(_n_visible(p_last, n_n, norm_window, norm_stride), BN),
                     _n_visible(p_last, n_n, norm_window, norm_stride), _n_visible(p0, n_n, norm_window, norm_stride),
                     norm_window, norm_stride, hk, rowpos, scale_log2, Q_f, K_s, acc_s, m_run, l_run, m_prev, m_safe,
                     r_scale, r_sum)
            for r in T.Parallel(BLOCK_M):
                lse2[r] = m_run[r] * scale_log2 + T.log2(l_run[r])
            if approx != 0 and p0 < norm_window - 1:
                # rows too early to see a coarse key use the exact normaliser (as the reference)
                lse_pass(CK, c0, 0, T.ceildiv(_n_visible(T.min(p_last, norm_window - 2), n_c, FINE_W, FINE_S), BN),
                         _n_visible(T.min(p_last, norm_window - 2), n_c, FINE_W, FINE_S),
                         _n_visible(T.min(p0, norm_window - 2), n_c, FINE_W, FINE_S), FINE_W, FINE_S,
                         hk, rowpos, scale_log2, Q_f, K_s, acc_s, m_fine, l_fine, m_prev, m_safe, r_scale, r_sum)
                for r in T.Parallel(BLOCK_M):
                    if l_run[r] == 0:
                        lse2[r] = m_fine[r] * scale_log2 + T.log2(l_fine[r])

            n_fine = _n_visible(p_last, n_c, FINE_W, FINE_S)
            n_fine0 = _n_visible(p0, n_c, FINE_W, FINE_S)  # seen by the tile's first token
            if select:
                for e in T.serial(T.ceildiv(n_tok * score_stride, THREADS)):
                    if e * THREADS + tx < n_tok * score_stride:
                        SC_s[e * THREADS + tx] = NEG_INF
            for e in T.unroll(POOL_STEPS):
                last_r[e] = NEG_INF
            carry[0] = NEG_INF
            carry[1] = NEG_INF
            if select:
                # blocks from the last token's local window on are forced for every token of the
                # tile (or in a token's future), so their scores are never read: the chunks that
                # hold only their keys (the last two or so, the masked ones) are not computed.
                # Block b needs keys 4b-1 .. 4b+3, so the first local_blocks-free blocks need
                # POOL * (last block - local_blocks) keys.
                n_load = T.ceildiv(T.min(n_fine, T.max(p_last // BLOCK - local_blocks, 0) * POOL), BN)
            else:
                n_load = T.ceildiv(n_fine, BN)
            n_chunks = n_load if select else T.ceildiv(out_cols, BN)

            # pass 2: probabilities, group sums, block pooling (or the sums themselves)
            for ch in T.serial(n_chunks):
                if ch < n_load:
                    fetch(CK, c0, hk, ch, K_s)
                    T.clear(acc_s)
                    T.gemm(Q_f, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if (ch + 1) * BN <= n_fine0:
                        # rows past the tile's tokens get values too; no group sum reads them
                        for r, c in T.Parallel(BLOCK_M, BN):
                            acc_s[r, c] = T.exp2(acc_s[r, c] * scale_log2 - lse2[r])
                    else:
                        for r, c in T.Parallel(BLOCK_M, BN):
                            # invisible columns get -inf so that a token's group sum is -inf there
                            acc_s[r, c] = T.if_then_else(
                                ch * BN + c < n_fine and (ch * BN + c) * FINE_S + FINE_W - 1 <= rowpos[r],
                                T.exp2(acc_s[r, c] * scale_log2 - lse2[r]),
                                NEG_INF,
                            )
                    if select:
                        # G = 16 and 8 pool in registers too: no group-sum buffer, two barriers fewer
                        if groups == 16:
                            _group_pool_regs(16, acc_s, SC_s, score_stride, n_tok, ch * BPC, p0, carry)
                        elif groups == 8:
                            _group_pool_regs(8, acc_s, SC_s, score_stride, n_tok, ch * BPC, p0, carry)
                        else:
                            group_sums(acc_s, P_s, GS_s, n_tok, groups, tx)
                            T.sync_threads()
                            # all reads of GS_s, then all writes of SC_s: TileLang cannot tell the two
                            # apart (SC_s rows have a run-time stride) and would put barriers between them
                            for e in T.unroll(POOL_STEPS):
                                if e * THREADS + tx < n_tok * BPC:
                                    pool_r[e] = T.max(
                                        T.max(T.max(T.if_then_else((e * THREADS + tx) % BPC == 0, last_r[e],
                                                                   GS_s[(e * THREADS + tx) // BPC,
                                                                        T.max(((e * THREADS + tx) % BPC) * POOL - 1, 0)]),
                                                    GS_s[(e * THREADS + tx) // BPC, ((e * THREADS + tx) % BPC) * POOL]),
                                              T.max(GS_s[(e * THREADS + tx) // BPC, ((e * THREADS + tx) % BPC) * POOL + 1],
                                                    GS_s[(e * THREADS + tx) // BPC, ((e * THREADS + tx) % BPC) * POOL + 2])),
                                        GS_s[(e * THREADS + tx) // BPC, ((e * THREADS + tx) % BPC) * POOL + 3],
                                    )
                                    if (e * THREADS + tx) % BPC == 0:
                                        last_r[e] = GS_s[(e * THREADS + tx) // BPC, BN - 1]
                            for e in T.unroll(POOL_STEPS):
                                if e * THREADS + tx < n_tok * BPC:
                                    t = (e * THREADS + tx) // BPC
                                    bb = (e * THREADS + tx) % BPC
                                    # score_stride bounds the row even if the host's max_seqlen_k was too small
                                    if ch * BPC + bb <= (p0 + t) // BLOCK and ch * BPC + bb < score_stride:
                                        SC_s[t * score_stride + ch * BPC + bb] = pool_r[e]
                    else:
                        group_sums(acc_s, P_s, GS_s, n_tok, groups, tx)
                    T.sync_threads()
                if not select:
                    for e in T.serial(T.ceildiv(n_tok * BN, THREADS)):
                        if e * THREADS + tx < n_tok * BN and ch * BN + (e * THREADS + tx) % BN < out_cols:
                            Out[hk, q0 + t0 + (e * THREADS + tx) // BN, ch * BN + (e * THREADS + tx) % BN] = T.if_then_else(
                                ch * BN < n_fine,
                                T.max(GS_s[(e * THREADS + tx) // BN, (e * THREADS + tx) % BN], 0),
                                0,
                            )
                # no barrier: the next chunk's fetch has one before anything here is overwritten

            if select:
                # the block after the last chunk sees only that chunk's last key
                if groups == 16:
                    _group_pool_tail(16, SC_s, score_stride, n_tok, n_chunks * BPC, p0, carry)
                elif groups == 8:
                    _group_pool_tail(8, SC_s, score_stride, n_tok, n_chunks * BPC, p0, carry)
                else:
                    for e in T.unroll(POOL_STEPS):
                        if e * THREADS + tx < n_tok * BPC and (e * THREADS + tx) % BPC == 0:
                            if (n_chunks * BPC <= (p0 + (e * THREADS + tx) // BPC) // BLOCK
                                    and n_chunks * BPC < score_stride):
                                SC_s[((e * THREADS + tx) // BPC) * score_stride + n_chunks * BPC] = last_r[e]
                T.sync_threads()
                top_k(Out, SC_s, hist_s, st_s, rs, ru, kk, bins, tx, hk, q0 + t0, n_tok, p0, score_stride,
                      init_blocks, local_blocks)

    if select:

        @T.prim_func
        def select_blocks(
            Q: T.Tensor([total_q, heads, D], dtype),
            CK: T.Tensor([total_c, heads_k, D], dtype),
            NK: T.Tensor([total_n, heads_k, D], dtype),
            cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
            cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
            cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
            cu_seqlens_n: T.Tensor([batch_plus_one], "int32"),
            topk_idx: T.Tensor([heads_k, total_q, out_cols], out_dtype),
            batch: T.int32,
            max_tiles: T.int32,
            groups: T.int32,
            tile_tokens: T.int32,
            score_stride: T.int32,
            init_blocks: T.int32,
            local_blocks: T.int32,
            norm_window: T.int32,
            norm_stride: T.int32,
            approx: T.int32,
            scale_log2: T.float32,
        ):
            with T.Kernel(max_tiles, batch, heads_k, threads=THREADS) as (bx, b, hk):
                T.import_source(GROUP_SUM_CUDA)
                T.annotate_min_blocks_per_sm(TILES_PER_SM)
                tile_scores(Q, CK, NK, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, cu_seqlens_n, topk_idx, groups,
                            tile_tokens, score_stride, init_blocks, local_blocks, norm_window, norm_stride, approx,
                            scale_log2, bx, b, hk)

        return select_blocks

    @T.prim_func
    def group_scores(
        Q: T.Tensor([total_q, heads, D], dtype),
        CK: T.Tensor([total_c, heads_k, D], dtype),
        NK: T.Tensor([total_n, heads_k, D], dtype),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_n: T.Tensor([batch_plus_one], "int32"),
        S: T.Tensor([heads_k, total_q, out_cols], out_dtype),
        batch: T.int32,
        max_tiles: T.int32,
        groups: T.int32,
        tile_tokens: T.int32,
        norm_window: T.int32,
        norm_stride: T.int32,
        approx: T.int32,
        scale_log2: T.float32,
    ):
        with T.Kernel(max_tiles, batch, heads_k, threads=THREADS) as (bx, b, hk):
            T.import_source(GROUP_SUM_CUDA)
            tile_scores(Q, CK, NK, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, cu_seqlens_n, S, groups,
                        tile_tokens, 0, 0, 0, norm_window, norm_stride, approx, scale_log2, bx, b, hk)

    return group_scores


@T.macro
def key_into(ru, SC_s, base, blk, qb, init_blocks, local_blocks):
    # forced blocks score +inf; the key is the order-preserving uint32 image of the score
    ru[2] = T.reinterpret(
        T.if_then_else(
            blk < init_blocks or (blk >= qb - local_blocks and blk <= qb),
            T.float32(float("inf")),
            # NaN (from non-finite inputs) ranks as -inf, as in the reference
            T.if_then_else(SC_s[base + blk] != SC_s[base + blk], T.float32(NEG_INF), SC_s[base + blk]),
        ),
        "uint32",
    )
    ru[2] = T.if_then_else((ru[2] >> T.uint32(31)) != T.uint32(0), ~ru[2], ru[2] | T.uint32(0x80000000))


def _make_top_k(topk):
    """A macro: per token (one warp each), the topk best of its block scores, ascending, -1 padded.

    topk is closed over (a dynamic shape var passed into a macro becomes a new kernel parameter).
    rs/ru are per-thread registers: rs = [count, k_left, pos, eq_seen, bin, lane count, suffix,
    scratch], ru = [prefix, mask, key, threshold]."""

    @T.macro
    def top_k(topk_idx, SC_s, hist_s, st_s, rs, ru, kk, bins, tx, hk, row0, n_tok, p0, score_stride, init_blocks,
              local_blocks):
        warp = tx // 32
        lane = tx % 32
        below = (T.uint32(1) << T.cast(lane, "uint32")) - T.uint32(1)
        for rnd in T.serial(T.ceildiv(n_tok, WARPS)):
            if rnd * WARPS + warp < n_tok:
                t = rnd * WARPS + warp
                qb = (p0 + t) // BLOCK
                nbt = T.min(qb + 1, score_stride)
                # the scores become their keys in place, once, and the candidates are counted
                rs[0] = 0
                for i in T.serial(T.ceildiv(nbt, 32)):
                    if i * 32 + lane < nbt:
                        key_into(ru, SC_s, t * score_stride, i * 32 + lane, qb, init_blocks, local_blocks)
                        SC_s[t * score_stride + i * 32 + lane] = T.reinterpret(ru[2], "float32")
                        if ru[2] > T.uint32(KEY_NEG_INF):
                            rs[0] += 1
                rs[0] = T.warp_reduce_sum(rs[0])
                T.sync_warp()
                # selection rule: key > threshold, or key == threshold among the first k_left such
                ru[3] = T.uint32(KEY_NEG_INF)
                rs[1] = 0
                if rs[0] > topk:
                    ru[0] = T.uint32(0)
                    ru[1] = T.uint32(0)
                    rs[1] = topk
                    for dgt in T.serial(4):
                        for q in T.serial(8):
                            hist_s[warp, lane * 8 + q] = 0
                        T.sync_warp()
                        # UNROLL elements per lane at once: independent loads in flight
                        for i in T.serial(T.ceildiv(nbt, 32 * UNROLL)):
                            for u in T.unroll(UNROLL):
                                kk[u] = T.reinterpret(
                                    SC_s[t * score_stride + T.min((i * UNROLL + u) * 32 + lane, nbt - 1)], "uint32")
                                # lanes without an element use bin 256 (match_any needs every lane)
                                bins[u] = T.if_then_else(
                                    (i * UNROLL + u) * 32 + lane < nbt and kk[u] > T.uint32(KEY_NEG_INF)
                                    and (kk[u] & ru[1]) == ru[0],
                                    T.cast((kk[u] >> T.cast(24 - 8 * dgt, "uint32")) & T.uint32(255), "int32"),
                                    256,
                                )
                            for u in T.unroll(UNROLL):
                                # most scores share their top bits: lanes with equal bins add once
                                rs[4] = T.cast(T.match_any_sync(bins[u]), "int32")
                                if bins[u] < 256 and T.popcount(T.cast(rs[4], "uint32") & below) == 0:
                                    T.atomic_add(hist_s[warp, bins[u]], T.popcount(T.cast(rs[4], "uint32")))
                        T.sync_warp()
                        rs[5] = 0
                        for q in T.serial(8):
                            rs[5] += hist_s[warp, lane * 8 + q]
                        # inclusive suffix sum over lanes: the bins above a lane's bins are higher lanes'
                        rs[6] = rs[5]
                        for s in T.serial(5):
                            rs[7] = T.shfl_down(rs[6], 1 << s)
                            if lane + (1 << s) < 32:
                                rs[6] += rs[7]
                        if rs[6] - rs[5] < rs[1] and rs[1] <= rs[6]:
                            rs[7] = rs[6] - rs[5]
                            rs[4] = -1
                            for q in T.serial(8):
                                if rs[4] < 0:
                                    if rs[7] + hist_s[warp, lane * 8 + 7 - q] >= rs[1]:
                                        rs[4] = lane * 8 + 7 - q
                                        st_s[warp, 0] = rs[4]
                                        st_s[warp, 1] = rs[1] - rs[7]
                                    else:
                                        rs[7] += hist_s[warp, lane * 8 + 7 - q]
                        T.sync_warp()
                        rs[1] = st_s[warp, 1]
                        ru[0] = ru[0] | (T.cast(st_s[warp, 0], "uint32") << T.cast(24 - 8 * dgt, "uint32"))
                        ru[1] = ru[1] | (T.uint32(255) << T.cast(24 - 8 * dgt, "uint32"))
                        T.sync_warp()
                    ru[3] = ru[0]
                # ordered output: ballots give each pick its slot
                rs[2] = 0
                rs[3] = 0
                for i in T.serial(T.ceildiv(nbt, 32 * UNROLL)):
                    for u in T.unroll(UNROLL):
                        kk[u] = T.if_then_else(
                            (i * UNROLL + u) * 32 + lane < nbt,
                            T.reinterpret(SC_s[t * score_stride + T.min((i * UNROLL + u) * 32 + lane, nbt - 1)],
                                          "uint32"),
                            T.uint32(0),
                        )
                    for u in T.unroll(UNROLL):
                        rs[4] = T.cast(
                            T.ballot_sync(kk[u] == ru[3] and kk[u] > T.uint32(KEY_NEG_INF)), "int32")
                        rs[5] = T.if_then_else(
                            kk[u] > ru[3]
                            or (kk[u] == ru[3] and kk[u] > T.uint32(KEY_NEG_INF)
                                and rs[3] + T.popcount(T.cast(rs[4], "uint32") & below) < rs[1]),
                            1, 0)
                        rs[6] = T.cast(T.ballot_sync(rs[5] != 0), "int32")
                        if rs[5] != 0:
                            topk_idx[hk, row0 + t, rs[2] + T.popcount(T.cast(rs[6], "uint32") & below)] = (
                                (i * UNROLL + u) * 32 + lane)
                        rs[2] += T.popcount(T.cast(rs[6], "uint32"))
                        rs[3] += T.popcount(T.cast(rs[4], "uint32"))
                for i in T.serial(T.ceildiv(topk, 32)):
                    if i * 32 + lane >= rs[2] and i * 32 + lane < topk:
                        topk_idx[hk, row0 + t, i * 32 + lane] = -1

    return top_k


def _max_pool_blocks():
    accum = "float32"
    total_q = T.dynamic("total_q")
    heads_k = T.dynamic("heads_k")
    width = T.dynamic("width")
    n_blocks = T.dynamic("n_blocks")
    batch_plus_one = T.dynamic("batch_plus_one")
    ROWS = 4

    @T.prim_func
    def max_pool_blocks(
        S: T.Tensor([heads_k, total_q, width], accum),
        cu_seqlens_q: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_k: T.Tensor([batch_plus_one], "int32"),
        cu_seqlens_c: T.Tensor([batch_plus_one], "int32"),
        B: T.Tensor([heads_k, total_q, n_blocks], accum),
        batch: T.int32,
        max_seqlen_q: T.int32,
        init_blocks: T.int32,
        local_blocks: T.int32,
    ):
        with T.Kernel(T.ceildiv(max_seqlen_q, ROWS), batch, heads_k, threads=THREADS) as (bx, b, hk):
            tx = T.get_thread_binding()
            m = T.alloc_local([1], accum)
            q0, len_q = seq_span(cu_seqlens_q, b, total_q)
            len_k = cu_seqlens_k[b + 1] - cu_seqlens_k[b]
            n_c = T.min(cu_seqlens_c[b + 1] - cu_seqlens_c[b], width)
            nb = T.ceildiv(len_k, BLOCK)
            for e in T.serial(T.ceildiv(ROWS * n_blocks, THREADS)):
                i = bx * ROWS + (e * THREADS + tx) // n_blocks
                blk = (e * THREADS + tx) % n_blocks
                if e * THREADS + tx < ROWS * n_blocks and i < len_q:
                    p = len_k - len_q + i
                    qb = p // BLOCK
                    m[0] = NEG_INF
                    for w in T.serial(POOL + 1):
                        j = blk * POOL - 1 + w
                        if j >= 0 and j < n_c and j * FINE_S + FINE_W - 1 <= p:
                            m[0] = T.max(m[0], S[hk, q0 + i, j])
                    B[hk, q0 + i, blk] = T.if_then_else(
                        blk > qb or blk >= nb,
                        NEG_INF,
                        T.if_then_else(
                            blk < init_blocks or (blk >= qb - local_blocks and blk <= qb), float("inf"), m[0]
                        ),
                    )

    return max_pool_blocks
