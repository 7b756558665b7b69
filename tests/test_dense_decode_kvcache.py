"""dense_decode_kvcache (dense causal attention of few queries over a padded or paged KV cache,
split over the keys): kernels against the reference, against sparse_decode_kvcache with every
block selected, and their argument errors."""

import ctypes

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.ops import (_stream, dense_decode_kvcache_launch, dense_decode_kvcache_splits,
                          dense_decode_kvcache_workspace_floats)
from infllmv2.testing import (assert_close_to_reference, cu_seqlens, every_block_selection, kv_cache_of, max_seqlen,
                              no_host_sync, random_tokens)

# (query lengths, cache lengths): the new tokens are the last of their sequence's keys
LENGTH_MIXES = {
    "decode1": ([1], [1]),
    "decode63": ([1], [63]),
    "decode64": ([1], [64]),
    "decode65": ([1], [65]),
    "decode_mix": ([1, 1, 1, 1, 1], [3000, 63, 64, 65, 777]),
    "spec": ([3, 5, 1, 2], [2000, 65, 130, 4001]),
    "prefill": ([1, 63, 64, 65, 200, 3], [1, 63, 64, 65, 200, 700]),
}
LAYOUTS = ("padded", "batch_idx", "paged64", "paged256")  # kv_cache_of's


def _case(lengths_q, lengths_k, G, D, dtype, layout, seed=0, heads_k=2, device="cuda"):
    q = random_tokens(lengths_q, G * heads_k, D, dtype, device, seed=seed)
    k = random_tokens(lengths_k, heads_k, D, dtype, device, seed=seed + 1)
    v = random_tokens(lengths_k, heads_k, D, dtype, device, seed=seed + 2)
    kc, vc, table = kv_cache_of(k, v, lengths_k, layout, seed)
    lens = torch.tensor(lengths_k, dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, table=table, lens=lens, cu_q=cu_seqlens(lengths_q, device),
                cu_k=cu_seqlens(lengths_k, device))


def _poisoned(c, splits):
    """The kernels into NaN-poisoned outputs and workspace, so an unwritten element cannot pass."""
    q = c["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    ws = torch.full((dense_decode_kvcache_workspace_floats(q, splits),), float("nan"), device=q.device)
    dense_decode_kvcache_launch(q, c["kc"], c["vc"], c["cu_q"], c["lens"], c["table"], max_seqlen(c["cu_q"]), 0.0,
                                splits, out, lse, ws)
    return out, lse


def _check(c, splits, what):
    """The 2x error rule against the dense reference over the packed keys, out and lse."""
    out, lse = _poisoned(c, splits)
    q, k, v = c["q"], c["k"], c["v"]
    ref32 = reference.dense_attn_varlen(q.float(), k.float(), v.float(), c["cu_q"], c["cu_k"])
    lowp = reference.dense_attn_varlen(q, k, v, c["cu_q"], c["cu_k"])
    assert torch.isfinite(lse).all(), f"{what}: a row with keys has a non-finite lse"
    assert_close_to_reference(out, lowp[0], ref32[0], what=f"{what} out")
    assert_close_to_reference(lse, lowp[1], ref32[1], what=f"{what} lse")
    return out, lse


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("lengths", list(LENGTH_MIXES))
def test_paged_matches_reference(dtype, head_dim, G, lengths):
    lq, lk = LENGTH_MIXES[lengths]
    c = _case(lq, lk, G, head_dim, dtype, "paged64", seed=G + head_dim)
    for splits in (1, 3, 40, 128):  # one range, uneven ones, more ranges than blocks, the most
        _check(c, splits, f"{dtype} D{head_dim} G{G} {lengths} splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lengths", list(LENGTH_MIXES))
@pytest.mark.parametrize("dtype, head_dim, G", [(torch.bfloat16, 128, 16), (torch.float16, 64, 4)])
def test_layouts_match_reference(layout, lengths, dtype, head_dim, G):
    lq, lk = LENGTH_MIXES[lengths]
    c = _case(lq, lk, G, head_dim, dtype, layout, seed=7)
    for splits in (1, 5):
        _check(c, splits, f"{layout} {lengths} G{G} splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded", "paged64"])
@pytest.mark.parametrize("splits", [1, 2, 7])
def test_one_token_equals_sparse_decode_with_every_block(layout, splits):
    # with one token a sequence, every block selected and the same splits, sparse_decode_kvcache
    # walks the same ranges in the same order (the partial last block last): bitwise the same
    lq, lk = [1, 1, 1, 1], [4000, 65, 8192, 1]
    c = _case(lq, lk, 16, 128, torch.bfloat16, layout, seed=11)
    out, lse = _poisoned(c, splits)
    idx = every_block_selection(2, 4, max(lk), "cuda")
    want = infllmv2.sparse_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], idx, c["table"],
                                          max_seqlen_q=1, num_splits=splits, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("lq", [1, 3])
def test_long_caches_any_length(lq):
    # past sparse_decode_kvcache's 128 blocks (8192 keys): 100K keys in 256-key pages, 8193, and
    # 20001 in a sequence; the library's splits, sized by the longest
    lk = [100_000, 8193, 20_001]
    c = _case([lq] * 3, lk, 16, 128, torch.bfloat16, "paged256", seed=3)
    splits = dense_decode_kvcache_splits(c["q"], 2, c["cu_q"], lq, max(lk), 0)
    assert splits > 1
    want = _check(c, splits, f"long lq {lq} splits {splits}")
    out, lse = infllmv2.dense_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["table"],
                                             max_seqlen_q=lq, max_seqlen_k=max(lk), return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.gpu
def test_lengths_are_read_on_the_device():
    # max_seqlen_k only sizes the split count: a sequence longer than it is still attended whole,
    # and the default (the capacity) gives the same result as a tight one with the same splits
    lq, lk = [1, 1], [20_000, 300]
    c = _case(lq, lk, 16, 128, torch.bfloat16, "paged256", seed=4)
    few = infllmv2.dense_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["table"], max_seqlen_q=1,
                                        max_seqlen_k=64, return_lse=True)
    ref32 = reference.dense_attn_varlen(c["q"].float(), c["k"].float(), c["v"].float(), c["cu_q"], c["cu_k"])
    lowp = reference.dense_attn_varlen(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"])
    assert_close_to_reference(few[0], lowp[0], ref32[0], what="max_seqlen_k below the lengths")
    with no_host_sync():
        a = infllmv2.dense_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["table"],
                                          max_seqlen_q=1, num_splits=9, return_lse=True)
    b = _poisoned(c, 9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_queries_without_keys(splits):
    # three queries against a cache of one key: the first two sit before it (no key visible:
    # out 0, lse -inf), the last sees the one key (out its value, lse the scaled score)
    c = _case([3, 1], [1, 70], 4, 128, torch.bfloat16, "paged64", seed=9)
    out, lse = _poisoned(c, splits)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isneginf(lse[:, :2]).all()
    hk0 = slice(0, 4)
    assert torch.equal(out[2, hk0], c["v"][0, 0].expand(4, -1))
    score = (c["q"][2, hk0].float() @ c["k"][0, 0].float()) / 128 ** 0.5
    torch.testing.assert_close(lse[hk0, 2], score, rtol=1e-5, atol=1e-5)
    ref32 = reference.dense_attn_varlen(c["q"][3:].float(), c["k"][1:].float(), c["v"][1:].float(),
                                        cu_seqlens([1]).cuda(), cu_seqlens([70]).cuda())
    torch.testing.assert_close(out[3].float(), ref32[0][0], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_lengths_past_the_capacity_are_clamped():
    # a caller's length beyond its pages reads no memory outside them: it counts as the capacity
    lq, lk = [1, 1], [128, 300]
    c = _case(lq, lk, 4, 128, torch.bfloat16, "paged64", seed=5)
    capacity = 64 * c["table"].shape[1]
    c["kc"] = torch.nan_to_num(c["kc"])  # rows past the keys now count: make them finite
    c["vc"] = torch.nan_to_num(c["vc"])
    c["lens"][0] = 10_000_000
    got = _poisoned(c, 3)
    clamped = dict(c, lens=torch.tensor([capacity, 300], dtype=torch.int32, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(got, _poisoned(clamped, 3)))


@pytest.mark.gpu
def test_bitwise_deterministic():
    c = _case([1, 2, 1], [9000, 4000, 100], 16, 128, torch.bfloat16, "paged64")
    first = _poisoned(c, 7)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, _poisoned(c, 7)))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_portable_arch_variants_through_ptx(arch, G, arch_override):
    if arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} not compiled into this build")
    arch_override(arch)
    for dtype, D, layout in ((torch.bfloat16, 128, "paged64"), (torch.float16, 64, "padded")):
        for lengths in ("decode_mix", "spec"):
            lq, lk = LENGTH_MIXES[lengths]
            _check(_case(lq, lk, G, D, dtype, layout, seed=G), 5, f"{arch} G{G} {layout} {lengths}")


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    c = _case([1, 1], [3000, 700], 16, 128, torch.bfloat16, "paged256")

    def f(q, kc, vc):
        return infllmv2.dense_decode_kvcache(q, kc, vc, c["lens"], c["cu_q"], c["table"], max_seqlen_q=1,
                                             num_splits=4)

    assert torch.equal(torch.compile(f, fullgraph=True)(c["q"], c["kc"], c["vc"]), f(c["q"], c["kc"], c["vc"]))


@pytest.mark.gpu
def test_cuda_bad_inputs_name_the_argument():
    c = _case([1], [640], 4, 128, torch.bfloat16, "paged64")
    q, kc, vc, lens, cu_q, table = c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["table"]
    call = infllmv2.dense_decode_kvcache
    with pytest.raises(ValueError, match="forward only"):
        call(q.clone().requires_grad_(), kc, vc, lens, cu_q, table)
    with pytest.raises(ValueError, match="page_size .* multiple of 64"):
        call(q, kc[:, :48].contiguous(), vc[:, :48].contiguous(), lens, cu_q, table)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        call(q, kc.transpose(0, 1), vc.transpose(0, 1), lens, cu_q, table)
    with pytest.raises(ValueError, match="cache_seqlens must have 1 entries"):
        call(q, kc, vc, lens.repeat(2), cu_q, table)
    with pytest.raises(ValueError, match="num_splits must be at most 128"):
        call(q, kc, vc, lens, cu_q, table, num_splits=129)
    with pytest.raises(ValueError, match="max_seqlen_k must be"):
        call(q, kc, vc, lens, cu_q, table, max_seqlen_k=-1)


@pytest.mark.gpu
def test_c_abi_errors_name_the_argument():
    lib = _lib.lib()
    c = _case([1, 1], [640, 100], 16, 128, torch.bfloat16, "paged64")
    q, kc, vc, table = c["q"], c["kc"], c["vc"], c["table"]
    splits = 4
    size = lib.infllmv2_dense_decode_kvcache_workspace_size(2, 32, 128, splits)
    assert size == dense_decode_kvcache_workspace_floats(q, splits) * 4 > 0
    ws = torch.empty(size // 4 + 64, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((32, 2), float("nan"), device="cuda")
    host = torch.zeros(64, dtype=torch.int32)

    def call(**over):
        a = dict(q=q.data_ptr(), lens=c["lens"].data_ptr(), ws=ws.data_ptr(), ws_size=size, splits=splits, D=128,
                 heads=32, dtype=_lib.DTYPE_BF16, out=out.data_ptr(), page=kc.shape[1])
        a.update(over)
        return lib.infllmv2_dense_decode_kvcache(
            a["q"], kc.data_ptr(), vc.data_ptr(), table.data_ptr(), a["lens"], c["cu_q"].data_ptr(), a["out"],
            lse.data_ptr(), a["ws"], a["ws_size"], 2, 2, 1, kc.shape[0], a["page"], table.shape[1], a["heads"], 2,
            a["D"], a["splits"], a["dtype"], 0.0, _stream(q.device))

    assert call() == _lib.OK, lib.infllmv2_last_error().decode()
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()
    cases = [
        (dict(splits=0), _lib.ERR_INVALID_ARGUMENT, "splits must be in [1, 128]"),
        (dict(splits=129), _lib.ERR_INVALID_ARGUMENT, "splits must be in [1, 128]"),
        (dict(ws_size=size - 4), _lib.ERR_INVALID_ARGUMENT, "infllmv2_dense_decode_kvcache_workspace_size() asks"),
        (dict(q=None), _lib.ERR_INVALID_ARGUMENT, "q is NULL"),
        (dict(lens=host.data_ptr()), _lib.ERR_INVALID_ARGUMENT, "cache_seqlens must be device memory"),
        (dict(out=out.data_ptr() + 2), _lib.ERR_INVALID_ARGUMENT, "out must be 16-byte aligned"),
        (dict(D=96), _lib.ERR_UNSUPPORTED, "head_dim must be 64 or 128"),
        (dict(heads=31), _lib.ERR_INVALID_ARGUMENT, "heads (31) must be a multiple of heads_k (2)"),
        (dict(dtype=2), _lib.ERR_INVALID_ARGUMENT, "dtype must be"),
        (dict(page=48), _lib.ERR_UNSUPPORTED, "page_size must be a multiple of 64"),
    ]
    for over, status, message in cases:
        st = call(**over)
        text = lib.infllmv2_last_error().decode()
        assert st == status and text.startswith("infllmv2_dense_decode_kvcache: ") and message in text, (over, st, text)
    assert lib.infllmv2_dense_decode_kvcache_splits(1, 1, 32, 2, -1, 0) == 0
    assert lib.infllmv2_dense_decode_kvcache_splits(1, 1, 32, 2, 1 << 17, 5) == 5
    assert 1 < lib.infllmv2_dense_decode_kvcache_splits(1, 1, 32, 2, 1 << 17, 0) <= 64
    assert lib.infllmv2_dense_decode_kvcache_splits(1, 1, 32, 2, 64, 0) == 1  # one block: nothing to split


# ---------------------------------------------------------------------------------- CPU tier


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lengths", ["decode_mix", "spec", "prefill"])
def test_cpu_matches_dense_reference_over_the_packed_keys(layout, lengths):
    lq, lk = LENGTH_MIXES[lengths]
    c = _case(lq, lk, 4, 16, torch.float64, layout, seed=2, device="cpu")
    out, lse = infllmv2.dense_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["table"],
                                             return_lse=True)
    want, want_lse = reference.dense_attn_varlen(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.to(lse.dtype), rtol=0, atol=1e-6)


def test_cpu_bad_inputs_name_the_argument():
    c = _case([1], [100], 4, 16, torch.float32, "paged64", device="cpu")
    q, kc, vc, lens, cu_q, table = c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["table"]
    call = infllmv2.dense_decode_kvcache
    with pytest.raises(ValueError, match="forward only"):
        call(q.clone().requires_grad_(), kc, vc, lens, cu_q, table)
    with pytest.raises(ValueError, match="num_splits must be at most 128"):
        call(q, kc, vc, lens, cu_q, table, num_splits=129)
    with pytest.raises(ValueError, match="k_cache and v_cache must both have shape"):
        call(q, kc, vc[..., :8], lens, cu_q, table)
    with pytest.raises(ValueError, match="block_table must be an int32 tensor of shape"):
        call(q, kc, vc, lens, cu_q, table.view(-1))
    with pytest.raises(ValueError, match="q must be a tensor of shape"):
        call(q[0], kc, vc, lens, cu_q, table)
