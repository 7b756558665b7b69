"""infllmv2.compat: the original package's calls, used the way MiniCPM4.1's attention uses them."""

import pytest
import torch

import infllmv2
from infllmv2 import compat, reference
from infllmv2.testing import (
    GRAD_FLOOR,
    assert_close_to_reference,
    cu_seqlens,
    max_seqlen,
    random_tokens,
    scores_mismatch,
    selection_mismatch,
)

INIT, LOCAL, TOPK = 1, 2, 3  # MiniCPM4.1 uses 1, 32, 64: smaller here so short inputs select


def _minicpm_selection(q, k, cu_q, cu_k, cache_lens, max_q):
    """MiniCPM4.1's selection through the compat calls: compress 32/16 and 128/64, stage 1 with
    the coarse keys, pooling, top-(topk + local) sorted, indices beyond the query's block -> -1."""
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
    nk, cu_n = infllmv2.compress_keys(k, cu_k, 128, 64)
    max_c = max(max_seqlen(cu_c), 1)
    causal = max_q != 1
    S = compat.infllmv2_attn_stage1(q, ck, nk, cu_q, cu_c, cu_n, max_q, max_c, causal=causal,
                                    cache_lens=None if not causal else cache_lens)
    blocks = compat.max_pooling_1d_varlen(S, cu_q, cu_c, cache_lens, max_q, max_c, local_blocks=LOCAL, init_blocks=INIT)
    K = TOPK + LOCAL
    vals, idx = blocks.topk(min(K, blocks.shape[-1]), dim=-1)
    lq = (cu_q[1:] - cu_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lq), device=q.device), lq)
    pos = cache_lens.long()[seq] + torch.arange(q.shape[0], device=q.device) - cu_q[:-1].long()[seq]
    idx = torch.where((idx > (pos // 64)[None, :, None]) | torch.isneginf(vals), -1, idx)
    idx = torch.nn.functional.pad(idx, (0, K - idx.shape[-1]), value=-1)
    return ops_sort(idx).to(torch.int32), blocks, causal, (S, ck, cu_c, nk, cu_n)


def ops_sort(idx):
    return infllmv2.ops.sort_topk_idx(idx)


CASES = {  # (lengths_q, lengths_k): prefill and one-token decode against a cache
    "prefill": ([1, 63, 64, 65, 300, 520], [1, 63, 64, 65, 300, 520]),
    "decode": ([1, 1, 1, 1], [1, 64, 333, 900]),
}


# ---------------------------------------------------------------------------------- CPU tier


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_minicpm_flow_matches_reference(case):
    lq, lk = CASES[case]
    q = random_tokens(lq, 8, 32, torch.float64, seed=1).requires_grad_()
    k = random_tokens(lk, 2, 32, torch.float64, seed=2).requires_grad_()
    v = random_tokens(lk, 2, 32, torch.float64, seed=3).requires_grad_()
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    cache = torch.tensor([b - a for a, b in zip(lq, lk)], dtype=torch.int32)
    idx, blocks, causal, _ = _minicpm_selection(q, k, cu_q, cu_k, cache, max(lq))
    # the scores and block scores are the reference's, the selection is the reference's top-K
    want_idx, want_blocks = reference.select_blocks(q, k, cu_q, cu_k, topk=TOPK + LOCAL, init_blocks=INIT,
                                                    local_blocks=LOCAL, return_scores=True)
    assert blocks.shape == want_blocks.shape and torch.allclose(blocks, want_blocks)
    assert selection_mismatch(idx, want_blocks, TOPK + LOCAL) is None
    out = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, topk_idx=idx)
    ref, _ = reference.sparse_attn_varlen(q, k, v, cu_q, cu_k, want_idx)
    assert torch.allclose(out, ref)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b)


def test_cpu_stage1_exact_normaliser_and_scores():
    lq = lk = [100, 300]
    q = random_tokens(lq, 4, 16, torch.float64, seed=4)
    k = random_tokens(lk, 2, 16, torch.float64, seed=5)
    cu = cu_seqlens(lq)
    ck, cu_c = infllmv2.compress_keys(k, cu, 32, 16)
    S = compat.infllmv2_attn_stage1(q, ck, ck, cu, cu_c, cu_c, 300, max_seqlen(cu_c), causal=True)
    want = reference.group_scores(q, ck, cu, cu, cu_c)
    assert S.dtype == q.dtype and S.shape == (2, 400, max_seqlen(cu_c))
    assert scores_mismatch(S, want) is None


def test_cpu_max_pooling_1d_is_the_varlen_call_for_one_sequence():
    S = torch.rand(2, 70, 17, dtype=torch.float64)  # 300 keys: 17 windows of 32 / 16
    one = compat.max_pooling_1d(S, 230, local_blocks=2, init_blocks=1)
    var = compat.max_pooling_1d_varlen(S, cu_seqlens([70]), cu_seqlens([17]), torch.tensor([230], dtype=torch.int32),
                                      70, 17, local_blocks=2, init_blocks=1)
    assert one.shape == (2, 70, (70 + 230 + 63) // 64) and torch.equal(one, var)


def test_cpu_dense_when_topk_idx_is_none_and_lse():
    lq, lk = [5, 40], [30, 40]
    q = random_tokens(lq, 4, 16, torch.float64, seed=6)
    k = random_tokens(lk, 2, 16, torch.float64, seed=7)
    v = random_tokens(lk, 2, 16, torch.float64, seed=8)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse, probs = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, causal=True, return_attn_probs=True)
    ref, ref_lse = reference.dense_attn_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert torch.allclose(out, ref) and torch.allclose(lse, ref_lse) and probs is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dropout_p=0.1), "dropout_p=0.1 is not supported"),
        (dict(window_size=(128, 0)), "window_size=\\(128, 0\\) is not supported"),
        (dict(softcap=30.0), "softcap=30.0 is not supported"),
        (dict(alibi_slopes=torch.ones(4)), "alibi_slopes=.* is not supported"),
        (dict(causal=False, topk_idx=torch.zeros((2, 10, 1), dtype=torch.int32)), "causal=False with topk_idx"),
    ],
)
def test_unsupported_arguments_are_named(kwargs, message):
    q = random_tokens([10], 4, 16, torch.float32)
    k = random_tokens([10], 2, 16, torch.float32)
    cu = cu_seqlens([10])
    with pytest.raises(ValueError, match=message):
        compat.infllmv2_attn_varlen_func(q, k, k, cu, cu, 10, 10, **kwargs)
    with pytest.raises(ValueError, match="causal=False needs one query per sequence"):
        compat.infllmv2_attn_stage1(q, k, k, cu, cu, cu, 10, 10, causal=False)
    with pytest.raises(ValueError, match="cache_lens must be a 1-D integer tensor of 1 entries"):
        compat.max_pooling_1d_varlen(torch.zeros(2, 10, 3), cu, cu_seqlens([3]), torch.zeros(2, dtype=torch.int32),
                                     10, 3, 2, 1)


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_minicpm_flow(dtype, head_dim, G, case):
    """Selection tie-aware against the fp32 reference block scores; attention and gradients
    over that selection by the 2x error rule; the dense call as well."""
    lq, lk = CASES[case]
    q = random_tokens(lq, 2 * G, head_dim, dtype, "cuda", seed=G).requires_grad_()
    k = random_tokens(lk, 2, head_dim, dtype, "cuda", seed=G + 1).requires_grad_()
    v = random_tokens(lk, 2, head_dim, dtype, "cuda", seed=G + 2).requires_grad_()
    cu_q, cu_k = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    cache = torch.tensor([b - a for a, b in zip(lq, lk)], dtype=torch.int32, device="cuda")
    idx, blocks, causal, (S, ck, cu_c, nk, cu_n) = _minicpm_selection(q, k, cu_q, cu_k, cache, max(lq))
    # stage 1 returns scores in q's dtype (as the original): within its rounding of the fp32
    # reference on the same compressed keys
    c = [t.cpu() for t in (cu_q, cu_k, cu_c, cu_n)]
    want_S = reference.group_scores(q.detach().float().cpu(), ck.float().cpu(), c[0], c[1], c[2], 32, 16, None,
                                    nk.float().cpu(), c[3], 128, 64)
    want_S = torch.nn.functional.pad(want_S, (0, S.shape[2] - want_S.shape[2]))
    eps = torch.finfo(dtype).eps
    assert torch.allclose(S.float().cpu(), want_S, rtol=eps, atol=1e-6)
    # pooling is exact on those scores, and the top-K is a valid selection of them (tie-aware)
    want_blocks = reference.max_pool_blocks(S.float().cpu(), c[0], c[1], c[2], 32, 16, 64, INIT, LOCAL)
    assert torch.equal(blocks.cpu(), want_blocks)
    why = selection_mismatch(idx.cpu(), want_blocks, TOPK + LOCAL)
    assert why is None, why
    for sel in (idx, None):
        out = compat.infllmv2_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal or sel is None,
                                               topk_idx=sel)
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)

        def ref(dt):
            qq, kk, vv = (t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v))
            if sel is None:
                o = reference.dense_attn_varlen(qq, kk, vv, cu_q.cpu(), cu_k.cpu())[0]
            else:
                o = reference.sparse_attn_varlen(qq, kk, vv, cu_q.cpu(), cu_k.cpu(), sel.cpu())[0]
            return [o.detach(), *torch.autograd.grad(o, (qq, kk, vv), dout.cpu().to(dt))]

        ref32, lowp = ref(torch.float32), ref(dtype)
        for name, got, r32, lp in zip(("out", "dq", "dk", "dv"), (out, *grads), ref32, lowp):
            assert_close_to_reference(got.detach().cpu(), lp, r32, what=f"{'dense' if sel is None else 'sparse'} {name}",
                                      floor=GRAD_FLOOR if name[0] == "d" else None)
