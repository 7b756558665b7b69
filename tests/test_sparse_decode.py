"""sparse_decode (stage 2's forward split over the selected blocks): kernels against the reference."""

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.ops import (sort_topk_idx, sparse_attn_fwd_launch, sparse_decode_launch, sparse_decode_splits,
                          sparse_decode_workspace_floats)
from infllmv2.testing import (assert_close_to_reference, assert_sparse_forward_close, cu_seqlens, max_seqlen,
                              no_host_sync, random_tokens, realistic_topk)

# (query lengths, key lengths): one decoding token a sequence against caches of 1, 63, 64, 65
# and mixed keys; a few tokens a sequence (speculative decoding, tiles of several tokens); and
# a prefill-sized mix, whose many tiles split too when forced
LENGTH_MIXES = {
    "decode1": ([1], [1]),
    "decode63": ([1], [63]),
    "decode64": ([1], [64]),
    "decode65": ([1], [65]),
    "decode_mix": ([1, 1, 1, 1, 1], [3000, 63, 64, 65, 777]),
    "spec": ([3, 5, 1, 2], [2000, 65, 130, 4001]),
    "prefill": ([1, 63, 64, 65, 200, 3], [1, 63, 64, 65, 200, 700]),
}


def _case(lengths_q, lengths_k, G, D, dtype, topk=12, seed=0, heads_k=2, local_blocks=2):
    q = random_tokens(lengths_q, G * heads_k, D, dtype, "cuda", seed=seed)
    k = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 1)
    v = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 2)
    idx = realistic_topk(lengths_q, lengths_k, heads_k, topk, local_blocks=local_blocks, correlated=False,
                         device="cuda", seed=seed)
    return q, k, v, cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda"), idx


def _decode_poisoned(q, k, v, cu_q, cu_k, idx, splits):
    """The kernels into NaN-poisoned outputs and workspace, so an unwritten element cannot pass."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    n = sparse_decode_workspace_floats(q, splits)
    ws = torch.full((n,), float("nan"), device=q.device) if n else None
    sparse_decode_launch(q, k, v, sort_topk_idx(idx), cu_q, cu_k, max_seqlen(cu_q), 0.0, splits, out, lse, ws)
    return out, lse


def _check_against_reference(q, k, v, cu_q, cu_k, idx, splits, what):
    out, lse = _decode_poisoned(q, k, v, cu_q, cu_k, idx, splits)
    assert_sparse_forward_close(out, lse, q, k, v, cu_q, cu_k, idx, what)
    return out, lse


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("lengths", list(LENGTH_MIXES))
def test_matches_reference(dtype, head_dim, G, lengths):
    lq, lk = LENGTH_MIXES[lengths]
    case = _case(lq, lk, G, head_dim, dtype, seed=G + head_dim)
    # 3 ranges a tile (uneven: 12+ blocks), and more ranges than blocks (empty ones)
    for splits in (3, 40):
        _check_against_reference(*case, splits=splits, what=f"{dtype} D{head_dim} G{G} {lengths} splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [3, 64])
def test_odd_and_largest_groups(G):
    # G = 3 leaves rows of every tile idle (4 tokens x 3 heads); G = 64 is one token a tile
    for lengths in ("decode_mix", "spec"):
        lq, lk = LENGTH_MIXES[lengths]
        case = _case(lq, lk, G, 128, torch.bfloat16, seed=G, heads_k=1)
        _check_against_reference(*case, splits=6, what=f"G{G} {lengths}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [4, 16])
def test_auto_splits_one_long_sequence(G):
    # one token against 100K keys with MiniCPM4's K = 96: the tiles alone are Hk = 2 thread
    # blocks, so the library splits
    lq, lk = [1], [100_000]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, G, 128, torch.bfloat16, topk=96, local_blocks=32, seed=G)
    splits = sparse_decode_splits(q, k, idx, cu_q, 1)
    assert 1 < splits <= 24, splits  # at most ceil(96 / 4): 4 blocks a split
    _check_against_reference(q, k, v, cu_q, cu_k, idx, splits, what=f"auto G{G}")
    got = infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx, max_seqlen_q=1)
    want, _ = _decode_poisoned(q, k, v, cu_q, cu_k, idx, splits)
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_auto_splits_nothing_where_the_tiles_fill_the_gpu():
    # 8 x 1000 queries at G = 16: hundreds of tiles. The library runs the plain forward, bitwise.
    lq = lk = [1000] * 8
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 16, 128, torch.bfloat16, topk=8)
    assert sparse_decode_splits(q, k, idx, cu_q, 1000) == 1
    got, got_lse = infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx, return_lse=True)
    want, want_lse = torch.empty_like(q), torch.empty((q.shape[1], q.shape[0]), device="cuda")
    sparse_attn_fwd_launch(q, k, v, sort_topk_idx(idx), cu_q, cu_k, 1000, 0.0, want, want_lse)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)


@pytest.mark.gpu
def test_empty_selection_rows_and_empty_ranges():
    lq, lk = [1, 1, 1, 4], [500, 64, 2000, 300]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 16, 128, torch.bfloat16, topk=6, local_blocks=1)
    idx[:, 1] = -1  # the second sequence's token selects nothing
    idx[:, 3:5] = -1  # nor do two tokens of a 4-token tile
    idx[:, 2, 1:] = -1  # one block for 9 ranges
    out, lse = _check_against_reference(q, k, v, cu_q, cu_k, idx, splits=9, what="empty")
    for r in (1, 3, 4):
        assert torch.equal(out[r], torch.zeros_like(out[r]))
        assert torch.isneginf(lse[:, r]).all()


@pytest.mark.gpu
def test_bitwise_deterministic():
    lq, lk = [1, 2, 1], [9000, 4000, 100]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 16, 128, torch.bfloat16, topk=64, local_blocks=16)
    first = _decode_poisoned(q, k, v, cu_q, cu_k, idx, 7)
    for _ in range(3):
        again = _decode_poisoned(q, k, v, cu_q, cu_k, idx, 7)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_portable_arch_variants_through_ptx(arch, G, arch_override):
    if arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} not compiled into this build")
    arch_override(arch)
    for dtype, D in ((torch.bfloat16, 128), (torch.float16, 64)):
        for lengths in ("decode_mix", "spec"):
            lq, lk = LENGTH_MIXES[lengths]
            _check_against_reference(*_case(lq, lk, G, D, dtype, seed=G), splits=5, what=f"{arch} G{G} {lengths}")


@pytest.mark.gpu
def test_attention_decodes_through_the_split_forward():
    # inference through infllmv2.attention (one token a sequence against 20K keys, sparse path)
    # takes the split forward: the same result as the reference's attention, and as sparse_decode
    # on the selection attention makes
    cfg = infllmv2.SparseConfig()
    lq, lk = [1, 1], [20000, 9000]
    q = random_tokens(lq, 32, 128, torch.bfloat16, "cuda", seed=1)
    k = random_tokens(lk, 2, 128, torch.bfloat16, "cuda", seed=2)
    v = random_tokens(lk, 2, 128, torch.bfloat16, "cuda", seed=3)
    cu_q, cu_k = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    with torch.no_grad():
        # with the lengths given, no host synchronisation (a decoding step can be captured)
        with no_host_sync():
            out = infllmv2.attention(q, k, v, cu_q, cu_k, 1, 20000, config=cfg)
        # the selection attention makes (split too: see test_select_decode)
        idx = infllmv2.select_decode(q, k, cu_q, cu_k, topk=cfg.num_selected, local_blocks=cfg.local_blocks)
        assert torch.equal(out, infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx))
    ref32 = reference.sparse_attn_varlen(q.float(), k.float(), v.float(), cu_q, cu_k, idx)[0]
    lowp = reference.sparse_attn_varlen(q, k, v, cu_q, cu_k, idx)[0]
    assert_close_to_reference(out, lowp, ref32, what="attention decode")


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    lq, lk = [1, 1], [3000, 700]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 16, 128, torch.bfloat16, topk=16)

    def f(q, k, v):
        return infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx, max_seqlen_q=1, num_splits=4)

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k, v), f(q, k, v))


@pytest.mark.gpu
def test_cuda_bad_inputs():
    q, k, v, cu_q, cu_k, idx = _case([1], [640], 4, 128, torch.bfloat16, topk=4)
    call = infllmv2.sparse_decode
    with pytest.raises(ValueError, match="forward only"):
        call(q.requires_grad_(), k, v, cu_q, cu_k, idx)
    q = q.detach()
    with pytest.raises(ValueError, match="num_splits must be at most 64"):
        call(q, k, v, cu_q, cu_k, idx, num_splits=65)
    with pytest.raises(ValueError, match="topk_idx must have shape"):
        call(q, k, v, cu_q, cu_k, idx[:, :0])
    with pytest.raises(ValueError, match="q must be contiguous"):
        call(torch.cat([q, q], dim=2)[:, :, :128], k, v, cu_q, cu_k, idx)


@pytest.mark.gpu
def test_c_abi_errors():
    lib = _lib.lib()
    q, k, v, cu_q, cu_k, idx = _case([1], [640], 16, 128, torch.bfloat16, topk=4)
    size = lib.infllmv2_sparse_decode_workspace_size(1, 32, 128, 4)
    ws = torch.empty(size // 4, device="cuda")
    lse = torch.empty(32, device="cuda")  # held: a pointer into a freed tensor may be handed out again
    p = [t.data_ptr() for t in (q, k, v, idx, cu_q, cu_k, q, lse)]

    def call(ws_ptr=ws.data_ptr(), ws_size=size, splits=4, heads=32, topk=4, ptrs=p):
        st = lib.infllmv2_sparse_decode(*ptrs, ws_ptr, ws_size, 1, 1, 640, 1, heads, 2, 128, topk, splits, 0, 0.0, None)
        return st, lib.infllmv2_last_error().decode()

    assert call()[0] == _lib.OK
    st, text = call(splits=0)
    assert st == _lib.ERR_INVALID_ARGUMENT and "splits must be in [1, 64]" in text and "got 0" in text
    st, text = call(splits=65)
    assert st == _lib.ERR_INVALID_ARGUMENT and "got 65" in text
    st, text = call(ws_size=size - 1)
    assert st == _lib.ERR_INVALID_ARGUMENT and f"workspace_size is {size - 1} bytes" in text and f"asks for {size}" in text
    st, text = call(ws_ptr=ws.data_ptr() + 4)
    assert st == _lib.ERR_INVALID_ARGUMENT and "workspace must be 16-byte aligned" in text
    st, text = call(ws_ptr=torch.empty(size // 4).data_ptr())
    assert st == _lib.ERR_INVALID_ARGUMENT and "workspace must be device memory" in text
    st, text = call(topk=200)
    assert st == _lib.ERR_UNSUPPORTED and "topk must be in [1, 128], got 200" in text
    st, text = call(heads=7)
    assert st == _lib.ERR_INVALID_ARGUMENT and "heads (7) must be a multiple of heads_k (2)" in text
    st, text = call(ptrs=p[:6] + [p[6] + 2] + p[7:])
    assert st == _lib.ERR_INVALID_ARGUMENT and "out must be 16-byte aligned" in text
    # one range: the plain forward, which needs no workspace
    assert call(ws_ptr=None, ws_size=0, splits=1)[0] == _lib.OK


# ---------------------------------------------------------------------------------- CPU tier


def test_cpu_path_is_the_reference():
    lq, lk = [1, 2], [130, 300]
    q = random_tokens(lq, 4, 16, torch.float64, seed=1)
    k = random_tokens(lk, 2, 16, torch.float64, seed=2)
    v = random_tokens(lk, 2, 16, torch.float64, seed=3)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    idx = realistic_topk(lq, lk, 2, 3, local_blocks=1)
    out, lse = infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx, return_lse=True)
    want, want_lse = reference.sparse_attn_varlen(q, k, v, cu_q, cu_k, idx)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_cpu_bad_inputs_name_the_argument():
    lq, lk = [1], [130]
    q = random_tokens(lq, 4, 16, torch.float32, seed=1).requires_grad_()
    k = random_tokens(lk, 2, 16, torch.float32, seed=2)
    v = random_tokens(lk, 2, 16, torch.float32, seed=3)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    idx = realistic_topk(lq, lk, 2, 3, local_blocks=1)
    with pytest.raises(ValueError, match="forward only"):
        infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx)
    with torch.no_grad():
        with pytest.raises(ValueError, match="num_splits must be >= 0, got -1"):
            infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx, num_splits=-1)
        with pytest.raises(ValueError, match="topk_idx must have shape"):
            infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx[:1])


def test_c_workspace_size_and_explicit_splits():
    if not infllmv2.library_available():
        pytest.skip("no kernel library")
    lib = _lib.lib()
    size = lib.infllmv2_sparse_decode_workspace_size
    # (total_q, heads, head_dim, splits): fp32 partial outputs (splits x total_q, heads, D), then
    # from the next 256-byte boundary fp32 partial LSEs (heads, splits x total_q); nothing for one
    assert size(3, 32, 128, 1) == 0
    assert size(3, 32, 128, 5) == 5 * 3 * 32 * 128 * 4 + 5 * 3 * 32 * 4
    assert size(3, 2, 64, 3) == 4608 + 3 * 3 * 2 * 4  # 3 x 3 x 2 x 64 x 4 = 4608, already aligned
    # head_dim 64 and 128 keep the first part a multiple of 256 bytes; the query rounds any other
    assert size(1, 1, 3, 5) == 256 + 20
    assert size(0, 32, 128, 5) == 0
    splits = lib.infllmv2_sparse_decode_splits
    # an explicit count needs no device: itself, at most 64; bad arguments give 0
    assert splits(1, 1, 32, 2, 96, 7) == 7
    assert splits(1, 1, 32, 2, 96, 100) == 64
    assert splits(1, 1, 32, 2, 96, -1) == 0
    assert splits(1, 1, 32, 2, 0, 4) == 0
