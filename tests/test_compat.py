"""infllmv2.compat: the original package's calls against the reference composition with the
same meaning, the original kernels' own masks, and the MiniCPM4.1 call sequence.

CPU tier: fp64 through the reference path, compared exactly or to fp64 rounding. GPU tier:
the kernels in bf16/fp16 against the fp32 reference by the library's error rule, selections
tie-aware on the block scores the compat calls returned.
"""

import pytest
import torch

import infllmv2
from infllmv2 import compat, reference
from infllmv2.testing import (
    GRAD_FLOOR,
    SCORE_ATOL,
    SCORE_RTOL,
    assert_close_to_reference,
    cu_seqlens,
    max_seqlen,
    no_host_sync,
    random_tokens,
    selection_mismatch,
)

INIT, LOCAL, TOPK = 1, 2, 3  # MiniCPM4.1: 1, 32, 64; smaller so that short inputs leave choices
K = TOPK + LOCAL  # the model's top-K: topk + local blocks
NEG_INF = float("-inf")

CASES = {  # (lengths_q, lengths_k, stage 1 told cache_lens): how MiniCPM4.1 meets each workload
    "prefill": ([1, 63, 64, 65, 300, 520], [1, 63, 64, 65, 300, 520], False),
    # chunked prefill, caches multiples of 16: the original's call (no cache_lens) is exact
    "chunked16": ([17, 64, 100, 230], [177, 128, 692, 230], False),
    # any caches: stage 1 gets the keyword cache_lens for exact positions
    "chunked": ([17, 64, 100, 3], [300, 131, 777, 650], True),
    "decode": ([1, 1, 1, 1, 1], [1, 64, 333, 900, 1025], False),  # one query per sequence, cache = Lk - 1
}


def _inputs(lq, lk, hq, hk, d, dtype, device="cpu", seed=0):
    q = random_tokens(lq, hq, d, dtype, device, seed=seed)
    k = random_tokens(lk, hk, d, dtype, device, seed=seed + 1)
    v = random_tokens(lk, hk, d, dtype, device, seed=seed + 2)
    cache = torch.tensor([b - a for a, b in zip(lq, lk)], dtype=torch.int32, device=device)
    return q, k, v, cu_seqlens(lq, device), cu_seqlens(lk, device), cache


def _positions(lq, lk, device="cpu"):
    return torch.cat([torch.arange(b - a, b, device=device) for a, b in zip(lq, lk)])


def _minicpm_selection(q, k, cu_q, cu_k, cache, lq, lk, tell_cache, topk=K):
    """MiniCPM4.1's selection through the compat calls: compress 32/16 and 128/64, stage 1 with
    the coarse keys, pooling, top-(topk + local) sorted, indices past the query's block -> -1."""
    ck, cu_c = infllmv2.compress_keys(k.detach(), cu_k, 32, 16)
    nk, cu_n = infllmv2.compress_keys(k.detach(), cu_k, 128, 64)
    max_q, max_c = max(lq), max_seqlen(cu_c)
    extra = {"cache_lens": cache} if tell_cache else {}
    S = compat.infllmv2_attn_stage1(q, ck, nk, cu_q, cu_c, cu_n, max_q, max_c, causal=max_q != 1, **extra)
    blocks = compat.max_pooling_1d_varlen(S, cu_q, cu_c, cache, max_q, max_c, local_blocks=LOCAL, init_blocks=INIT)
    idx = blocks.topk(min(topk, blocks.shape[-1]), dim=-1).indices.sort(-1).values
    q_blk = _positions(lq, lk, q.device) // 64
    idx = torch.where(idx > q_blk[None, :, None], -1, idx).to(torch.int32)
    idx = torch.nn.functional.pad(idx, (0, topk - idx.shape[-1]), value=-1)
    return S, blocks, idx, (ck, cu_c, nk, cu_n)


def _pad_to(x, width, value):
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=value)


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


# ---------------------------------------------------------------------------------- CPU tier


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_minicpm_flow_matches_reference(case):
    lq, lk, tell_cache = CASES[case]
    q, k, v, cu_q, cu_k, cache = _inputs(lq, lk, 8, 2, 32, torch.float64, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    S, blocks, idx, (ck, cu_c, nk, cu_n) = _minicpm_selection(q, k, cu_q, cu_k, cache, lq, lk, tell_cache)

    want_S = reference.group_scores(q, ck, cu_q, cu_k, cu_c, 32, 16, None, nk, cu_n, 128, 64)
    assert S.dtype == q.dtype and torch.equal(S, _pad_to(want_S, S.shape[2], 0.0).double())
    want_idx, want_blocks = reference.select_blocks(q, k, cu_q, cu_k, topk=K, init_blocks=INIT, local_blocks=LOCAL,
                                                    return_scores=True)
    width = -(-(max(lq) + max(b - a for a, b in zip(lq, lk))) // 64)  # the original's output width
    assert blocks.dtype == q.dtype and blocks.shape == (2, sum(lq), width)
    assert torch.equal(blocks.float(), _pad_to(want_blocks, width, NEG_INF))
    why = selection_mismatch(idx, _pad_to(want_blocks, width, NEG_INF), K)
    assert why is None, why

    causal = max(lq) != 1
    out = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, topk_idx=idx)
    ref, _ = reference.sparse_attn_varlen(q, k, v, cu_q, cu_k, idx)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(out)
    for name, a, b in zip("qkv", _grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), f"d{name}"


@pytest.mark.parametrize("case", ["prefill", "chunked", "decode"])
def test_cpu_minicpm_flow_keeping_every_block_is_reference_attention(case):
    """With K above the block count nothing is left to ties: the flow is reference.attention."""
    lq, lk, _ = CASES[case]
    q, k, v, cu_q, cu_k, cache = _inputs(lq, lk, 4, 1, 16, torch.float64, seed=2)
    _, _, idx, _ = _minicpm_selection(q, k, cu_q, cu_k, cache, lq, lk, True, topk=32)
    want_idx = reference.select_blocks(q, k, cu_q, cu_k, topk=32, init_blocks=INIT, local_blocks=LOCAL)
    assert torch.equal(idx, want_idx)
    out = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=max(lq) != 1, topk_idx=idx)
    ref, _ = reference.attention(q, k, v, cu_q, cu_k, dense_len=0, topk=32, init_blocks=INIT, local_blocks=LOCAL)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm", ["exact", "copy", "coarse"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_stage1_is_group_scores(case, norm):
    lq, lk, tell_cache = CASES[case]
    q, k, _, cu_q, cu_k, cache = _inputs(lq, lk, 6, 3, 16, torch.float64, seed=3)
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
    nk, cu_n = {"exact": (ck, cu_c), "copy": (ck.clone(), cu_c.clone()),
                "coarse": infllmv2.compress_keys(k, cu_k, 128, 64)}[norm]
    width = max_seqlen(cu_c) + 3  # wider than needed: the extra columns are 0
    extra = {"cache_lens": cache} if tell_cache else {}
    S = compat.infllmv2_attn_stage1(q, ck, nk, cu_q, cu_c, cu_n, max(lq), width, causal=max(lq) != 1,
                                    softmax_scale=0.3, **extra)
    coarse = norm == "coarse"
    want = reference.group_scores(q, ck, cu_q, cu_k, cu_c, 32, 16, 0.3, nk if coarse else None,
                                  cu_n if coarse else None, 128, 64)
    assert S.dtype == q.dtype and S.shape == (3, sum(lq), width)
    assert torch.allclose(S, _pad_to(want, width, 0.0).double(), rtol=1e-6, atol=0)


def _original_causal_stage1(q, ck, lq, n, G, scale):
    """The original kernel's causal stage 1 with the exact normaliser, from its mask
    (csrc/flash_attn/src/mask.h, apply_mask_stage1): query i of a chunk of lq sees compressed key
    j < (i + 1) // 16 - 1 + n - trunc((lq - 15) / 16); a row that sees none is NaN, written 0."""
    i = torch.arange(lq)[:, None]
    visible = torch.arange(n)[None, :] < (i + 1) // 16 - 1 + n - int((lq - 15) / 16)
    logits = torch.einsum("ihd,jhd->hij", q, ck.repeat_interleave(G, dim=1)) * scale
    p = torch.softmax(logits.masked_fill(~visible, NEG_INF), dim=-1).nan_to_num(0.0)
    return p.view(ck.shape[1], G, lq, n).sum(1)


def test_cpu_stage1_positions_are_the_originals():
    """Chunks of lq >= 16 queries (lq % 16 != 15, where the original's own rule is consistent)
    against n compressed keys: prefill (n from lq keys) and cached chunks (more keys), without
    cache_lens, as the original is called."""
    pairs = [(16, 0), (16, 3), (40, 1), (64, 3), (100, 5), (100, 20), (130, 7), (33, 40)]
    lq, n = [a for a, _ in pairs], [b for _, b in pairs]
    G, hk, d = 4, 2, 16
    q = random_tokens(lq, G * hk, d, torch.float64, seed=4)
    ck = random_tokens(n, hk, d, torch.float64, seed=5)
    cu_q, cu_c = cu_seqlens(lq), cu_seqlens(n)
    S = compat.infllmv2_attn_stage1(q, ck, ck, cu_q, cu_c, cu_c, max(lq), max(n), causal=True)
    for b, (a, m) in enumerate(pairs):
        rows = slice(cu_q[b], cu_q[b + 1])
        want = _original_causal_stage1(q[rows], ck[cu_c[b] : cu_c[b + 1]], a, m, G, d**-0.5)
        assert torch.allclose(S[:, rows, :m], want, rtol=1e-6, atol=1e-9), f"lq={a} n={m}"
        assert (S[:, rows, m:] == 0).all()


def test_cpu_stage1_decode_sees_every_compressed_key():
    """causal=False, one query per sequence (MiniCPM4.1's decode): no mask, as in the original."""
    n = [0, 1, 9]
    q = random_tokens([1, 1, 1], 4, 16, torch.float64, seed=6)
    ck = random_tokens(n, 2, 16, torch.float64, seed=7)
    cu_q, cu_c = cu_seqlens([1, 1, 1]), cu_seqlens(n)
    S = compat.infllmv2_attn_stage1(q, ck, ck, cu_q, cu_c, cu_c, 1, 9, causal=False)
    for b, m in enumerate(n):
        logits = torch.einsum("hd,jhd->hj", q[b], ck[cu_c[b] : cu_c[b + 1]].repeat_interleave(2, dim=1)) * 0.25
        want = torch.softmax(logits, -1).view(2, 2, m).sum(1)  # (Hk, G, n) -> (Hk, n)
        assert torch.allclose(S[:, b, :m], want, rtol=1e-6, atol=1e-9)
        assert (S[:, b, m:] == 0).all()


def test_cpu_stage1_default_positions_need_a_16_aligned_cache():
    """Without cache_lens, chunks are placed as if their cache were a multiple of 16: equal to
    the exact positions for such caches, one compressed key off near window ends otherwise."""
    lq = [40, 40]
    for cache, same in ((160, True), (165, False)):
        lk = [cache + 40, 40]
        q, k, _, cu_q, cu_k, cache_t = _inputs(lq, lk, 4, 2, 16, torch.float64, seed=8)
        ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
        args = (q, ck, ck, cu_q, cu_c, cu_c, 40, max_seqlen(cu_c))
        assert torch.equal(compat.infllmv2_attn_stage1(*args, causal=True),
                           compat.infllmv2_attn_stage1(*args, causal=True, cache_lens=cache_t)) == same


def _original_pooling(S, lq, n, cache, local, init, width):
    """The original max_pooling_1d_varlen kernel (csrc/max_pooling_1d.cuh) for one sequence,
    but with blocks after the query's own at -inf (the deliberate difference: the original gives
    them 0, +inf for init blocks, -inf past the keys)."""
    out = torch.empty(S.shape[0], lq, width, dtype=S.dtype)
    for i in range(lq):
        q_blk = (i + cache) // 64
        for b in range(width):
            if b > q_blk:
                out[:, i, b] = NEG_INF
            elif b < init or (q_blk >= b and q_blk <= b + local):
                out[:, i, b] = float("inf")
            else:
                lo, hi = max(4 * b - 1, 0), min(4 * b + 4, n)
                out[:, i, b] = S[:, i, lo:hi].amax(-1) if hi > lo else NEG_INF
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("local,init", [(2, 1), (0, 0), (1, 3)])
def test_cpu_max_pooling_varlen_is_the_originals(local, init, dtype):
    lq, lk = [70, 1, 5, 200], [70, 700, 300, 455]
    q, k, _, cu_q, cu_k, cache = _inputs(lq, lk, 4, 2, 16, torch.float64, seed=9)
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
    S = compat.infllmv2_attn_stage1(q, ck, ck, cu_q, cu_c, cu_c, 200, max_seqlen(cu_c), causal=True,
                                    cache_lens=cache).to(dtype)
    got = compat.max_pooling_1d_varlen(S, cu_q, cu_c, cache, 200, max_seqlen(cu_c), local, init)
    width = -(-(max(lq) + max(b - a for a, b in zip(lq, lk))) // 64)
    assert got.dtype == dtype and got.shape == (2, sum(lq), width)
    for b in range(len(lq)):
        rows = slice(cu_q[b], cu_q[b + 1])
        want = _original_pooling(S[:, rows], lq[b], cu_c[b + 1] - cu_c[b], lk[b] - lq[b], local, init, width)
        assert torch.equal(got[:, rows], want), f"sequence {b}"
    want = reference.max_pool_blocks(S, cu_q, cu_k, cu_c, 32, 16, 64, init, local)
    assert torch.equal(got.float(), _pad_to(want, width, NEG_INF))


def test_cpu_max_pooling_1d_is_the_varlen_call_for_one_sequence():
    S = torch.rand(2, 70, 17)  # 70 queries after 230 cached keys: 17 windows of 32/16
    one = compat.max_pooling_1d(S, 230, local_blocks=2, init_blocks=1)
    var = compat.max_pooling_1d_varlen(S, cu_seqlens([70]), cu_seqlens([17]), torch.tensor([230], dtype=torch.int32),
                                      70, 17, local_blocks=2, init_blocks=1)
    assert one.shape == (2, 70, 5) and torch.equal(one, var)
    assert torch.equal(one, _original_pooling(S, 70, 17, 230, 2, 1, 5))


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_dense_when_topk_idx_is_none(causal):
    lq, lk = [5, 40, 1], [30, 40, 9]
    q, k, v, cu_q, cu_k, _ = _inputs(lq, lk, 4, 2, 16, torch.float64, seed=10)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse, probs = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, causal=causal,
                                                       return_attn_probs=True)
    ref, ref_lse = reference.dense_attn_varlen(q, k, v, cu_q, cu_k, causal=causal)
    assert probs is None and lse.shape == (4, 46)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12) and torch.allclose(lse, ref_lse, rtol=1e-12, atol=0)
    dout = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_cpu_sparse_lse_has_the_originals_layout_and_decode_ignores_causal():
    lq, lk = [1, 1, 1], [64, 200, 130]
    q, k, v, cu_q, cu_k, _ = _inputs(lq, lk, 6, 2, 16, torch.float64, seed=11)
    idx = torch.tensor([[[0, 2], [1, 3], [0, -1]], [[1, -1], [3, 0], [2, 1]]], dtype=torch.int32)
    out, lse, probs = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 200, causal=False, topk_idx=idx,
                                                       return_attn_probs=True)
    ref, ref_lse = reference.sparse_attn_varlen(q, k, v, cu_q, cu_k, idx)
    assert probs is None and torch.allclose(out, ref, rtol=1e-12, atol=1e-12)
    # the original's rows: token t, query head g*G + h at [g, t*G + h]
    G = 3
    assert lse.shape == (2, 3 * G)
    for g in range(2):
        for t in range(3):
            for h in range(G):
                assert lse[g, t * G + h] == ref_lse[g * G + h, t]
    causal = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 1, 200, causal=True, topk_idx=idx)
    assert torch.equal(out, causal)


_Q, _K, _CU = random_tokens([10], 4, 16, torch.float32), random_tokens([10], 2, 16, torch.float32), cu_seqlens([10])


def _call(fn, base, **kw):  # by the original's parameter names, so that they are checked too
    return lambda: fn(**{**base, **kw})


def _stage1(**kw):
    return _call(compat.infllmv2_attn_stage1, dict(q=_Q, k=_K, v=_K, cu_seqlens_q=_CU, cu_seqlens_k=_CU,
                                                   cu_seqlens_v=_CU, max_seqlen_q=10, max_seqlen_k=10, causal=True), **kw)


def _varlen(**kw):
    return _call(compat.infllmv2_attn_varlen_func, dict(q=_Q, k=_K, v=_K, cu_seqlens_q=_CU, cu_seqlens_k=_CU,
                                                        max_seqlen_q=10, max_seqlen_k=10, causal=True), **kw)


def _pool(**kw):
    return _call(compat.max_pooling_1d_varlen, dict(input=torch.zeros(2, 10, 3), cu_seqlens_q=_CU,
                                                    cu_seqlens_k=cu_seqlens([0]), cache_lens=torch.zeros(1, dtype=torch.int32),
                                                    max_seqlen_q=10, max_seqlen_k=3, local_blocks=2, init_blocks=1), **kw)


_UNSUPPORTED = [("dropout_p", 0.1), ("window_size", (128, 0)), ("softcap", 30.0), ("alibi_slopes", torch.ones(4)),
                ("block_table", torch.zeros((1, 1), dtype=torch.int32))]


@pytest.mark.parametrize(
    "call, name",
    [(fn(**{arg: value}), arg) for fn in (_stage1, _varlen) for arg, value in _UNSUPPORTED]
    + [
        (_stage1(causal=False), "causal"),
        (_stage1(cache_lens=torch.zeros(2, dtype=torch.int32)), "cache_lens"),
        (_stage1(max_seqlen_q=2.5), "max_seqlen_q"),
        (_stage1(cu_seqlens_v=torch.tensor([0, 5, 10], dtype=torch.int32)), "cu_seqlens_v"),
        (_varlen(causal=False, topk_idx=torch.zeros((2, 10, 1), dtype=torch.int32)), "causal"),
        (_pool(cache_lens=torch.zeros(2, dtype=torch.int32)), "cache_lens"),
        (_pool(cache_lens=torch.zeros(1)), "cache_lens"),
        (_pool(input=torch.zeros(10, 3)), "input"),
        (_pool(max_seqlen_q=-1), "max_seqlen_q"),
        (_call(compat.max_pooling_1d, dict(input=torch.zeros(2, 10, 3), cache_len=-1, local_blocks=2, init_blocks=1)),
         "cache_len"),
    ],
)
def test_arguments_that_cannot_be_honoured_are_named(call, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


# ---------------------------------------------------------------------------------- GPU tier


def _assert_scores_in_dtype(S, want, dtype, what):
    """Stage-1 scores are the kernel's fp32 values rounded to q's dtype, as the original returns."""
    assert S.dtype == dtype and not torch.isnan(S).any(), f"{what}: dtype or NaN"
    want = _pad_to(want, S.shape[2], 0.0)
    excess = (S.float() - want).abs() - (SCORE_ATOL + (SCORE_RTOL + torch.finfo(dtype).eps) * want.abs())
    assert excess.max().item() <= 0, f"{what}: excess error {excess.max().item():.3g}"


def _refs(q, k, v, cu_q, cu_k, idx, causal, dout, dt):
    """(out, lse, dq, dk, dv) of the reference in dtype dt, on the inputs' device."""
    qq, kk, vv = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
    if idx is None:
        o, lse = reference.dense_attn_varlen(qq, kk, vv, cu_q, cu_k, causal=causal)
    else:
        o, lse = reference.sparse_attn_varlen(qq, kk, vv, cu_q, cu_k, idx)
    return [o.detach(), lse, *torch.autograd.grad(o, (qq, kk, vv), dout.to(dt))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["prefill", "chunked16", "decode"])
@pytest.mark.parametrize("G", [1, 2, 4, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_minicpm_flow(dtype, head_dim, G, case):
    lq, lk, tell_cache = CASES[case]
    q, k, v, cu_q, cu_k, cache = _inputs(lq, lk, 2 * G, 2, head_dim, dtype, "cuda", seed=G)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    S, blocks, idx, (ck, cu_c, nk, cu_n) = _minicpm_selection(q, k, cu_q, cu_k, cache, lq, lk, tell_cache)
    # stage 1 against the fp32 reference on the keys the library compressed
    want_S = reference.group_scores(q.detach().float(), ck.float(), cu_q, cu_k, cu_c, 32, 16, None, nk.float(), cu_n,
                                    128, 64)
    _assert_scores_in_dtype(S, want_S, dtype, case)
    # pooling is exact on those scores; the top-K is a valid selection of them, tie-aware
    want_blocks = reference.max_pool_blocks(S.float(), cu_q, cu_k, cu_c, 32, 16, 64, INIT, LOCAL)
    assert blocks.dtype == dtype and torch.equal(blocks.float(), _pad_to(want_blocks, blocks.shape[2], NEG_INF))
    why = selection_mismatch(idx, blocks.float(), K)
    assert why is None, why

    causal = max(lq) != 1
    for sel in (idx, None):  # stage 2 over that selection, and the dense call
        out, lse, _ = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                                       return_attn_probs=True, topk_idx=sel)
        dout = torch.randn_like(out)
        grads = _grads(out, (q, k, v), dout)
        ref32 = _refs(q, k, v, cu_q, cu_k, sel, causal, dout, torch.float32)
        lowp = _refs(q, k, v, cu_q, cu_k, sel, causal, dout, dtype)
        if sel is not None:  # the original's (Hk, total_q * G) layout
            lse = lse.view(2, -1, G).transpose(1, 2).reshape(2 * G, -1)
        what = f"{'sparse' if sel is not None else 'dense'} {case}"
        for name, got, r32, lp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), ref32, lowp):
            assert_close_to_reference(got, lp, r32, what=f"{what} {name}", floor=GRAD_FLOOR if name[0] == "d" else None)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["exact", "coarse"])
def test_cuda_stage1_with_cache_lens(norm):
    lq, lk, _ = CASES["chunked"]
    q, k, _, cu_q, cu_k, cache = _inputs(lq, lk, 32, 2, 128, torch.bfloat16, "cuda", seed=12)
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
    nk, cu_n = (ck, cu_c) if norm == "exact" else infllmv2.compress_keys(k, cu_k, 128, 64)
    S = compat.infllmv2_attn_stage1(q, ck, nk, cu_q, cu_c, cu_n, max(lq), max_seqlen(cu_c), causal=True,
                                    cache_lens=cache)
    coarse = norm == "coarse"
    want = reference.group_scores(q.float(), ck.float(), cu_q, cu_k, cu_c, 32, 16, None,
                                  nk.float() if coarse else None, cu_n if coarse else None, 128, 64)
    _assert_scores_in_dtype(S, want, torch.bfloat16, norm)


@pytest.mark.gpu
def test_cuda_max_pooling_1d():
    S = torch.rand(2, 70, 17, device="cuda").to(torch.float16)
    one = compat.max_pooling_1d(S, 230, local_blocks=2, init_blocks=1)
    assert one.dtype == torch.float16 and torch.equal(one.cpu(), _original_pooling(S.cpu(), 70, 17, 230, 2, 1, 5))


@pytest.mark.gpu
def test_cuda_calls_do_not_synchronise():
    """Stage 1 (with cache_lens), pooling with a CPU cache_lens, stage 2 forward and backward:
    no host synchronisation, so a decode step can be captured in a CUDA graph."""
    lq, lk, _ = CASES["chunked"]
    q, k, v, cu_q, cu_k, cache = _inputs(lq, lk, 8, 2, 128, torch.bfloat16, "cuda", seed=13)
    q.requires_grad_()
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
    nk, cu_n = infllmv2.compress_keys(k, cu_k, 128, 64)
    max_c, cache_cpu = max_seqlen(cu_c), cache.cpu()
    with no_host_sync():
        S = compat.infllmv2_attn_stage1(q, ck, nk, cu_q, cu_c, cu_n, max(lq), max_c, causal=True, cache_lens=cache)
        blocks = compat.max_pooling_1d_varlen(S, cu_q, cu_c, cache_cpu, max(lq), max_c, LOCAL, INIT)
        idx = blocks.topk(K, dim=-1).indices.to(torch.int32)
        out = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True, topk_idx=idx)
        (dq,) = torch.autograd.grad(out.float().sum(), (q,))
    assert not torch.isnan(dq).any() and not torch.isnan(out).any()
