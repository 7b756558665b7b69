"""sparse_decode_kvcache (sparse_decode over a padded or paged KV cache) and the compat
infllmv2_attn_with_kvcache over it: kernels against the reference and against sparse_decode."""

import math

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.compat import _rotate, infllmv2_attn_with_kvcache
from infllmv2.ops import (sort_topk_idx, sparse_decode_kvcache_launch, sparse_decode_kvcache_workspace_floats,
                          sparse_decode_launch, sparse_decode_workspace_floats)
from infllmv2.testing import (assert_close_to_reference, assert_sparse_forward_close, cu_seqlens, kv_cache_of,
                              max_seqlen, no_host_sync, random_tokens, realistic_topk)

# (query lengths, cache lengths), as test_sparse_decode's
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


def _case(lengths_q, lengths_k, G, D, dtype, layout, topk=12, seed=0, heads_k=2, local_blocks=2, device="cuda"):
    q = random_tokens(lengths_q, G * heads_k, D, dtype, device, seed=seed)
    k = random_tokens(lengths_k, heads_k, D, dtype, device, seed=seed + 1)
    v = random_tokens(lengths_k, heads_k, D, dtype, device, seed=seed + 2)
    idx = realistic_topk(lengths_q, lengths_k, heads_k, topk, local_blocks=local_blocks, correlated=False,
                         device=device, seed=seed)
    kc, vc, table = kv_cache_of(k, v, lengths_k, layout, seed)
    lens = torch.tensor(lengths_k, dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, table=table, lens=lens, idx=idx, cu_q=cu_seqlens(lengths_q, device),
                cu_k=cu_seqlens(lengths_k, device))


def _poisoned(c, splits):
    """The kernels into NaN-poisoned outputs and workspace, so an unwritten element cannot pass."""
    q = c["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    ws = torch.full((sparse_decode_kvcache_workspace_floats(q, splits),), float("nan"), device=q.device)
    sparse_decode_kvcache_launch(q, c["kc"], c["vc"], sort_topk_idx(c["idx"]), c["cu_q"], c["lens"], c["table"],
                                 max_seqlen(c["cu_q"]), 0.0, splits, out, lse, ws)
    return out, lse


def _packed_decode(c, splits):
    """sparse_decode on the same keys packed: what the cache call must equal bitwise."""
    q = c["q"]
    out, lse = torch.empty_like(q), torch.empty((q.shape[1], q.shape[0]), device=q.device)
    n = sparse_decode_workspace_floats(q, splits)
    ws = torch.empty(n, device=q.device) if n else None
    sparse_decode_launch(q, c["k"], c["v"], sort_topk_idx(c["idx"]), c["cu_q"], c["cu_k"], max_seqlen(c["cu_q"]), 0.0,
                         splits, out, lse, ws)
    return out, lse


def _check(c, splits, what):
    out, lse = _poisoned(c, splits)
    assert_sparse_forward_close(out, lse, c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["idx"], what)
    if splits > 1 and max_seqlen(c["cu_q"]) == 1:
        # one-token tiles walk their row in order, the sequence's last block last, as the packed
        # split forward does: the same sums in the same order (tiles of several tokens may move
        # that block to the end of their range)
        want = _packed_decode(c, splits)
        assert torch.equal(out, want[0]) and torch.equal(lse, want[1]), f"{what}: differs from sparse_decode"
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
    for splits in (1, 3, 40):  # one range, 3 uneven ones, more ranges than blocks
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
def test_long_cache_auto_splits_and_empty_rows():
    # one token against 100K cached keys in 256-key pages, MiniCPM4's K = 96, and a second
    # sequence whose token selects nothing
    lq, lk = [1, 1], [100_000, 5000]
    c = _case(lq, lk, 16, 128, torch.bfloat16, "paged256", topk=96, local_blocks=32, seed=3)
    c["idx"][:, 1] = -1
    out, lse = infllmv2.sparse_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["idx"], c["table"],
                                              max_seqlen_q=1, return_lse=True)
    splits = infllmv2.ops._decode_splits(c["q"], 2, c["idx"], c["cu_q"], 1, 0)
    assert splits > 1
    want = _check(c, splits, "100K paged")
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isneginf(lse[:, 1]).all()


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
def test_bitwise_deterministic_and_no_host_sync():
    lq, lk = [1, 2, 1], [9000, 4000, 100]
    c = _case(lq, lk, 16, 128, torch.bfloat16, "paged64", topk=64, local_blocks=16)
    first = _poisoned(c, 7)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, _poisoned(c, 7)))
    idx = sort_topk_idx(c["idx"])
    with no_host_sync():
        infllmv2.sparse_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], idx, c["table"], max_seqlen_q=2)


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
    c = _case([1, 1], [3000, 700], 16, 128, torch.bfloat16, "paged256", topk=16)

    def f(q, kc, vc):
        return infllmv2.sparse_decode_kvcache(q, kc, vc, c["lens"], c["cu_q"], c["idx"], c["table"], max_seqlen_q=1,
                                              num_splits=4)

    assert torch.equal(torch.compile(f, fullgraph=True)(c["q"], c["kc"], c["vc"]), f(c["q"], c["kc"], c["vc"]))


def _before_append(c, lengths_k, new):
    """c's cache with each sequence's last `new` keys and values NaN again (not yet written),
    those keys and values (batch, new, Hk, D), and the extra arguments compat takes for the layout."""
    kc, vc, table = c["kc"].clone(), c["vc"].clone(), c["table"]
    page = kc.shape[1]
    for b, n in enumerate(lengths_k):
        for j in range(n - new, n):
            p = b if table is None else int(table[b, j // page] if table.shape[1] > 1 else table[b, 0])
            kc[p, j % page] = float("nan")
            vc[p, j % page] = float("nan")
    ends = c["cu_k"][1:].tolist()
    k_new = torch.stack([c["k"][e - new : e] for e in ends])
    v_new = torch.stack([c["v"][e - new : e] for e in ends])
    if table is None:
        extra = {}
    elif table.shape[1] == 1 and page > max(lengths_k):  # one page a sequence: the batch_idx layout
        extra = {"cache_batch_idx": table.view(-1)}
    else:
        extra = {"block_table": table}
    return kc, vc, k_new, v_new, extra


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("new", [1, 3])
def test_compat_with_kvcache_appends_and_attends(layout, new):
    # the original's call, MiniCPM-shaped: 4 sequences, `new` tokens each appended to the cache
    # and attending over it with a selection
    before = [700, 64, 1, 2000]
    lk = [n + new for n in before]
    batch, G, D = len(lk), 16, 128
    c = _case([new] * batch, lk, G, D, torch.bfloat16, layout, topk=20, local_blocks=3, seed=11)
    kc, vc, k_new, v_new, extra = _before_append(c, lk, new)
    q4 = c["q"].view(batch, new, 2 * G, D)
    lens = torch.tensor(before, dtype=torch.int32, device="cuda")
    out, lse = infllmv2_attn_with_kvcache(q4, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True,
                                          return_softmax_lse=True, topk_idx=c["idx"], **extra)
    assert out.shape == q4.shape and lse.shape == (batch, 2 * G, new)
    # the new keys went where the original puts them: the cache is now c's
    assert torch.equal(kc.nan_to_num(7.0), c["kc"].nan_to_num(7.0))
    assert torch.equal(vc.nan_to_num(7.0), c["vc"].nan_to_num(7.0))
    splits = infllmv2.ops._decode_splits(c["q"], 2, c["idx"], c["cu_q"], new, 0)  # what compat ran
    want_out, want_lse = _check(c, splits, f"compat {layout} new {new}")
    assert torch.equal(out.view_as(c["q"]), want_out)
    assert torch.equal(lse, want_lse.view(2 * G, batch, new).permute(1, 0, 2))


def _rope_angles(capacity, half, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(capacity, half, generator=g, dtype=torch.float64) * 2 * math.pi


def _rope_oracle(x, angle, pos, interleaved):
    """x (B, S, H, D) with each feature pair (a, b) of its first rotary_dim features taken as
    a + ib and multiplied by e^(i angle[pos]): pairs (2i, 2i + 1) interleaved, else (i, i + half)."""
    half = angle.shape[1]
    xr = x[..., :2 * half].double().cpu()
    a, b = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., :half], xr[..., half:])
    turn = angle[pos.cpu()]
    z = torch.complex(a, b) * torch.polar(torch.ones_like(turn), turn).unsqueeze(2)
    rot = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((rot.to(x.dtype).to(x.device), x[..., 2 * half:]), -1)


def _rotary_case(layout, new, G, D, dtype, device, seed):
    before = [700, 64, 1, 130] if device == "cuda" else [100, 5, 64]
    lk = [n + new for n in before]
    batch = len(lk)
    c = _case([new] * batch, lk, G, D, dtype, layout, topk=8, local_blocks=2, seed=seed, device=device)
    capacity = c["kc"].shape[1] * (1 if c["table"] is None else c["table"].shape[1])
    pos = torch.tensor(before).view(batch, 1) + torch.arange(new)
    return c, before, lk, capacity, pos


@pytest.mark.parametrize("layout", ["padded", "paged64"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("half", [4, 8])
def test_cpu_compat_with_kvcache_rotary_is_flash_attentions(layout, interleaved, half):
    # the rotation against an independent one (complex multiplication): the call with tables
    # equals the call on keys and queries rotated beforehand, and the cache holds rotated keys
    new = 2
    c, before, lk, capacity, pos = _rotary_case(layout, new, 2, 16, torch.float64, "cpu", seed=half)
    angle = _rope_angles(capacity, half, seed=1)
    batch = len(lk)
    q4 = c["q"].view(batch, new, 4, 16)
    kc, vc, k_new, v_new, extra = _before_append(c, lk, new)
    out = infllmv2_attn_with_kvcache(q4, kc, vc, k_new, v_new, rotary_cos=angle.cos(), rotary_sin=angle.sin(),
                                     cache_seqlens=torch.tensor(before), causal=True, topk_idx=c["idx"],
                                     rotary_interleaved=interleaved, **extra)
    kc2, vc2, _, _, _ = _before_append(c, lk, new)
    want = infllmv2_attn_with_kvcache(_rope_oracle(q4, angle, pos, interleaved), kc2, vc2,
                                      _rope_oracle(k_new, angle, pos, interleaved), v_new,
                                      cache_seqlens=torch.tensor(before), causal=True, topk_idx=c["idx"], **extra)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kc.nan_to_num(7.0), kc2.nan_to_num(7.0), rtol=1e-12, atol=1e-12)
    assert torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))
    # the features past rotary_dim, and keys already cached, are untouched
    assert torch.equal(kc[..., 2 * half:].nan_to_num(7.0), kc2[..., 2 * half:].nan_to_num(7.0))
    # one query a sequence without causal sits at cache_seqlens, as with causal
    q1 = c["q"].view(batch, new, 4, 16)[:, -1:]
    kc3, vc3, _, _, _ = _before_append(c, lk, new)
    plain = infllmv2_attn_with_kvcache(q1, kc3, vc3, k_new[:, :1], v_new[:, :1], rotary_cos=angle.cos(),
                                       rotary_sin=angle.sin(), cache_seqlens=torch.tensor(before), causal=False,
                                       rotary_interleaved=interleaved, topk_idx=c["idx"][:, new - 1 :: new], **extra)
    kc4, vc4, _, _, _ = _before_append(c, lk, new)
    at = pos[:, :1]
    want1 = infllmv2_attn_with_kvcache(_rope_oracle(q1, angle, at, interleaved), kc4, vc4,
                                       _rope_oracle(k_new[:, :1], angle, at, interleaved), v_new[:, :1],
                                       cache_seqlens=torch.tensor(before), causal=False,
                                       topk_idx=c["idx"][:, new - 1 :: new], **extra)
    torch.testing.assert_close(plain, want1, rtol=1e-12, atol=1e-12)


def test_cpu_compat_rotary_bad_inputs_name_the_argument():
    c, before, lk, capacity, pos = _rotary_case("paged64", 1, 2, 16, torch.float32, "cpu", seed=0)
    kc, vc, k_new, v_new, extra = _before_append(c, lk, 1)
    q4 = c["q"].view(len(lk), 1, 4, 16)
    cos = torch.ones(capacity, 8)

    def call(**kw):
        args = dict(k=k_new, v=v_new, rotary_cos=cos, rotary_sin=cos, cache_seqlens=torch.tensor(before),
                    topk_idx=c["idx"], **extra)
        args.update(kw)
        return infllmv2_attn_with_kvcache(q4, kc, vc, **args)

    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must be given together"):
        call(rotary_sin=None)
    with pytest.raises(ValueError, match=r"rotary_sin must be a floating-point tensor of shape \(seqlen_ro"):
        call(rotary_sin=torch.ones(capacity, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rotary_sin must have rotary_cos's shape \(%d, 8\)" % capacity):
        call(rotary_sin=torch.ones(capacity, 4))
    with pytest.raises(ValueError, match="2 <= rotary_dim <= head_dim=16, got 9"):
        call(rotary_cos=torch.ones(capacity, 9), rotary_sin=torch.ones(capacity, 9))
    with pytest.raises(ValueError, match=f"a row for every position of the cache, at least {capacity}, got 10"):
        call(rotary_cos=cos[:10], rotary_sin=cos[:10])
    with pytest.raises(ValueError, match="need the new tokens' k and v"):
        call(k=None, v=None)
    with pytest.raises(ValueError, match="cache_leftpad must be None"):
        call(cache_leftpad=torch.zeros(len(lk), dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["batch_idx", "paged64"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("half", [32, 64])
def test_compat_with_kvcache_rotary(layout, interleaved, half):
    # the rotation rounds once to bf16 from the exact one, and the call with tables is bitwise
    # the call on inputs rotated beforehand (the kernels are deterministic)
    new, G, D = 2, 16, 128
    c, before, lk, capacity, pos = _rotary_case(layout, new, G, D, torch.bfloat16, "cuda", seed=half)
    angle = _rope_angles(capacity, half, seed=2)
    cos, sin = angle.cos().to("cuda", torch.bfloat16), angle.sin().to("cuda", torch.bfloat16)
    batch = len(lk)
    q4 = c["q"].view(batch, new, 2 * G, D)
    kc, vc, k_new, v_new, extra = _before_append(c, lk, new)
    lens = torch.tensor(before, dtype=torch.int32, device="cuda")
    out, lse = infllmv2_attn_with_kvcache(q4, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                          cache_seqlens=lens, causal=True, topk_idx=c["idx"],
                                          rotary_interleaved=interleaved, return_softmax_lse=True, **extra)
    tables = torch.atan2(sin.double().cpu(), cos.double().cpu())  # the angles the bf16 tables hold
    for got, x in ((_rotate(q4, cos, sin, pos.cuda(), interleaved), q4),
                   (_rotate(k_new, cos, sin, pos.cuda(), interleaved), k_new)):
        exact = _rope_oracle(x.double(), tables, pos, interleaved)
        r = (cos.double() ** 2 + sin.double() ** 2).sqrt()[pos.cuda()]  # bf16 tables are not unit length
        exact[..., :2 * half] *= (r.repeat_interleave(2, -1) if interleaved else torch.cat((r, r), -1)).unsqueeze(2)
        assert ((got.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-6).all()
    kc2, vc2, _, _, _ = _before_append(c, lk, new)
    want, want_lse = infllmv2_attn_with_kvcache(_rotate(q4, cos, sin, pos.cuda(), interleaved), kc2, vc2,
                                                _rotate(k_new, cos, sin, pos.cuda(), interleaved), v_new,
                                                cache_seqlens=lens, causal=True, topk_idx=c["idx"],
                                                return_softmax_lse=True, **extra)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))


@pytest.mark.gpu
def test_compat_with_kvcache_dense_and_no_host_sync():
    # no selection: dense attention over each sequence's keys
    lk = [900, 33, 4000]
    c = _case([1, 1, 1], lk, 16, 128, torch.bfloat16, "padded", seed=2)
    q4 = c["q"].view(3, 1, 32, 128)
    with no_host_sync():
        out = infllmv2_attn_with_kvcache(q4, c["kc"], c["vc"], cache_seqlens=c["lens"])
    ref32 = reference.dense_attn_varlen(c["q"].float(), c["k"].float(), c["v"].float(), c["cu_q"], c["cu_k"])[0]
    lowp = reference.dense_attn_varlen(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"])[0]
    assert_close_to_reference(out.view_as(c["q"]), lowp, ref32, what="compat dense")


def _long_dense_case(layout, new, G, D, dtype, device):
    before = [8500, 100, 0, 3000]
    lk = [n + new for n in before]
    c = _case([new] * len(lk), lk, G, D, dtype, layout, seed=6, device=device)
    # past the 128 blocks a selection row may hold
    assert c["kc"].shape[1] * (1 if c["table"] is None else c["table"].shape[1]) > 8192
    return c, before, lk


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("new", [1, 3])
def test_cpu_compat_dense_over_a_long_cache(layout, new):
    # no selection and a capacity past 128 blocks: dense attention over each sequence's keys
    # after the append (the reference's, in fp64)
    c, before, lk = _long_dense_case(layout, new, 2, 16, torch.float64, "cpu")
    batch = len(lk)
    kc, vc, k_new, v_new, extra = _before_append(c, lk, new)
    out, lse = infllmv2_attn_with_kvcache(c["q"].view(batch, new, 4, 16), kc, vc, k_new, v_new,
                                          cache_seqlens=torch.tensor(before), causal=True, return_softmax_lse=True,
                                          **extra)
    want, want_lse = reference.dense_attn_varlen(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"])
    torch.testing.assert_close(out.view_as(want), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse.view(4, batch, new).permute(1, 0, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded", "paged256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compat_dense_over_a_long_cache(layout, dtype):
    c, before, lk = _long_dense_case(layout, 1, 16, 128, dtype, "cuda")
    batch = len(lk)
    kc, vc, k_new, v_new, extra = _before_append(c, lk, 1)
    lens = torch.tensor(before, dtype=torch.int32, device="cuda")
    with no_host_sync():
        out, lse = infllmv2_attn_with_kvcache(c["q"].view(batch, 1, 32, 128), kc, vc, k_new, v_new,
                                              cache_seqlens=lens, return_softmax_lse=True, **extra)
    ref32, lse32 = reference.dense_attn_varlen(c["q"].float(), c["k"].float(), c["v"].float(), c["cu_q"], c["cu_k"])
    lowp = reference.dense_attn_varlen(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"])[0]
    assert_close_to_reference(out.view_as(c["q"]), lowp, ref32, what=f"compat dense {layout} {dtype}")
    torch.testing.assert_close(lse, lse32.view(32, batch, 1).permute(1, 0, 2), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_cuda_bad_inputs_name_the_argument():
    c = _case([1], [640], 4, 128, torch.bfloat16, "paged64", topk=4)
    q, kc, vc, lens, cu_q, idx, table = c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["idx"], c["table"]
    call = infllmv2.sparse_decode_kvcache
    with pytest.raises(ValueError, match="forward only"):
        call(q.clone().requires_grad_(), kc, vc, lens, cu_q, idx, table)
    with pytest.raises(ValueError, match="page_size .* multiple of 64"):
        call(q, kc[:, :48].contiguous(), vc[:, :48].contiguous(), lens, cu_q, idx, table)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        call(q, kc.transpose(0, 1), vc.transpose(0, 1), lens, cu_q, idx, table)
    with pytest.raises(ValueError, match="cache_seqlens must have 1 entries"):
        call(q, kc, vc, lens.repeat(2), cu_q, idx, table)
    with pytest.raises(ValueError, match="block_table must be an int32 tensor of shape"):
        call(q, kc, vc, lens, cu_q, idx, table.view(-1))
    with pytest.raises(ValueError, match=r"topk_idx must have shape \(heads_k=2, total_q=1, K\), got \(2, 0, 4\)"):
        call(q, kc, vc, lens, cu_q, idx[:, :0], table)
    with pytest.raises(ValueError, match="alibi_slopes must be None"):
        infllmv2_attn_with_kvcache(q.view(1, 1, 8, 128), kc, vc, alibi_slopes=torch.ones(8))
    with pytest.raises(ValueError, match="causal=False needs one query"):
        infllmv2_attn_with_kvcache(q.view(1, 1, 8, 128).expand(1, 2, 8, 128), kc, vc, block_table=table)


@pytest.mark.gpu
def test_c_abi_errors():
    lib = _lib.lib()
    c = _case([1], [640], 16, 128, torch.bfloat16, "paged64", topk=4)
    q, kc, vc, table, lens, cu_q = c["q"], c["kc"], c["vc"], c["table"], c["lens"], c["cu_q"]
    idx = sort_topk_idx(c["idx"])
    size = lib.infllmv2_sparse_decode_kvcache_workspace_size(1, 32, 128, 4)
    ws = torch.empty(size // 4, device="cuda")
    out, lse = torch.empty_like(q), torch.empty(32, device="cuda")
    pages, page = kc.shape[:2]

    def call(table=table.data_ptr(), per_seq=table.shape[1], page_size=page, num_pages=pages, ws_size=size, splits=4,
             lens_ptr=lens.data_ptr()):
        st = lib.infllmv2_sparse_decode_kvcache(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), table, lens_ptr,
                                                idx.data_ptr(), cu_q.data_ptr(), out.data_ptr(), lse.data_ptr(),
                                                ws.data_ptr(), ws_size, 1, 1, 1, num_pages, page_size, per_seq, 32, 2,
                                                128, 4, splits, 0, 0.0, None)
        return st, lib.infllmv2_last_error().decode()

    assert call()[0] == _lib.OK
    st, text = call(page_size=48)
    assert st == _lib.ERR_UNSUPPORTED and "page_size must be a multiple of 64" in text and "got 48" in text
    st, text = call(table=None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "pages_per_seq must be 0 for a padded cache" in text
    st, text = call(table=None, per_seq=0, num_pages=0)
    assert st == _lib.ERR_INVALID_ARGUMENT and "num_pages must be in [1," in text
    st, text = call(per_seq=0)
    assert st == _lib.ERR_INVALID_ARGUMENT and "pages_per_seq must be >= 1 with a block_table" in text
    st, text = call(ws_size=size - 1)
    assert st == _lib.ERR_INVALID_ARGUMENT and "infllmv2_sparse_decode_kvcache_workspace_size() asks for" in text
    st, text = call(splits=0)
    assert st == _lib.ERR_INVALID_ARGUMENT and "splits must be in [1, 64]" in text
    st, text = call(num_pages=2**31 // page)
    assert st == _lib.ERR_INVALID_ARGUMENT and "num_pages must be in" in text
    st, text = call(lens_ptr=torch.empty(1, dtype=torch.int32).data_ptr())
    assert st == _lib.ERR_INVALID_ARGUMENT and "cache_seqlens must be device memory" in text
    st, text = call(table=torch.empty(11, dtype=torch.int32).data_ptr())
    assert st == _lib.ERR_INVALID_ARGUMENT and "block_table must be device memory" in text
    # a padded cache needs a page a sequence
    st, text = call(table=None, per_seq=0, num_pages=1)
    assert st == _lib.OK, text


# ---------------------------------------------------------------------------------- CPU tier


def test_cpu_path_is_the_reference_over_the_cache():
    lq, lk = [1, 2, 1], [130, 300, 64]
    for layout in LAYOUTS:
        c = _case(lq, lk, 2, 16, torch.float64, layout, topk=3, local_blocks=1, device="cpu", seed=4)
        out, lse = infllmv2.sparse_decode_kvcache(c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["idx"], c["table"],
                                                  return_lse=True)
        want, want_lse = reference.sparse_attn_varlen(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["idx"])
        assert torch.equal(out, want) and torch.equal(lse, want_lse), layout


def test_cpu_compat_with_kvcache_appends_in_place():
    before, new = [100, 5], 2
    lk = [n + new for n in before]
    c = _case([new, new], lk, 2, 16, torch.float64, "paged64", topk=3, local_blocks=1, device="cpu", seed=9)
    kc, vc, k_new, v_new, extra = _before_append(c, lk, new)
    q4 = c["q"].view(2, new, 4, 16)
    out = infllmv2_attn_with_kvcache(q4, kc, vc, k_new, v_new, cache_seqlens=torch.tensor(before), causal=True,
                                     topk_idx=c["idx"], **extra)
    assert torch.equal(kc.nan_to_num(7.0), c["kc"].nan_to_num(7.0))
    want = reference.sparse_attn_varlen(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], c["idx"])[0]
    assert torch.equal(out.view_as(want), want)


def test_cpu_bad_inputs_name_the_argument():
    c = _case([1], [130], 2, 16, torch.float32, "paged64", topk=3, local_blocks=1, device="cpu")
    q, kc, vc, lens, cu_q, idx, table = c["q"], c["kc"], c["vc"], c["lens"], c["cu_q"], c["idx"], c["table"]
    call = infllmv2.sparse_decode_kvcache
    with pytest.raises(ValueError, match="k_cache must be a tensor of shape"):
        call(q, kc[0], vc, lens, cu_q, idx, table)
    with pytest.raises(ValueError, match="v_cache must match q's dtype"):
        call(q, kc, vc.double(), lens, cu_q, idx, table)
    with pytest.raises(ValueError, match="cache_seqlens must be a 1-D int32"):
        call(q, kc, vc, lens.float(), cu_q, idx, table)
    with pytest.raises(ValueError, match=r"block_table must be an int32 tensor of shape \(batch=1"):
        call(q, kc, vc, lens, cu_q, idx, table.repeat(2, 1))
    with pytest.raises(ValueError, match="a padded cache .* needs a page a sequence"):
        call(q, kc[:0], vc[:0], lens, cu_q, idx)
    with pytest.raises(ValueError, match="num_splits must be at most 64"):
        call(q, kc, vc, lens, cu_q, idx, table, num_splits=65)
    with pytest.raises(ValueError, match=r"cache_seqlens must be in \[0, 256\]"):
        call(q, kc, vc, lens + 1000, cu_q, idx, table)
    with pytest.raises(ValueError, match="k and v must be given together"):
        infllmv2_attn_with_kvcache(q.view(1, 1, 4, 16), kc, vc, k=kc[:1, :1], block_table=table, cache_seqlens=lens)
    with pytest.raises(ValueError, match="cache_batch_idx must be None with a block_table"):
        infllmv2_attn_with_kvcache(q.view(1, 1, 4, 16), kc, vc, block_table=table, cache_batch_idx=lens)
    with pytest.raises(ValueError, match="softcap must be 0.0"):
        infllmv2_attn_with_kvcache(q.view(1, 1, 4, 16), kc, vc, block_table=table, softcap=1.0)
