"""attn_implementation="infllmv2" in a Hugging Face Llama-family model (random weights, no download)."""

import pytest
import torch

import infllmv2
from infllmv2 import SparseConfig, reference

transformers = pytest.importorskip("transformers")
import infllmv2.hf  # noqa: E402

SPARSE = SparseConfig(dense_len=256, window_size=128, topk=2)


def _model(impl, head_dim, dtype, device, **extra):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=8 * head_dim, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=4096, **extra)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _reference_impl(cfg):
    """The same attention through the PyTorch reference: what the sparse path must compute."""
    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        B, H, S, D = query.shape
        q, k, v = (t.transpose(1, 2).reshape(B * t.shape[2], t.shape[1], D).float().cpu() for t in (query, key, value))
        cu = torch.arange(B + 1, dtype=torch.int32) * S
        out = reference.attention(q, k, v, cu, cu, dense_len=cfg.dense_len, topk=cfg.num_selected,
                                  local_blocks=cfg.local_blocks, init_blocks=cfg.init_blocks, softmax_scale=scaling)[0]
        return out.reshape(B, S, H, D).to(query), None

    return forward


@pytest.fixture(scope="module", autouse=True)
def registered():
    infllmv2.hf.register(SPARSE)
    transformers.AttentionInterface.register("infllmv2_reference", _reference_impl(SPARSE))
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionMaskInterface.register("infllmv2_reference", flash_attention_mask)


def test_short_input_dense_path_equals_sdpa():
    ids = torch.randint(0, 128, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _model("sdpa", 32, torch.float32, "cpu")(ids).logits
        got = _model("infllmv2", 32, torch.float32, "cpu")(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_padding_mask_equals_sdpa_on_the_valid_tokens():
    ids = torch.randint(0, 128, (2, 90), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 90, dtype=torch.long)
    mask[1, :30] = 0  # left padding
    with torch.no_grad():
        want = _model("sdpa", 32, torch.float32, "cpu")(ids, attention_mask=mask).logits
        got = _model("infllmv2", 32, torch.float32, "cpu")(ids, attention_mask=mask).logits
    assert torch.allclose(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=1e-4)


def test_long_input_sparse_path_forward_backward_and_model_config():
    ids = torch.randint(0, 128, (1, 600), generator=torch.Generator().manual_seed(3))
    model = _model("infllmv2", 32, torch.float32, "cpu")
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        ref = _model("infllmv2_reference", 32, torch.float32, "cpu")(ids).logits
        dense = _model("sdpa", 32, torch.float32, "cpu")(ids).logits
    assert torch.allclose(out.logits.detach(), ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, dense, atol=1e-3)  # the sparse path is not dense attention here
    # a model config's own sparse_config (MiniCPM4.1 style) wins over register()'s
    mini = _model("infllmv2", 32, torch.float32, "cpu", sparse_config={"dense_len": 10**6})
    with torch.no_grad():
        assert torch.allclose(mini(ids).logits, dense, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_cuda_bf16_head_dim_128():
    ids = torch.randint(0, 128, (2, 700), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        got = _model("infllmv2", 128, torch.bfloat16, "cuda")(ids).logits.float()
        ref = _model("infllmv2_reference", 128, torch.float32, "cuda")(ids).logits
    assert torch.isfinite(got).all()
    # bf16 through 2 layers against fp32: the top token agrees almost everywhere
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
