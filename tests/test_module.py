"""InfLLMv2Attention (the nn.Module) against the reference, both layouts and both paths."""

import pytest
import torch

import infllmv2
from infllmv2 import SparseConfig, reference
from infllmv2.module import InfLLMv2Attention
from infllmv2.testing import assert_close_to_reference, cu_seqlens, random_tokens

SMALL = SparseConfig(dense_len=300, window_size=128, topk=3)


def _ref(q, k, v, cu_q, cu_k, cfg, punct_mask=None):
    return reference.attention(q, k, v, cu_q, cu_k, dense_len=cfg.dense_len, topk=cfg.num_selected,
                               local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks, punct_mask=punct_mask,
                               phsa_lambda=cfg.phsa_lambda)[0]


@pytest.mark.parametrize("lengths", [[100, 65], [700, 1, 64]])  # dense path, sparse path
def test_varlen_and_padded_match_reference_with_gradients(lengths):
    mod = InfLLMv2Attention(SMALL.to_dict())
    q = random_tokens(lengths, 8, 32, torch.float64, seed=1).requires_grad_()
    k = random_tokens(lengths, 2, 32, torch.float64, seed=2).requires_grad_()
    v = random_tokens(lengths, 2, 32, torch.float64, seed=3).requires_grad_()
    cu = cu_seqlens(lengths)
    out = mod(q, k, v, cu, cu)
    ref = _ref(q, k, v, cu, cu, SMALL)
    assert torch.allclose(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        assert torch.allclose(a, b)
    n = lengths[0]  # the padded layout: a batch of two copies of the first sequence
    pad = [t[:n].detach().unsqueeze(0).repeat(2, 1, 1, 1) for t in (q, k, v)]
    assert torch.allclose(mod(*pad), ref[:n].unsqueeze(0).repeat(2, 1, 1, 1))


def test_punct_mask_switches_compression_to_phsa():
    lengths = [700, 400]
    q, k, v = (random_tokens(lengths, h, 16, torch.float64, seed=s) for h, s in ((4, 1), (2, 2), (2, 3)))
    cu = cu_seqlens(lengths)
    mask = torch.rand(sum(lengths), generator=torch.Generator().manual_seed(0)) < 0.1
    mod = InfLLMv2Attention(SparseConfig(dense_len=300, window_size=128, topk=3, phsa_lambda=0.25))
    out = mod(q, k, v, cu, cu, punct_mask=mask)
    assert torch.allclose(out, _ref(q, k, v, cu, cu, mod.config, mask))
    assert not torch.allclose(out, mod(q, k, v, cu, cu))  # the mask changes the selection


def test_argument_errors_and_repr():
    mod = InfLLMv2Attention()
    assert "K=96" in repr(mod) and "dense_len=8192" in repr(mod)
    x = torch.zeros(10, 4, 16)
    with pytest.raises(ValueError, match="needs both cu_seqlens_q and cu_seqlens_k"):
        mod(x, x[:, :2], x[:, :2], cu_seqlens([10]))
    with pytest.raises(ValueError, match="unknown keys \\['windowsize'\\]"):
        InfLLMv2Attention({"windowsize": 2048})


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[100, 65], [700, 1, 300]])
def test_cuda_bf16_matches_reference(lengths):
    mod = InfLLMv2Attention(SMALL)
    q, k, v = (random_tokens(lengths, h, 128, torch.bfloat16, "cuda", seed=s) for h, s in ((32, 1), (2, 2), (2, 3)))
    cu = cu_seqlens(lengths, "cuda")
    out = mod(q, k, v, cu, cu)
    idx = None
    if max(lengths) >= SMALL.dense_len:  # compare over the kernels' own selection (checked in test_attention)
        idx = infllmv2.select_blocks(q, k, cu, cu, topk=SMALL.num_selected, local_blocks=SMALL.local_blocks).cpu()

    def ref(dt):
        args = [t.cpu().to(dt) for t in (q, k, v)] + [cu.cpu(), cu.cpu()]
        return (reference.sparse_attn_varlen(*args, idx) if idx is not None else reference.dense_attn_varlen(*args))[0]

    assert_close_to_reference(out.cpu(), ref(torch.bfloat16), ref(torch.float32))
