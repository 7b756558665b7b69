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
from infllmv2.testing import hf_cache_kwargs as _cache  # noqa: E402

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
    """The same attention through reference.attention: what the sparse path must compute (PHSA
    with the forward's punct_mask, which must cover every key)."""
    assert attention_mask is None
    cfg = infllmv2.hf._layer_config(module, SPARSE)
    B, H, S, D = query.shape
    q, k, v = (t.transpose(1, 2).reshape(B * S, t.shape[1], D).float().cpu() for t in (query, key, value))
    cu = torch.arange(B + 1, dtype=torch.int32) * S
    punct = kwargs.get("punct_mask")
    out = reference.attention(q, k, v, cu, cu, cfg.dense_len, scaling, topk=cfg.num_selected,
                              kernel_size=cfg.kernel_size, kernel_stride=cfg.kernel_stride, block_size=cfg.block_size,
                              init_blocks=cfg.init_blocks, local_blocks=cfg.local_blocks, approx_lse=cfg.approx_lse,
                              norm_kernel_size=cfg.norm_kernel_size, norm_kernel_stride=cfg.norm_kernel_stride,
                              punct_mask=None if punct is None else punct.reshape(-1).cpu(),
                              phsa_lambda=cfg.phsa_lambda)[0]
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


def _count_cache_paths(monkeypatch):
    """Counts of InfLLMv2Cache's prefills and attention_kvcache steps."""
    calls = {"prefill": 0, "kvcache": 0}
    for name, key in (("attention_padded", "prefill"), ("attention_kvcache", "kvcache")):
        def counted(*a, _f=getattr(infllmv2.hf, name), _k=key, **kw):
            calls[_k] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(infllmv2.hf, name, counted)
    return calls


def _assert_compressed_caches_hold_the_keys(cache, cfg=SPARSE):
    for layer in cache.layers:
        st = layer.state
        B, L = st.k_cache.shape[0], st.length
        rows = [L] * B if st.rows is None else st.rows.tolist()  # a padded batch: each row's valid keys
        for b, n_keys in enumerate(rows):
            cu = torch.tensor([0, n_keys], dtype=torch.int32, device=st.k_cache.device)
            for got, (w, s) in ((st.ck, (cfg.kernel_size, cfg.kernel_stride)),
                                (st.nk, (cfg.norm_kernel_size, cfg.norm_kernel_stride))):
                packed, cu_c = infllmv2.compress_keys(st.k_cache[b, :n_keys], cu, w, s)
                n = int(cu_c[1])
                assert torch.equal(got[b, :n], packed), f"{w}/{s} compressed keys of row {b}"


def test_infllmv2_cache_decodes_with_kept_compressed_keys(monkeypatch):
    """generate() with InfLLMv2Cache: the prompt through the prefill path, every later step through
    attention_kvcache, the same tokens and logits as with a DynamicCache (which compresses all the
    keys again each step), and compressed caches that are compress_keys' of the cached keys."""
    model, ids = _model("infllmv2"), _ids(2, 300, seed=11)  # past dense_len: the sparse path
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    calls = _count_cache_paths(monkeypatch)
    cache = infllmv2.hf.InfLLMv2Cache()
    got = model.generate(ids, **_cache(cache), **kw)
    layers = model.config.num_hidden_layers
    assert calls == {"prefill": layers, "kvcache": layers * 7}
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 307
    _assert_compressed_caches_hold_the_keys(cache)


def _left_padded(B, S, pads, seed):
    ids = _ids(B, S, seed)
    mask = torch.ones_like(ids)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
        ids[b, :p] = 0
    return ids, mask


def test_infllmv2_cache_left_padded_batch(monkeypatch):
    """generate() of a left-padded batch: each row's valid keys moved to its start, every step
    through attention_kvcache with per-row lengths, the same tokens and logits as a DynamicCache
    (whose steps pack the valid keys of every row again), and compressed caches of each row's
    valid keys. One row is shorter than dense_len, the batch is not: the sparse path, as without
    the cache."""
    model = _model("infllmv2")
    ids, mask = _left_padded(3, 300, (15, 70, 0), seed=17)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, attention_mask=mask, **kw)
    calls = _count_cache_paths(monkeypatch)
    cache = infllmv2.hf.InfLLMv2Cache()
    got = model.generate(ids, attention_mask=mask, **_cache(cache), **kw)
    assert calls == {"prefill": 0, "kvcache": model.config.num_hidden_layers * 7}
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == 307
    assert cache.layers[0].state.rows.tolist() == [292, 237, 307]
    _assert_compressed_caches_hold_the_keys(cache)
    # beam search reorders the rows and their lengths
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, num_beams=2)
    calls.update(prefill=0, kvcache=0)
    got = model.generate(ids, attention_mask=mask, **_cache(infllmv2.hf.InfLLMv2Cache()), **kw)
    assert calls["kvcache"] > 0
    assert torch.equal(got, model.generate(ids, attention_mask=mask, **kw))
    # right padding or holes: the general path over the cache as transformers laid it out
    mask = torch.ones_like(ids)
    mask[0, -15:] = 0
    mask[1, 100:130] = 0
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    calls.update(prefill=0, kvcache=0)
    got = model.generate(ids, attention_mask=mask, **_cache(infllmv2.hf.InfLLMv2Cache()), **kw)
    assert calls == {"prefill": 0, "kvcache": 0}
    assert torch.equal(got, model.generate(ids, attention_mask=mask, **kw))


def test_infllmv2_cache_left_padded_batch_crosses_dense_len(monkeypatch):
    """The longest row decides dense or sparse, as for the packed batch of a DynamicCache step: the
    prompt's 318 valid keys run dense, the steps past 320 sparse (2 of 6 blocks selected)."""
    sparse = {"kernel_size": 32, "kernel_stride": 16, "block_size": 64, "init_blocks": 1, "window_size": 64,
              "topk": 1, "dense_len": 320}
    model = _model("infllmv2", sparse_config=sparse)
    ids, mask = _left_padded(2, 318, (0, 50), seed=20)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, attention_mask=mask, **kw)
    longest = []  # the CPU reference takes the lengths themselves; the kernels take this bound

    def kvcache(*a, _f=infllmv2.hf.attention_kvcache, **k):
        longest.append(k["max_seqlen_k"])
        return _f(*a, **k)

    monkeypatch.setattr(infllmv2.hf, "attention_kvcache", kvcache)
    got = model.generate(ids, attention_mask=mask, **_cache(infllmv2.hf.InfLLMv2Cache()), **kw)
    assert longest == [n for n in range(319, 324) for _ in range(model.config.num_hidden_layers)]
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_infllmv2_cache_left_padded_steps_by_hand():
    """The compacted cache of a padded batch against a DynamicCache fed the same calls: steps of
    several tokens, steps with padding in one row (dropped from that row, the row's later tokens
    moved up), a step with gradients (the general path over the compacted keys), and crop."""
    model = _model("infllmv2")
    ids, mask = _left_padded(2, 280, (9, 40), seed=18)
    steps = _ids(2, 12, seed=19)
    cache, ref = infllmv2.hf.InfLLMv2Cache(), transformers.DynamicCache()

    def both(tokens, m, grad=False):
        with torch.set_grad_enabled(grad):
            out = [model(tokens, attention_mask=m, **_cache(c)).logits for c in (cache, ref)]
        valid = m[:, -tokens.shape[1]:].bool()  # the logits of padding tokens are not compared
        torch.testing.assert_close(out[0][valid], out[1][valid], atol=1e-4, rtol=1e-4)
        return out

    both(ids, mask)
    mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    both(steps[:, :3], mask)
    mask = torch.cat([mask, torch.tensor([[1], [0]], dtype=mask.dtype)], 1)
    both(steps[:, 3:4], mask)
    assert cache.layers[0].state.rows.tolist() == [275, 243]
    mask = torch.cat([mask, torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=mask.dtype)], 1)
    both(steps[:, 9:12], mask)  # a hole inside a step: its later token moves up
    assert cache.layers[0].state.rows.tolist() == [278, 245]
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    out = both(steps[:, 4:5], mask, grad=True)
    out[0].sum().backward()  # through the general path's kernels (the reference on CPU)
    _assert_compressed_caches_hold_the_keys(cache)  # the pending keys compressed by the next step
    with torch.no_grad():
        with pytest.raises(NotImplementedError, match="crops only tokens valid in every row"):
            cache.crop(-3)  # the step before the last dropped a row's token
        cache.crop(-1)
        ref.crop(-1)
        mask = mask[:, :-1]
        for t in range(5, 9):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            both(steps[:, t:t + 1], mask)
    assert cache.layers[0].state.rows.tolist() == [282, 249]
    _assert_compressed_caches_hold_the_keys(cache)


def test_infllmv2_cache_grows_with_its_compressed_keys():
    """A prompt of 505 keys takes a 512-key cache; the steps past it grow the cache and the
    compressed caches kept so far."""
    model, ids = _model("infllmv2"), _ids(1, 505, seed=16)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    cache = infllmv2.hf.InfLLMv2Cache()
    got = model.generate(ids, **_cache(cache), **kw)
    assert cache.layers[0].state.k_cache.shape[1] == 1024
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    _assert_compressed_caches_hold_the_keys(cache)


def test_infllmv2_cache_beam_search_and_crop(monkeypatch):
    model, ids = _model("infllmv2"), _ids(2, 300, seed=12)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, num_beams=3)
    calls = _count_cache_paths(monkeypatch)
    got = model.generate(ids, **_cache(infllmv2.hf.InfLLMv2Cache()), **kw)
    assert calls["kvcache"] > 0
    assert torch.equal(got, model.generate(ids, **kw))
    # crop from 306 keys back to 302, across the end of the compressed key of keys 272-303, then
    # other tokens: the logits of a DynamicCache fed the final tokens, and that compressed key
    # rewritten from the new keys
    first, second = _ids(1, 6, seed=13), _ids(1, 3, seed=14)
    cache = infllmv2.hf.InfLLMv2Cache()
    with torch.no_grad():
        model(ids[:1], **_cache(cache))
        for t in range(6):
            model(first[:, t:t + 1], **_cache(cache))
        cache.crop(-4)
        assert cache.get_seq_length() == 302
        got = [model(second[:, t:t + 1], **_cache(cache)).logits for t in range(3)]
        ref = transformers.DynamicCache()
        model(torch.cat([ids[:1], first[:, :2]], 1), **_cache(ref))
        want = [model(second[:, t:t + 1], **_cache(ref)).logits for t in range(3)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    _assert_compressed_caches_hold_the_keys(cache)
    with pytest.raises(ValueError, match="negative number"):
        cache.crop(3)


def test_infllmv2_cache_needs_transformers_only_when_used(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.setitem(sys.modules, "transformers.cache_utils", None)
    infllmv2.hf._cache_classes.cache_clear()
    try:
        with pytest.raises(ImportError, match="InfLLMv2Cache needs transformers"):
            infllmv2.hf.InfLLMv2Cache
    finally:
        infllmv2.hf._cache_classes.cache_clear()
    with pytest.raises(AttributeError):
        infllmv2.hf.NoSuchName


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
    paged = type("PagedAttentionCache", (), {})()  # continuous batching's cache, by its class name
    with pytest.raises(NotImplementedError, match="paged cache"):
        fn(layer, q, kv, kv, None, cache=paged)
    # any other cache passed on as `cache` (transformers' name for past_key_values) holds the keys already
    torch.testing.assert_close(fn(layer, q, kv, kv, None, cache=transformers.DynamicCache())[0],
                               fn(layer, q, kv, kv, None)[0], atol=0, rtol=0)


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


@pytest.mark.gpu
def test_cuda_infllmv2_cache_bf16_head_dim_128(monkeypatch):
    model, ids = _model("infllmv2", 128, torch.bfloat16, "cuda"), _ids(2, 300, seed=15, device="cuda")
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, **kw)
    calls = _count_cache_paths(monkeypatch)
    cache = infllmv2.hf.InfLLMv2Cache()
    got = model.generate(ids, **_cache(cache), **kw)
    assert calls == {"prefill": 2, "kvcache": 10}
    # the same kernels on bitwise-equal compressed keys: the same selections and outputs
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    _assert_compressed_caches_hold_the_keys(cache)


@pytest.mark.gpu
def test_cuda_infllmv2_cache_left_padded_batch(monkeypatch):
    model = _model("infllmv2", 128, torch.bfloat16, "cuda")
    ids, mask = (t.cuda() for t in _left_padded(3, 300, (15, 0, 37), seed=21))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    want = model.generate(ids, attention_mask=mask, **kw)
    calls = _count_cache_paths(monkeypatch)
    cache = infllmv2.hf.InfLLMv2Cache()
    got = model.generate(ids, attention_mask=mask, **_cache(cache), **kw)
    assert calls == {"prefill": 0, "kvcache": 10}
    # the same kernels on the same valid keys and bitwise-equal compressed keys
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits, want.logits):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    _assert_compressed_caches_hold_the_keys(cache)


def test_infllmv2_cache_batch_select_takes_indices_or_a_mask():
    model = _model("infllmv2")
    ids, mask = _left_padded(3, 70, (5, 0, 20), seed=22)
    caches = [infllmv2.hf.InfLLMv2Cache() for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(ids, attention_mask=mask, **_cache(c))
    caches[0].batch_select_indices(torch.tensor([0, 2]))
    caches[1].batch_select_indices(torch.tensor([True, False, True]))
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.state.rows.tolist() == b.state.rows.tolist() == [65, 50]
        assert a.state.rows_max == b.state.rows_max == 65
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.state.ck, b.state.ck)
    caches[0].batch_repeat_interleave(2)
    assert caches[0].layers[0].state.rows.tolist() == [65, 65, 50, 50]
    assert torch.equal(caches[0].layers[0].keys[2], caches[1].layers[0].keys[1])


def test_mask_facts_are_read_again_after_an_in_place_write():
    mask = torch.ones(2, 5, dtype=torch.long)
    assert infllmv2.hf._mask_facts(mask, 1) == (True, [5, 5], True)
    assert infllmv2.hf._mask_facts(mask, 1) == (True, [5, 5], True)  # the same layer's memo
    mask[1, -1] = 0
    assert infllmv2.hf._mask_facts(mask, 1) == (False, [5, 4], False)
    mask[1, :2] = 0
    mask[1, -1] = 1
    assert infllmv2.hf._mask_facts(mask, 1) == (True, [5, 3], True)
    assert infllmv2.hf._mask_facts(mask, 3) == (True, [5, 3], True)


# ---------------------------------------------------------------------------------- PHSA

PUNCT = [5, 17, 42, 99]  # the toy vocabulary's punctuation tokens


def _punct_ids(B, S, seed, device="cpu"):
    """Token ids with about a fifth of them punctuation."""
    ids = _ids(B, S, seed)
    g = torch.Generator().manual_seed(seed + 1)
    at = torch.rand(B, S, generator=g) < 0.2
    ids[at] = torch.tensor(PUNCT)[torch.randint(0, len(PUNCT), (int(at.sum()),), generator=g)]
    return ids.to(device)


def _assert_phsa_caches_hold_the_keys(cache, cfg=SPARSE):
    """Each layer's compressed caches are compress_keys' PHSA entries of its valid keys and flags."""
    for layer in cache.layers:
        st = layer.state
        B, L = st.k_cache.shape[0], st.length
        rows = [L] * B if st.rows is None else st.rows.tolist()
        for b, n_keys in enumerate(rows):
            cu = torch.tensor([0, n_keys], dtype=torch.int32, device=st.k_cache.device)
            for got, (w, s) in ((st.ck, (cfg.kernel_size, cfg.kernel_stride)),
                                (st.nk, (cfg.norm_kernel_size, cfg.norm_kernel_stride))):
                packed, cu_c = infllmv2.compress_keys(st.k_cache[b, :n_keys], cu, w, s,
                                                      punct_mask=st.punct[b, :n_keys], phsa_lambda=cfg.phsa_lambda)
                assert torch.equal(got[b, :int(cu_c[1])], packed), f"{w}/{s} PHSA compressed keys of row {b}"


def test_phsa_punctuation_hook_forward_equals_reference():
    """punctuation_hook passes each forward's punct_mask to the attention layers: the sparse path
    with PHSA, as reference.attention computes it, and not what it computes without."""
    ids = _punct_ids(1, 600, seed=31)
    model, ref = _model("infllmv2"), _model("infllmv2_reference")
    with torch.no_grad():
        plain = model(ids).logits
        hooks = [infllmv2.hf.punctuation_hook(m, PUNCT) for m in (model, ref)]
        got, want = model(ids).logits, ref(ids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(got, plain, atol=1e-3)  # PHSA changed the selection
        # given by hand, the same
        hooks[0].remove()
        torch.testing.assert_close(model(ids, punct_mask=infllmv2.phsa.punctuation_mask(ids, PUNCT)).logits, got,
                                   atol=0, rtol=0)
        torch.testing.assert_close(model(ids).logits, plain, atol=0, rtol=0)
        infllmv2.hf.punctuation_hook(model, PUNCT)
        with pytest.raises(ValueError, match="PHSA needs the forward's input_ids"):
            model(inputs_embeds=model.get_input_embeddings()(ids))


@pytest.mark.parametrize("mode", ["plain", "padded", "beams"])
def test_phsa_infllmv2_cache_generate_equals_recomputing(mode):
    """generate() with PHSA and InfLLMv2Cache (each cached key's flag kept beside it, PHSA compressed
    caches) against generate() without a cache (every step recomputes all the keys with all their
    flags): the same tokens and logits; plain batches, left-padded ones (compacted flags) and beam
    search (flags reordered with the keys)."""
    model = _model("infllmv2")
    infllmv2.hf.punctuation_hook(model, PUNCT)
    padded = mode == "padded"
    ids = _punct_ids(3 if padded else 2, 300, seed=32)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    if mode == "beams":
        kw.update(num_beams=3, output_logits=False)
    if padded:
        mask = torch.ones_like(ids)
        for b, p in enumerate((15, 0, 37)):
            mask[b, :p], ids[b, :p] = 0, 0
        kw["attention_mask"] = mask
    want = model.generate(ids, use_cache=False, **kw)
    cache = infllmv2.hf.InfLLMv2Cache()
    got = model.generate(ids, **_cache(cache), **kw)
    assert torch.equal(got.sequences, want.sequences)
    for g, w in zip(got.logits or (), want.logits or ()):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    st = cache.layers[0].state
    assert st.phsa and (st.rows is not None) == padded
    if mode == "beams":  # the beams' rows were reordered: compressed caches and flags still agree
        _assert_phsa_caches_hold_the_keys(cache)
        return
    # the cache holds the prompt and the 7 tokens fed back (not the last one generated)
    flags = torch.isin(got.sequences[:, :st.length], torch.tensor(PUNCT))
    for b in range(ids.shape[0]):
        valid = flags[b][kw["attention_mask"][b].bool().tolist() + [True] * 7] if padded else flags[b]
        assert torch.equal(st.punct[b, :valid.numel()], valid), f"row {b}'s cached flags"
    _assert_phsa_caches_hold_the_keys(cache)


def test_phsa_without_the_flags_of_every_key_raises():
    model = _model("infllmv2")
    ids = _punct_ids(1, 300, seed=33)
    flags = infllmv2.phsa.punctuation_mask(ids, PUNCT)
    with torch.no_grad():
        dyn = transformers.DynamicCache(config=model.config)
        model(ids, **_cache(dyn), punct_mask=flags)
        with pytest.raises(NotImplementedError, match="needs the flags of all 301 keys"):
            model(ids[:, :1], **_cache(dyn), punct_mask=flags[:, :1])
        for first, later in ((None, flags[:, :1]), (flags, None)):
            cache = infllmv2.hf.InfLLMv2Cache()
            model(ids, **_cache(cache), punct_mask=first)
            with pytest.raises(ValueError, match="InfLLMv2Cache: the prompt's forward passed"):
                model(ids[:, :1], **_cache(cache), punct_mask=later)
        with pytest.raises(ValueError, match=r"punct_mask must be a bool or integer tensor of shape \(batch=1, 300"):
            model(ids, punct_mask=flags[:, :7])


def test_phsa_infllmv2_cache_left_padded_steps_by_hand():
    """PHSA in a padded batch's compacted cache, against recomputing every key without a cache:
    steps of several tokens, padding inside a step (its flag dropped with its key, the row's later
    flags moved up), and a step with gradients (the general path over the compacted keys and
    flags)."""
    model = _model("infllmv2")
    ids, mask = _left_padded(2, 280, (9, 40), seed=41)
    ids[mask.bool()] = _punct_ids(1, int(mask.sum()), seed=42)[0]
    steps = _punct_ids(2, 8, seed=43)
    cache = infllmv2.hf.InfLLMv2Cache()
    seen = ids

    def both(tokens, m, grad=False):
        nonlocal seen
        seen = torch.cat([seen, tokens], 1) if seen is not tokens else seen
        flags = infllmv2.phsa.punctuation_mask(seen, PUNCT)
        with torch.set_grad_enabled(grad):
            got = model(tokens, attention_mask=m, **_cache(cache), punct_mask=flags[:, -tokens.shape[1]:]).logits
            want = model(seen, attention_mask=m, punct_mask=flags).logits[:, -tokens.shape[1]:]
        valid = m[:, -tokens.shape[1]:].bool()
        torch.testing.assert_close(got[valid], want[valid], atol=1e-4, rtol=1e-4)
        return got

    both(ids, mask)
    mask = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype)], 1)
    both(steps[:, :3], mask)
    mask = torch.cat([mask, torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=mask.dtype)], 1)
    both(steps[:, 3:6], mask)  # a hole inside a step
    assert cache.layers[0].state.rows.tolist() == [277, 245]
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    both(steps[:, 6:7], mask, grad=True).sum().backward()
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        both(steps[:, 7:8], mask)  # compresses the keys the gradient step left pending
    st, flags = cache.layers[0].state, infllmv2.phsa.punctuation_mask(seen, PUNCT)
    for b in range(2):  # each row's valid tokens' flags first, in order, as its keys
        assert torch.equal(st.punct[b, :int(st.rows[b])], flags[b][mask[b].bool()]), f"row {b}'s cached flags"
    _assert_phsa_caches_hold_the_keys(cache)


@pytest.mark.gpu
def test_cuda_phsa_infllmv2_cache_bf16_head_dim_128():
    """generate() with PHSA and InfLLMv2Cache against a DynamicCache loop given the flags of every
    key at each step: the same kernels on bitwise-equal PHSA compressed keys (the cache kernel's
    PHSA entries are compress_keys'), so the same tokens and bitwise logits."""
    model, ids = _model("infllmv2", 128, torch.bfloat16, "cuda"), _punct_ids(2, 300, seed=44, device="cuda")
    hook = infllmv2.hf.punctuation_hook(model, PUNCT)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    cache = infllmv2.hf.InfLLMv2Cache()
    got = model.generate(ids, **_cache(cache), **kw)
    hook.remove()
    seen, dyn, logits = ids, transformers.DynamicCache(config=model.config), []
    with torch.no_grad():
        out = model(ids, **_cache(dyn), punct_mask=infllmv2.phsa.punctuation_mask(ids, PUNCT))
        for _ in range(6):
            logits.append(out.logits[:, -1])
            seen = torch.cat([seen, logits[-1].argmax(-1, keepdim=True)], 1)
            out = model(seen[:, -1:], **_cache(dyn), punct_mask=infllmv2.phsa.punctuation_mask(seen, PUNCT))
    assert torch.equal(got.sequences, seen)
    for g, w in zip(got.logits, logits):  # generate() hands out the logits in fp32
        torch.testing.assert_close(g, w.float(), atol=0, rtol=0)
    _assert_phsa_caches_hold_the_keys(cache)
