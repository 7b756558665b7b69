"""select_decode_kvcache (the selection over compressed caches) and attention_kvcache (a whole
decoding step against a KV cache, the compressed caches kept across steps)."""

import pytest
import torch

import infllmv2
from infllmv2 import SparseConfig, _lib, reference
from infllmv2.testing import (assert_close_to_reference, cu_seqlens, every_block_selection, kv_cache_of, no_host_sync,
                              oracle_block_scores, punct_cache_of, random_tokens, selection_mismatch)

LAYOUTS = ("padded", "batch_idx", "paged64", "paged256")  # kv_cache_of's
# (query lengths, cache lengths)
LENGTH_MIXES = {
    "decode1": ([1], [1]),
    "decode65": ([1], [65]),
    "decode_mix": ([1, 1, 1, 1, 1], [3000, 63, 64, 65, 777]),
    "spec": ([3, 5, 1, 2], [2000, 65, 130, 4001]),
    "prefill": ([1, 63, 64, 65, 200], [1, 63, 64, 65, 700]),
}
SMALL = dict(topk=6, local_blocks=2)


def _case(lengths_q, lengths_k, G, D, dtype, layout, seed=0, heads_k=2, approx_lse=True):
    """q, the packed keys and their cache, and compressed caches brought up to date from NaN
    (their unused rows stay NaN, which no selection may read)."""
    q = random_tokens(lengths_q, G * heads_k, D, dtype, "cuda", seed=seed)
    k = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 1)
    kc, _, table = kv_cache_of(k, k, lengths_k, layout, seed)
    lens = torch.tensor(lengths_k, dtype=torch.int32, device="cuda")
    cap = kc.shape[1] * (1 if table is None else table.shape[1])
    caches = []
    for w, s in ((32, 16), (128, 64)) if approx_lse else ((32, 16),):
        c = torch.full((len(lengths_k), infllmv2.compressed_capacity(cap, w, s), heads_k, D), float("nan"),
                       dtype=dtype, device="cuda")
        caches.append(infllmv2.compress_keys_kvcache(kc, lens, c, max(lengths_k), table, w, s))
    return dict(q=q, k=k, kc=kc, table=table, lens=lens, cap=cap, ck=caches[0],
                nk=caches[1] if approx_lse else None, cu_q=cu_seqlens(lengths_q, "cuda"),
                cu_k=cu_seqlens(lengths_k, "cuda"))


def _select(c, num_splits=0, **kw):
    return infllmv2.select_decode_kvcache(c["q"], c["ck"], c["nk"], c["lens"], c["cu_q"], c["cap"],
                                          num_splits=num_splits, **{**SMALL, **kw})


# ---------------------------------------------------------------------------------- CPU tier


def test_cpu_reference_is_select_blocks_on_the_packed_keys():
    lengths_q, lengths_k = [1, 3, 1], [700, 200, 65]
    q = random_tokens(lengths_q, 8, 64, torch.float32, seed=1)
    k = random_tokens(lengths_k, 2, 64, torch.float32, seed=2)
    kc, _, table = kv_cache_of(k, k, lengths_k, "paged64")
    lens = torch.tensor(lengths_k, dtype=torch.int32)
    cap = kc.shape[1] * table.shape[1]
    ck = torch.zeros((3, infllmv2.compressed_capacity(cap), 2, 64))
    nk = torch.zeros((3, infllmv2.compressed_capacity(cap, 128, 64), 2, 64))
    infllmv2.compress_keys_kvcache(kc, lens, ck, 1000, table)
    infllmv2.compress_keys_kvcache(kc, lens, nk, 1000, table, 128, 64)
    got = infllmv2.select_decode_kvcache(q, ck, nk, lens, cu_seqlens(lengths_q), cap, **SMALL)
    want = reference.select_blocks(q, k, cu_seqlens(lengths_q), cu_seqlens(lengths_k), **SMALL)
    assert torch.equal(got, want)


@pytest.mark.parametrize("approx_lse", [True, False])
def test_cpu_attention_kvcache_is_attention_on_the_packed_keys(approx_lse):
    """A prefill into empty (NaN) compressed caches, then a decoding step of one token a sequence:
    each step's output is reference.attention's on the keys so far packed (the sparse path, and
    the dense one below dense_len), and the caches are compress_keys' of them."""
    final, hk, D = [700, 200, 65], 2, 32
    k_all = random_tokens(final, hk, D, torch.float64, seed=3)
    v_all = random_tokens(final, hk, D, torch.float64, seed=4)
    kc, vc, table = kv_cache_of(k_all, v_all, final, "paged64")
    cap = kc.shape[1] * table.shape[1]
    starts = torch.tensor([0] + final[:-1]).cumsum(0).tolist()
    for dense_len in (256, 8192):
        cfg = SparseConfig(dense_len=dense_len, window_size=128, topk=4, approx_lse=approx_lse)
        ck = torch.full((3, infllmv2.compressed_capacity(cap), hk, D), float("nan"), dtype=torch.float64)
        nk = torch.full((3, infllmv2.compressed_capacity(cap, 128, 64), hk, D), float("nan"), dtype=torch.float64)
        for now, n_q, new_keys in (([n - 1 for n in final], 2, max(final)), (final, 1, 1)):
            lens = torch.tensor(now, dtype=torch.int32)
            q = random_tokens([n_q] * 3, hk * 4, D, torch.float64, seed=sum(now))
            k = torch.cat([k_all[s:s + n] for s, n in zip(starts, now)])
            v = torch.cat([v_all[s:s + n] for s, n in zip(starts, now)])
            got = infllmv2.attention_kvcache(q, kc, vc, lens, cu_seqlens([n_q] * 3), ck, nk, new_keys, table, cfg)
            want = reference.attention(q, k, v, cu_seqlens([n_q] * 3), cu_seqlens(now), dense_len,
                                       topk=cfg.num_selected, local_blocks=cfg.local_blocks, approx_lse=approx_lse)[0]
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"dense_len {dense_len}, lengths {now}")
            packed, cu_c = reference.compress_keys(k, cu_seqlens(now))
            for b in range(3):
                assert torch.equal(ck[b, :cu_c[b + 1] - cu_c[b]], packed[cu_c[b]:cu_c[b + 1]])


def test_cpu_attention_kvcache_phsa_is_attention_with_the_punctuation_mask():
    """punct_cache: a prefill and a decoding step whose outputs are reference.attention's with the
    packed keys' punct_mask (PHSA at both levels), and caches of compress_keys' PHSA entries."""
    final, hk, D = [700, 200, 65], 2, 32
    k_all = random_tokens(final, hk, D, torch.float64, seed=3)
    v_all = random_tokens(final, hk, D, torch.float64, seed=4)
    kc, vc, table = kv_cache_of(k_all, v_all, final, "paged64")
    flags = torch.rand(sum(final), generator=torch.Generator().manual_seed(5)) < 0.2
    pc = punct_cache_of(flags, final, "paged64")[0]
    cap = kc.shape[1] * table.shape[1]
    starts = torch.tensor([0] + final[:-1]).cumsum(0).tolist()
    cfg = SparseConfig(dense_len=256, window_size=128, topk=4, phsa_lambda=0.3)
    ck = torch.full((3, infllmv2.compressed_capacity(cap), hk, D), float("nan"), dtype=torch.float64)
    nk = torch.full((3, infllmv2.compressed_capacity(cap, 128, 64), hk, D), float("nan"), dtype=torch.float64)
    for now, n_q, new_keys in (([n - 1 for n in final], 2, max(final)), (final, 1, 1)):
        lens = torch.tensor(now, dtype=torch.int32)
        q = random_tokens([n_q] * 3, hk * 4, D, torch.float64, seed=sum(now))
        k, v, punct = (torch.cat([t[s:s + n] for s, n in zip(starts, now)]) for t in (k_all, v_all, flags))
        got = infllmv2.attention_kvcache(q, kc, vc, lens, cu_seqlens([n_q] * 3), ck, nk, new_keys, table, cfg,
                                         punct_cache=pc)
        want = reference.attention(q, k, v, cu_seqlens([n_q] * 3), cu_seqlens(now), cfg.dense_len,
                                   topk=cfg.num_selected, local_blocks=cfg.local_blocks, punct_mask=punct,
                                   phsa_lambda=0.3)[0]
        plain = reference.attention(q, k, v, cu_seqlens([n_q] * 3), cu_seqlens(now), cfg.dense_len,
                                    topk=cfg.num_selected, local_blocks=cfg.local_blocks)[0]
        assert not torch.allclose(want, plain)  # PHSA moved the selection somewhere
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"lengths {now}")
        for cache, (w, s) in ((ck, (32, 16)), (nk, (128, 64))):
            packed, cu_c = reference.compress_keys(k, cu_seqlens(now), w, s, punct, 0.3)
            for b in range(3):
                assert torch.equal(cache[b, :cu_c[b + 1] - cu_c[b]], packed[cu_c[b]:cu_c[b + 1]])


def test_bad_inputs_name_the_argument():
    q = random_tokens([1, 1], 8, 64, torch.float32)
    ck = torch.zeros((2, 10, 2, 64))
    lens = torch.tensor([100, 100], dtype=torch.int32)
    with pytest.raises(ValueError, match="ck_cache holds 10 rows a sequence"):
        infllmv2.select_decode_kvcache(q, ck, None, lens, cu_seqlens([1, 1]), 1000)
    with pytest.raises(ValueError, match="ck_cache must hold a sequence per batch entry"):
        infllmv2.select_decode_kvcache(q, ck[:1], None, lens, cu_seqlens([1, 1]), 100)
    with pytest.raises(ValueError, match="nk_cache must have shape"):
        infllmv2.select_decode_kvcache(q, ck, ck[:, :, :1], lens, cu_seqlens([1, 1]), 100)
    with pytest.raises(ValueError, match="ck_cache must match q's dtype"):
        infllmv2.select_decode_kvcache(q, ck.double(), None, lens, cu_seqlens([1, 1]), 100)
    with pytest.raises(ValueError, match="nk_cache .* is needed with config.approx_lse"):
        infllmv2.attention_kvcache(q, torch.zeros((2, 128, 2, 64)), torch.zeros((2, 128, 2, 64)), lens,
                                   cu_seqlens([1, 1]), ck)
    kc = torch.zeros((2, 128, 2, 64))
    cfg = SparseConfig(approx_lse=False)
    with pytest.raises(ValueError, match=r"punct_cache must be a bool tensor of shape \(num_pages, page_size\)"):
        infllmv2.attention_kvcache(q, kc, kc, lens, cu_seqlens([1, 1]), ck, None, 1, None, cfg,
                                   punct_cache=torch.zeros((2, 64), dtype=torch.bool))


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("G", [1, 4, 16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mix", list(LENGTH_MIXES))
def test_cuda_equals_select_decode_on_the_packed_keys(dtype, head_dim, G, layout, mix):
    """With the same split count, the selection over the compressed caches is select_decode's on
    the packed keys bit for bit (the same compressed keys, the same kernels), and it is a valid
    top-K of the reference block scores (tie-aware)."""
    lengths_q, lengths_k = LENGTH_MIXES[mix]
    c = _case(lengths_q, lengths_k, G, head_dim, dtype, layout, seed=G)
    for splits in (1, 3):
        with no_host_sync():
            got = _select(c, splits, max_seqlen_q=max(lengths_q))
        want = infllmv2.select_decode(c["q"], c["k"], c["cu_q"], c["cu_k"], num_splits=splits, **SMALL,
                                      max_seqlen_k=c["cap"])
        assert torch.equal(got, want), f"splits {splits}"
    blocks = oracle_block_scores(c["q"], c["k"], c["cu_q"], c["cu_k"], 1, SMALL["local_blocks"])
    why = selection_mismatch(_select(c).cpu(), blocks, SMALL["topk"])
    assert why is None, why


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("padded", "paged64"))
def test_cuda_exact_normaliser(layout):
    lengths_q, lengths_k = LENGTH_MIXES["spec"]
    c = _case(lengths_q, lengths_k, 16, 128, torch.bfloat16, layout, approx_lse=False)
    got = _select(c, 4)
    want = infllmv2.select_decode(c["q"], c["k"], c["cu_q"], c["cu_k"], num_splits=4, approx_lse=False,
                                  max_seqlen_k=c["cap"], **SMALL)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_cuda_c_abi_errors_name_the_argument():
    lib = _lib.lib()
    c = _case([1, 1], [300, 100], 16, 128, torch.bfloat16, "paged64")
    out = torch.empty((2, 2, 6), dtype=torch.int32, device="cuda")
    ws = torch.empty(lib.infllmv2_select_decode_kvcache_workspace_size(2, 2, 1, c["cap"], 32, 2, 2),
                     dtype=torch.uint8, device="cuda")

    def call(**over):
        a = dict(cap=c["cap"], cap_c=c["ck"].shape[1], cap_n=c["nk"].shape[1], ws_size=ws.numel(), splits=2,
                 lens=c["lens"])
        a.update(over)
        st = lib.infllmv2_select_decode_kvcache(
            c["q"].data_ptr(), c["ck"].data_ptr(), c["nk"].data_ptr(), a["lens"].data_ptr(), c["cu_q"].data_ptr(),
            out.data_ptr(), ws.data_ptr(), a["ws_size"], 2, 2, 1, a["cap"], a["cap_c"], a["cap_n"], 32, 2, 128, 6,
            1, 2, 128, 64, _lib.DTYPE_BF16, 0.0, a["splits"], None)
        return st, lib.infllmv2_last_error().decode()

    assert call()[0] == _lib.OK
    st, msg = call(cap_c=3)
    assert st == _lib.ERR_INVALID_ARGUMENT and "capacity_c must hold the" in msg
    st, msg = call(cap_n=1)
    assert st == _lib.ERR_INVALID_ARGUMENT and "capacity_n must hold the" in msg
    st, msg = call(ws_size=16)
    assert st == _lib.ERR_INVALID_ARGUMENT and "infllmv2_select_decode_kvcache_workspace_size() asks" in msg
    st, msg = call(splits=65)
    assert st == _lib.ERR_INVALID_ARGUMENT and "splits must be in [1, 64]" in msg
    st, msg = call(lens=c["lens"].cpu())
    assert st == _lib.ERR_INVALID_ARGUMENT and "cache_seqlens" in msg


def _step_reference_check(out, q, k, v, cu_q, cu_k, idx, what):
    ref = []
    for dt in (torch.float32, q.dtype):
        o = reference.sparse_attn_varlen(*(t.cpu().to(dt) for t in (q, k, v)), cu_q.cpu(), cu_k.cpu(), idx.cpu())[0]
        ref.append(o)
    assert_close_to_reference(out.cpu(), ref[1], ref[0], what=what)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("G", [4, 16])
def test_cuda_attention_kvcache_decoding_loop(layout, G):
    """A prefill into empty compressed caches, then decoding steps of one token a sequence (and a
    speculative step of three): after every step the compressed caches are compress_keys' of the
    keys so far (bitwise), the selection is a valid top-K of the reference scores, and the output
    is the reference attention over it by the 2x rule. The sparse path (dense_len 256) and the
    dense one (the default dense_len) both."""
    torch.manual_seed(0)
    final = [900, 300, 1200]
    dtype, D, hk = torch.bfloat16, 128, 2
    k_all = random_tokens(final, hk, D, dtype, "cuda", seed=3)
    v_all = random_tokens(final, hk, D, dtype, "cuda", seed=4)
    kc, vc, table = kv_cache_of(k_all, v_all, final, layout)
    cap = kc.shape[1] * (1 if table is None else table.shape[1])
    for cfg in (SparseConfig(dense_len=256, window_size=128, topk=4), SparseConfig()):
        ck = torch.full((3, infllmv2.compressed_capacity(cap), hk, D), float("nan"), dtype=dtype, device="cuda")
        nk = torch.full((3, infllmv2.compressed_capacity(cap, 128, 64), hk, D), float("nan"), dtype=dtype,
                        device="cuda")
        now = [n - 6 for n in final]
        for new in (now, 1, 3, 1, 1):  # the prefill brings the caches up from nothing
            now = now if isinstance(new, list) else [n + new for n in now]
            n_q = 1 if isinstance(new, list) else new
            lens = torch.tensor(now, dtype=torch.int32, device="cuda")
            starts = torch.tensor([0] + final[:-1]).cumsum(0).tolist()
            k = torch.cat([k_all[s:s + n] for s, n in zip(starts, now)])
            v = torch.cat([v_all[s:s + n] for s, n in zip(starts, now)])
            cu_k = cu_seqlens(now, "cuda")
            cu_q = cu_seqlens([n_q] * 3, "cuda")
            q = random_tokens([n_q] * 3, hk * G, D, dtype, "cuda", seed=sum(now))
            new_keys = max(now) if isinstance(new, list) else new
            with no_host_sync():
                out = infllmv2.attention_kvcache(q, kc, vc, lens, cu_q, ck, nk, new_keys, table, cfg,
                                                 max_seqlen_q=n_q, max_seqlen_k=max(now))
            for cache, (w, s) in ((ck, (32, 16)), (nk, (128, 64))):
                packed, cu_c = infllmv2.compress_keys(k, cu_k, w, s)
                for b in range(3):
                    want = packed[cu_c[b]:cu_c[b + 1]]
                    assert torch.equal(cache[b, :want.shape[0]], want), f"{w}/{s} cache of sequence {b}"
            if max(now) < cfg.dense_len:
                idx = every_block_selection(hk, q.shape[0], max(now), "cuda")
            else:
                idx = infllmv2.select_decode_kvcache(q, ck, nk, lens, cu_q, cap, topk=cfg.num_selected,
                                                     local_blocks=cfg.local_blocks)
                blocks = oracle_block_scores(q, k, cu_q, cu_k, cfg.init_blocks, cfg.local_blocks)
                why = selection_mismatch(idx.cpu(), blocks, cfg.num_selected)
                assert why is None, why
            _step_reference_check(out, q, k, v, cu_q, cu_k, idx, f"step to {now} (dense_len {cfg.dense_len})")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("approx_lse", [True, False])
def test_cuda_attention_kvcache_phsa(layout, approx_lse):
    """With punct_cache, a prefill and decoding steps (one token, then a speculative three): after
    every step the compressed caches are compress_keys' PHSA entries of the keys so far (bitwise),
    and the output is bitwise the plain step's over caches built that way (PHSA changes stage 0
    only); no host synchronisation."""
    final = [900, 300, 1200]
    dtype, D, hk, G = torch.bfloat16, 128, 2, 16
    k_all = random_tokens(final, hk, D, dtype, "cuda", seed=3)
    v_all = random_tokens(final, hk, D, dtype, "cuda", seed=4)
    kc, vc, table = kv_cache_of(k_all, v_all, final, layout)
    flags = (torch.rand(sum(final), generator=torch.Generator().manual_seed(5)) < 0.2).cuda()
    pc = punct_cache_of(flags, final, layout)[0]
    cap = kc.shape[1] * (1 if table is None else table.shape[1])
    cfg = SparseConfig(dense_len=256, window_size=128, topk=4, phsa_lambda=0.3, approx_lse=approx_lse)
    levels = ((32, 16), (128, 64)) if approx_lse else ((32, 16),)
    caches = [[torch.full((3, infllmv2.compressed_capacity(cap, w, s), hk, D), float("nan"), dtype=dtype,
                          device="cuda") for w, s in levels] for _ in range(2)]
    starts = torch.tensor([0] + final[:-1]).cumsum(0).tolist()
    now = [n - 6 for n in final]
    for new in (now, 1, 3, 1):
        now = now if isinstance(new, list) else [n + new for n in now]
        n_q = 1 if isinstance(new, list) else new
        lens = torch.tensor(now, dtype=torch.int32, device="cuda")
        k, punct = (torch.cat([t[s:s + n] for s, n in zip(starts, now)]) for t in (k_all, flags))
        cu_q = cu_seqlens([n_q] * 3, "cuda")
        q = random_tokens([n_q] * 3, hk * G, D, dtype, "cuda", seed=sum(now))
        new_keys = max(now) if isinstance(new, list) else new
        nk = caches[0][1] if approx_lse else None
        with no_host_sync():
            out = infllmv2.attention_kvcache(q, kc, vc, lens, cu_q, caches[0][0], nk, new_keys, table, cfg,
                                             max_seqlen_q=n_q, max_seqlen_k=max(now), punct_cache=pc)
        for got, built, (w, s) in zip(caches[0], caches[1], levels):
            packed, cu_c = infllmv2.compress_keys(k, cu_seqlens(now, "cuda"), w, s, punct_mask=punct, phsa_lambda=0.3)
            for b in range(3):
                want = packed[cu_c[b]:cu_c[b + 1]]
                assert torch.equal(got[b, :want.shape[0]], want), f"{w}/{s} cache of sequence {b}, step to {now}"
                built[b, :want.shape[0]] = want
        nk = caches[1][1] if approx_lse else None
        want = infllmv2.attention_kvcache(q, kc, vc, lens, cu_q, caches[1][0], nk, 0, table, cfg, max_seqlen_q=n_q,
                                          max_seqlen_k=max(now))
        assert torch.equal(out, want), f"step to {now}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("padded", "paged64"))
@pytest.mark.parametrize("approx_lse", [True, False])
def test_cuda_attention_kvcache_is_its_ops_composed(layout, approx_lse):
    """infllmv2_attention_kvcache, the step in one C call (both compressed caches in one launch),
    raw through ctypes and through infllmv2.attention_kvcache, against the ops it chains called one
    by one (compress_keys_kvcache for each level, then dense_decode_kvcache, or select_decode_kvcache
    and sparse_decode_kvcache; the same split counts): bitwise out, lse and compressed caches, on the
    sparse and the dense path; and its argument errors."""
    import ctypes

    from infllmv2.ops import _stream

    lib = _lib.lib()
    lengths, dtype, D, hk, G = [900, 300, 1200], torch.bfloat16, 128, 2, 16
    k = random_tokens(lengths, hk, D, dtype, "cuda", seed=5)
    v = random_tokens(lengths, hk, D, dtype, "cuda", seed=6)
    kc, vc, table = kv_cache_of(k, v, lengths, layout)
    pps = 0 if table is None else table.shape[1]
    cap = kc.shape[1] * max(pps, 1)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = random_tokens([1, 1, 1], hk * G, D, dtype, "cuda", seed=7)
    cu_q = cu_seqlens([1, 1, 1], "cuda")
    for dense_len in (256, 8192):
        cfg = SparseConfig(dense_len=dense_len, window_size=128, topk=4, approx_lse=approx_lse)
        c = _lib.SparseConfigC(**{f: int(getattr(cfg, f)) for f, _ in _lib.SparseConfigC._fields_})
        caches = []
        for _ in range(3):  # the ops', the C call's, attention_kvcache's
            ck = torch.full((3, infllmv2.compressed_capacity(cap), hk, D), float("nan"), dtype=dtype, device="cuda")
            nk = torch.full((3, infllmv2.compressed_capacity(cap, 128, 64), hk, D), float("nan"), dtype=dtype,
                            device="cuda")
            caches.append((ck, nk))
        ck, nk = caches[0]
        infllmv2.compress_keys_kvcache(kc, lens, ck, max(lengths), table)
        if approx_lse:
            infllmv2.compress_keys_kvcache(kc, lens, nk, max(lengths), table, 128, 64)
        if max(lengths) < dense_len:
            want, want_lse = infllmv2.dense_decode_kvcache(q, kc, vc, lens, cu_q, table, 1, max(lengths),
                                                           return_lse=True)
        else:
            idx = infllmv2.select_decode_kvcache(q, ck, nk if approx_lse else None, lens, cu_q, cap,
                                                 topk=cfg.num_selected, local_blocks=cfg.local_blocks)
            want, want_lse = infllmv2.sparse_decode_kvcache(q, kc, vc, lens, cu_q, idx, table, 1, return_lse=True)
        got, got_lse = infllmv2.attention_kvcache(q, kc, vc, lens, cu_q, *caches[2], max(lengths), table, cfg,
                                                  max_seqlen_q=1, max_seqlen_k=max(lengths), return_lse=True)
        assert torch.equal(got, want) and torch.equal(got_lse, want_lse), f"dense_len {dense_len}"
        for i in range(approx_lse + 1):
            assert torch.equal(caches[2][i].nan_to_num(7.0), caches[0][i].nan_to_num(7.0))
        size = lib.infllmv2_attention_kvcache_workspace_size(3, 3, 1, max(lengths), kc.shape[0], kc.shape[1], pps,
                                                            hk * G, hk, D, ctypes.byref(c))
        assert size > 0, lib.infllmv2_last_error().decode()
        ws = torch.full((size,), 255, dtype=torch.uint8, device="cuda")
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[1], 3), float("nan"), device="cuda")
        ck, nk = caches[1]

        def call(**over):
            a = dict(ws_size=size, max_k=max(lengths), nk=nk.data_ptr() if approx_lse else None, new=max(lengths),
                     punct=None, lam=0.5, v=vc.data_ptr(), lens=lens.data_ptr(), out=out.data_ptr(), lse=lse.data_ptr())
            a.update(over)
            return lib.infllmv2_attention_kvcache(
                q.data_ptr(), kc.data_ptr(), a["v"], None if table is None else table.data_ptr(),
                a["lens"], cu_q.data_ptr(), a["punct"], a["lam"], ck.data_ptr(), a["nk"], a["out"], a["lse"],
                ws.data_ptr(), a["ws_size"], 3, 3, 1, a["max_k"], kc.shape[0], kc.shape[1], pps, ck.shape[1],
                nk.shape[1], a["new"], hk * G, hk, D, _lib.DTYPE_BF16, 0.0, ctypes.byref(c), _stream(q.device))

        with no_host_sync():
            st = call()
        assert st == _lib.OK, lib.infllmv2_last_error().decode()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse), f"dense_len {dense_len}"
        assert torch.equal(ck.nan_to_num(7.0), caches[0][0].nan_to_num(7.0))
        if approx_lse:
            assert torch.equal(nk.nan_to_num(7.0), caches[0][1].nan_to_num(7.0))
        assert call(ws_size=16) == _lib.ERR_INVALID_ARGUMENT
        assert "infllmv2_attention_kvcache_workspace_size() asks" in lib.infllmv2_last_error().decode()
        assert call(max_k=cap + 1) == _lib.ERR_INVALID_ARGUMENT
        assert "max_seqlen_k must be in" in lib.infllmv2_last_error().decode()
        if approx_lse:
            assert call(nk=None) == _lib.ERR_INVALID_ARGUMENT
            assert "nk_cache" in lib.infllmv2_last_error().decode()
        pc = torch.zeros(kc.shape[:2], dtype=torch.uint8, device="cuda")
        assert call(punct=pc.data_ptr(), lam=-0.5) == _lib.ERR_INVALID_ARGUMENT
        assert "infllmv2_attention_kvcache: phsa_lambda must be in [0, 1], got -0.5" in lib.infllmv2_last_error().decode()
        pc_host = pc.cpu()
        assert call(punct=pc_host.data_ptr()) == _lib.ERR_INVALID_ARGUMENT
        assert "punct_cache" in lib.infllmv2_last_error().decode()
        # every pointer is checked before the first launch: a bad one leaves the compressed caches
        # as they were (the ops it chains checked theirs one op at a time, after the cache update)
        ck.fill_(float("nan"))
        host = torch.empty(64, dtype=torch.int32)
        for name, over in (("v_cache", "v"), ("cache_seqlens", "lens"), ("out", "out"), ("lse", "lse")):
            assert call(**{over: host.data_ptr()}) == _lib.ERR_INVALID_ARGUMENT, name
            text = lib.infllmv2_last_error().decode()
            assert f"infllmv2_attention_kvcache: {name} must be device memory" in text, text
        torch.cuda.synchronize()
        assert torch.isnan(ck).all()


@pytest.mark.gpu
@pytest.mark.parametrize("thread", ["same", "new"])
def test_cuda_attention_kvcache_dense_step_in_cuda_graph(thread):
    """The dense step updates the compressed caches on a side stream beside the attention (a
    parallel branch once captured): captured into a CUDA graph and replayed, in the thread whose
    eager step made that stream and in a new thread that has none (the update then stays on the
    caller's stream), it writes what the eager step writes, bitwise, out and both caches; and a
    kernel queued after the step on the caller's stream sees the updated caches."""
    import threading

    # each length's last key completes a fine entry, 1216's a coarse one too
    lengths, dtype, D, hk, G = [912, 304, 1216], torch.bfloat16, 128, 2, 16
    k = random_tokens(lengths, hk, D, dtype, "cuda", seed=11)
    v = random_tokens(lengths, hk, D, dtype, "cuda", seed=12)
    kc, vc, table = kv_cache_of(k, v, lengths, "paged64")
    cap = kc.shape[1] * table.shape[1]
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = random_tokens([1, 1, 1], hk * G, D, dtype, "cuda", seed=13)
    cu_q = cu_seqlens([1, 1, 1], "cuda")
    cfg = SparseConfig()  # dense_len 8192: the dense path
    start = []
    for w, s in ((32, 16), (128, 64)):
        c = torch.full((3, infllmv2.compressed_capacity(cap, w, s), hk, D), float("nan"), dtype=dtype, device="cuda")
        start.append(infllmv2.compress_keys_kvcache(kc, lens - 1, c, max(lengths) - 1, table, w, s))

    def step(ck, nk):
        return infllmv2.attention_kvcache(q, kc, vc, lens, cu_q, ck, nk, 1, table, cfg, max_seqlen_q=1,
                                          max_seqlen_k=max(lengths), return_lse=True)

    eager = [c.clone() for c in start]
    want, want_lse = step(*eager)
    assert not torch.equal(eager[0].nan_to_num(7.0), start[0].nan_to_num(7.0))  # the step wrote entries
    got = {}

    def capture():
        caches = [c.clone() for c in start]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out, lse = step(*caches)
                after = caches[0].nan_to_num(0.0).float().sum()  # queued after the step on its stream
        torch.cuda.current_stream().wait_stream(side)
        for c, s0 in zip(caches, start):
            c.copy_(s0)
        graph.replay()
        torch.cuda.synchronize()
        got.update(out=out, lse=lse, caches=caches, after=after)

    if thread == "same":
        capture()
    else:
        t = threading.Thread(target=capture)
        t.start()
        t.join()
    assert torch.equal(got["out"], want) and torch.equal(got["lse"], want_lse)
    for c, e in zip(got["caches"], eager):
        assert torch.equal(c.nan_to_num(7.0), e.nan_to_num(7.0))
    assert torch.equal(got["after"], eager[0].nan_to_num(0.0).float().sum())


@pytest.mark.gpu
def test_cuda_attention_kvcache_torch_compile_fullgraph():
    """The step (a custom op mutating both compressed caches) traces without a graph break, and
    the compiled step writes what the eager one does."""
    c = _case([1, 1, 1], [900, 300, 1200], 16, 128, torch.bfloat16, "paged64")
    vc = torch.randn_like(c["kc"])
    cfg = SparseConfig(dense_len=256, window_size=128, topk=4)
    caches = [tuple(torch.full_like(t, float("nan")) for t in (c["ck"], c["nk"])) for _ in range(2)]

    def step(q, kc, vc, ck, nk):
        out = infllmv2.attention_kvcache(q, kc, vc, c["lens"], c["cu_q"], ck, nk, 1200, c["table"], cfg,
                                         max_seqlen_q=1, max_seqlen_k=1200)
        return out * 1

    want = step(c["q"], c["kc"], vc, *caches[0])
    got = torch.compile(step, fullgraph=True)(c["q"], c["kc"], vc, *caches[1])
    assert torch.equal(got, want)
    for a, b in zip(*caches):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
