"""InfLLMv2Attention (the nn.Module) against the reference, both layouts and both paths."""

import pytest
import torch

import infllmv2
from infllmv2 import SparseConfig, reference
from infllmv2.module import InfLLMv2Attention
from infllmv2.testing import (GRAD_FLOOR, assert_close_to_reference, cu_seqlens, oracle_block_scores, random_mask,
                              random_tokens, selection_mismatch)

# K = 6: init, 2 local and the current block forced, 2 chosen by score
SMALL = SparseConfig(dense_len=256, window_size=128, block_size=64, topk=4)
DENSE, SPARSE = [100, 65, 1], [500, 1, 300]  # longest below / at least dense_len


def _ref(q, k, v, cu_q, cu_k, cfg, softmax_scale=None, punct_mask=None):
    """reference.attention with every SparseConfig field spelled out: the mapping under test."""
    return reference.attention(
        q, k, v, cu_q, cu_k, dense_len=cfg.dense_len, softmax_scale=softmax_scale, topk=cfg.num_selected,
        kernel_size=cfg.kernel_size, kernel_stride=cfg.kernel_stride, block_size=cfg.block_size,
        init_blocks=cfg.init_blocks, local_blocks=cfg.local_blocks, approx_lse=cfg.approx_lse,
        norm_kernel_size=cfg.norm_kernel_size, norm_kernel_stride=cfg.norm_kernel_stride, punct_mask=punct_mask,
        phsa_lambda=cfg.phsa_lambda)


def _qkv(lengths, G=4, D=32, dtype=torch.float32, device="cpu"):
    heads_seeds = ((2 * G, 1), (2, 2), (2, 3))
    return [random_tokens(lengths, h, D, dtype, device, seed=s).requires_grad_() for h, s in heads_seeds]


@pytest.mark.parametrize("lengths", [DENSE, SPARSE], ids=["dense", "sparse"])
def test_varlen_matches_reference_with_gradients(lengths):
    q, k, v = _qkv(lengths)
    cu = cu_seqlens(lengths)
    out, lse = InfLLMv2Attention(SMALL.to_dict())(q, k, v, cu, cu, return_lse=True)
    ref, ref_lse = _ref(q, k, v, cu, cu, SMALL)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    dout = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(got, want)
    dense = reference.dense_attn_varlen(q, k, v, cu, cu)[0]
    assert torch.allclose(out, dense, atol=1e-5) == (lengths is DENSE)  # the sparse case is not dense attention


@pytest.mark.parametrize("Sq, Sk", [(120, 120), (500, 500), (40, 500), (1, 300)])  # dense, sparse, chunk, decode
def test_padded_matches_reference(Sq, Sk):
    B, scale = 2, 0.2
    q = random_tokens([Sq] * B, 8, 32, torch.float32, seed=1).reshape(B, Sq, 8, 32).requires_grad_()
    k, v = (random_tokens([Sk] * B, 2, 32, torch.float32, seed=s).reshape(B, Sk, 2, 32).requires_grad_()
            for s in (2, 3))
    out, lse = InfLLMv2Attention(SMALL, softmax_scale=scale)(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (B, 8, Sq)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    ref, ref_lse = _ref(*flat, cu_seqlens([Sq] * B), cu_seqlens([Sk] * B), SMALL, softmax_scale=scale)
    torch.testing.assert_close(out, ref.reshape(out.shape))
    torch.testing.assert_close(lse, ref_lse.reshape(8, B, Sq).transpose(0, 1))
    for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(got, want)


def test_punct_mask_switches_compression_to_phsa_in_both_layouts():
    lengths = [500, 500]
    q, k, v = (t.detach() for t in _qkv(lengths, G=2, D=16))
    cu = cu_seqlens(lengths)
    mask = random_mask(sum(lengths), 0.1)
    mod = InfLLMv2Attention(SparseConfig(dense_len=256, window_size=128, topk=4, phsa_lambda=0.25))
    out = mod(q, k, v, cu, cu, punct_mask=mask)
    torch.testing.assert_close(out, _ref(q, k, v, cu, cu, mod.config, punct_mask=mask)[0])
    assert not torch.allclose(out, mod(q, k, v, cu, cu))  # the mask changes the selection
    padded = mod(*(t.reshape(2, 500, *t.shape[1:]) for t in (q, k, v)), punct_mask=mask.reshape(2, 500))
    torch.testing.assert_close(padded, out.reshape(padded.shape))


@pytest.mark.parametrize("config, match", [
    ({"windowsize": 2048}, r"unknown keys \['windowsize'\]"),
    ({"window_size": 100}, "window_size"),
    ({"block_size": 40}, "block_size"),
    ({"topk": -1}, "topk"),
    ({"dense_len": 1.5}, "dense_len"),
    ({"phsa_lambda": 2.0}, "phsa_lambda"),
    ({"approx_lse": "yes"}, "approx_lse"),
    ({"use_nope": True}, "use_nope"),
    ("topk=64", "config must be a SparseConfig"),
])
def test_config_errors_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        InfLLMv2Attention(config)


def test_argument_errors_and_repr():
    with pytest.raises(ValueError, match="softmax_scale"):
        InfLLMv2Attention(softmax_scale=0.0)
    mod = InfLLMv2Attention({"topk": 64, "window_size": 2048, "use_nope": False}, softmax_scale=0.125)
    assert mod.config == SparseConfig()
    assert "K=96" in repr(mod) and "dense_len=8192" in repr(mod) and "softmax_scale=0.125" in repr(mod)
    x = torch.zeros(10, 4, 16)
    with pytest.raises(ValueError, match="needs both cu_seqlens_q and cu_seqlens_k"):
        mod(x, x[:, :2], x[:, :2], cu_seqlens([10]))
    with pytest.raises(ValueError, match="max_seqlen_q/max_seqlen_k go with cu_seqlens"):
        mod(x[None], x[None, :, :2], x[None, :, :2], max_seqlen_k=10)
    with pytest.raises(ValueError, match="4-D tensor"):
        mod(x, x[:, :2], x[:, :2])
    assert list(mod.parameters()) == [] and list(mod.buffers()) == []


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [DENSE, SPARSE], ids=["dense", "sparse"])
def test_cuda_bf16_matches_reference(lengths):
    """Out and gradients by the 2x error rule against the reference in fp32, over the kernels'
    own selection once that is checked tie-aware against the reference block scores."""
    q, k, v = _qkv(lengths, G=16, D=128, dtype=torch.bfloat16, device="cuda")
    cu = cu_seqlens(lengths, "cuda")
    out = InfLLMv2Attention(SMALL)(q, k, v, cu, cu)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    idx = None
    if max(lengths) >= SMALL.dense_len:
        idx = infllmv2.select_decode(q, k, cu, cu, topk=SMALL.num_selected, local_blocks=SMALL.local_blocks).cpu()
        why = selection_mismatch(idx, oracle_block_scores(q, k, cu, cu, SMALL.init_blocks, SMALL.local_blocks),
                                 SMALL.num_selected)
        assert why is None, why

    def ref(dt):
        qq, kk, vv = (t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v))
        args = (qq, kk, vv, cu.cpu(), cu.cpu())
        o = (reference.sparse_attn_varlen(*args, idx) if idx is not None else reference.dense_attn_varlen(*args))[0]
        return [o.detach(), *torch.autograd.grad(o, (qq, kk, vv), dout.cpu().to(dt))]

    for name, got, lowp, ref32 in zip(("out", "dq", "dk", "dv"), (out, *grads), ref(torch.bfloat16),
                                      ref(torch.float32)):
        assert_close_to_reference(got.detach().cpu(), lowp, ref32, what=name,
                                  floor=GRAD_FLOOR if name != "out" else None)
