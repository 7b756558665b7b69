"""attn_implementation="infllmv2" in a Hugging Face Llama model (random weights, no download)."""

import subprocess
import sys

import pytest
import torch

import infllmv2
from infllmv2 import SparseConfig, reference
from infllmv2.testing import assert_close_to_reference

transformers = pytest.importorskip("transformers")
import infllmv2.hf  # noqa: E402

# K = 6 of at most 10 blocks at 600 tokens: 2 chosen by score
SPARSE = SparseConfig(dense_len=256, window_size=128, topk=4)
VOCAB = 128


def _model(impl, head_dim=32, dtype=torch.float32, device="cpu", **extra):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=4096, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(impl)
    return model


def _ids(B, S, seed, device="cpu"):  # never token 0, generate()'s padding token here
    return torch.randint(1, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed)).to(device)


def _reference_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The same attention through reference.attention: what the sparse path must compute."""
    assert attention_mask is None
    cfg = infllmv2.hf._layer_config(module, SPARSE)
    B, H, S, D = query.shape
    q, k, v = (t.transpose(1, 2).reshape(B * S, t.shape[1], D).float().cpu() for t in (query, key, value))
    cu = torch.arange(B + 1, dtype=torch.int32) * S
    out = reference.attention(q, k, v, cu, cu, cfg.dense_len, scaling, topk=cfg.num_selected,
                              kernel_size=cfg.kernel_size, kernel_stride=cfg.kernel_stride, block_size=cfg.block_size,
                              init_blocks=cfg.init_blocks, local_blocks=cfg.local_blocks, approx_lse=cfg.approx_lse,
                              norm_kernel_size=cfg.norm_kernel_size, norm_kernel_stride=cfg.norm_kernel_stride)[0]
    return out.reshape(B, S, H, D).to(query), None


@pytest.fixture(scope="module", autouse=True)
def registered():
    infllmv2.hf.register(SPARSE)
    transformers.AttentionInterface.register("infllmv2_reference", _reference_forward)
    transformers.masking_utils.AttentionMaskInterface.register(
        "infllmv2_reference", transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["infllmv2"])


def _logits_and_grads(model, ids, **kw):
    out = model(ids, labels=ids, **kw)
    out.loss.backward()
    return out.logits.detach(), [p.grad for p in model.parameters()]


def test_short_input_dense_path_equals_sdpa_with_gradients():
    ids = _ids(2, 100, seed=1)
    want, want_grads = _logits_and_grads(_model("sdpa"), ids)
    got, got_grads = _logits_and_grads(_model("infllmv2"), ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_from_pretrained_with_attn_implementation(tmp_path):
    _model("sdpa").save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="infllmv2").eval()
    assert model.config._attn_implementation == "infllmv2"
    ids = _ids(1, 80, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, _model("sdpa")(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("side", ["left", "right", "holes"])
def test_padding_mask_equals_sdpa_on_the_valid_tokens(side):
    ids, mask = _ids(3, 90, seed=3), torch.ones(3, 90, dtype=torch.long)
    mask[1, {"left": slice(0, 30), "right": slice(60, None), "holes": slice(20, 25)}[side]] = 0
    mask[2, :] = 0 if side == "right" else 1  # an all-padding row / an unpadded one
    with torch.no_grad():
        want = _model("sdpa")(ids, attention_mask=mask).logits
        got = _model("infllmv2")(ids, attention_mask=mask).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_equals_sdpa(cache):
    """Prefill then one-token decode steps against the cache, a left-padded batch and a single
    unpadded sequence (whose all-ones mask generate() drops, leaving a StaticCache unmasked)."""
    ids, mask = _ids(2, 40, seed=4), torch.ones(2, 40, dtype=torch.long)
    mask[0, :15] = 0
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache)
    a, b = _model("sdpa"), _model("infllmv2")
    assert torch.equal(b.generate(ids, attention_mask=mask, **kw), a.generate(ids, attention_mask=mask, **kw))
    assert torch.equal(b.generate(ids[1:], **kw), a.generate(ids[1:], **kw))


def test_long_input_sparse_path_forward_backward_equals_reference():
    ids = _ids(1, 600, seed=5)
    got, grads = _logits_and_grads(_model("infllmv2"), ids)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        ref = _model("infllmv2_reference")(ids).logits
        dense = _model("sdpa")(ids).logits
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, dense, atol=1e-2)  # the sparse path is not dense attention here
    # a model config's own sparse_config (MiniCPM4.1's keys) wins over register()'s
    mini = _model("infllmv2", sparse_config={"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64,
                                             "window_size": 2048, "topk": 64, "use_nope": False, "dense_len": 8192})
    with torch.no_grad():
        torch.testing.assert_close(mini(ids).logits, dense, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="sparse_config.*window_size"):
        _model("infllmv2", sparse_config={"window_size": 100})(ids[:, :10])


def test_sparse_path_with_padding_and_packing_equals_each_sequence_alone():
    lengths = [600, 420]
    ids = _ids(1, sum(lengths), seed=6)
    model, ref = _model("infllmv2"), _model("infllmv2_reference")
    with torch.no_grad():
        alone = [ref(part).logits[0] for part in ids.split(lengths, dim=1)]
        # left-padded batch, positions counted over the valid tokens as generate() does
        batch, mask = torch.zeros(2, 600, dtype=torch.long), torch.zeros(2, 600, dtype=torch.long)
        for row, part in enumerate(ids.split(lengths, dim=1)):
            batch[row, 600 - part.shape[1]:], mask[row, 600 - part.shape[1]:] = part[0], 1
        got = model(batch, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        torch.testing.assert_close(got[mask.bool()], torch.cat(alone), atol=1e-4, rtol=1e-4)
        # packed into one row: restarting position_ids, or FlashAttention's varlen kwargs
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        torch.testing.assert_close(model(ids, position_ids=pos).logits[0], torch.cat(alone), atol=1e-4, rtol=1e-4)
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
        got = model(ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=600, max_length_k=600)
        torch.testing.assert_close(got.logits[0], torch.cat(alone), atol=1e-4, rtol=1e-4)


def test_unsupported_uses_raise():
    fn = transformers.AttentionInterface._global_mapping["infllmv2"]
    layer = _model("infllmv2").model.layers[0].self_attn
    q, kv = torch.randn(1, 8, 16, 32), torch.randn(1, 2, 16, 32)
    with pytest.raises(ValueError, match="dropout must be 0"):
        fn(layer, q, kv, kv, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="causal self-attention only"):
        fn(layer, q, kv, kv, None, is_causal=False)
    with pytest.raises(NotImplementedError, match="sliding window"):
        fn(layer, q, kv, kv, None, sliding_window=8)
    with pytest.raises(NotImplementedError, match="softcap"):
        fn(layer, q, kv, kv, None, softcap=30.0)
    with pytest.raises(NotImplementedError, match="4-D"):
        fn(layer, q, kv, kv, torch.ones(1, 1, 16, 16, dtype=torch.bool))


def test_import_without_transformers(monkeypatch):
    code = "import sys, infllmv2, infllmv2.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": ":".join(sys.path)})
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match="infllmv2.hf.register\\(\\) needs transformers"):
        infllmv2.hf.register()


@pytest.mark.gpu
def test_cuda_bf16_head_dim_128():
    model = _model("infllmv2", 128, torch.bfloat16, "cuda")
    # dense path: the 2x error rule against SDPA in fp32, with SDPA in bf16 as the baseline
    ids = _ids(2, 200, seed=7, device="cuda")
    with torch.no_grad():
        out = model(ids).logits
        lowp, ref32 = (_model("sdpa", 128, dt, "cuda")(ids).logits for dt in (torch.bfloat16, torch.float32))
    assert_close_to_reference(out.float().cpu(), lowp.float().cpu(), ref32.cpu(), what="dense-path logits")
    # sparse path, forward and backward
    ids = _ids(2, 700, seed=8, device="cuda")
    got, grads = _logits_and_grads(model, ids)
    assert torch.isfinite(got).all() and all(torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        ref = _model("infllmv2_reference", 128, torch.float32, "cuda")(ids).logits
    # bf16 selections may break near-ties differently from fp32: the top token agrees almost everywhere
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.gpu
def test_cuda_padding_and_packing_equal_each_sequence_alone():
    lengths = [600, 420]
    model = _model("infllmv2", 128, torch.bfloat16, "cuda")
    ids = _ids(1, sum(lengths), seed=9, device="cuda")
    parts = ids.split(lengths, dim=1)
    batch, mask = torch.zeros(2, 600, dtype=torch.long, device="cuda"), torch.zeros(2, 600, dtype=torch.long,
                                                                                     device="cuda")
    for row, part in enumerate(parts):
        batch[row, 600 - part.shape[1]:], mask[row, 600 - part.shape[1]:] = part[0], 1
    pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    with torch.no_grad():
        alone = torch.cat([model(part).logits[0] for part in parts])
        padded = model(batch, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
        packed = model(ids, position_ids=pos).logits[0]
        gen = [model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                              cache_implementation=c)[0, 600:] for c in (None, "static")]
        gen_alone = model.generate(parts[0], max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 600:]
    # the same kernels over the same rows: equal up to the linear layers' bf16 rounding at other shapes
    torch.testing.assert_close(padded[mask.bool()], alone, atol=2e-2, rtol=0)
    torch.testing.assert_close(packed, alone, atol=2e-2, rtol=0)
    assert all(torch.equal(g, gen_alone) for g in gen)
