"""sparse_attn (stage 2): kernels against the reference, forward and backward, every layer."""

import threading

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.ops import sort_topk_idx, sparse_attn_bwd_launch, sparse_attn_bwd_workspace_floats, sparse_attn_fwd_launch
from infllmv2.testing import GRAD_FLOOR, assert_close_to_reference, cu_seqlens, max_seqlen, random_tokens, realistic_topk

HQ_FOR_G = {1: 2, 2: 4, 4: 8, 8: 8, 16: 16, 32: 32}
LENGTH_MIXES = {
    "one": ([1], [1]),
    "63": ([63], [63]),
    "64": ([64], [64]),
    "65": ([65], [65]),
    "mix": ([1, 63, 64, 65, 200, 257, 3, 700], [1, 63, 64, 65, 200, 257, 3, 700]),
    "chunked": ([1, 17, 64, 100, 1], [300, 64, 130, 700, 1000]),  # Lq < Lk: chunked prefill and decode
}


def _case(lengths_q, lengths_k, G, D, dtype, topk=8, seed=0, heads_k=2, local_blocks=2):
    hq = G * heads_k
    q = random_tokens(lengths_q, hq, D, dtype, "cuda", seed=seed)
    k = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 1)
    v = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 2)
    idx = realistic_topk(lengths_q, lengths_k, heads_k, topk, local_blocks=local_blocks, correlated=False,
                         device="cuda", seed=seed)
    return q, k, v, cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda"), idx


def _nan_like(t, dtype=None):
    return torch.full(t.shape, float("nan"), dtype=dtype or t.dtype, device=t.device)



def _fwd_poisoned(q, k, v, cu_q, cu_k, idx, scale=0.0):
    """The kernels into NaN-poisoned outputs, so an unwritten element cannot pass."""
    out = _nan_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    sparse_attn_fwd_launch(q, k, v, sort_topk_idx(idx), cu_q, cu_k, max_seqlen(cu_q), scale, out, lse)
    return out, lse


def _bwd_poisoned(q, k, v, out, lse, dout, cu_q, cu_k, idx, scale=0.0):
    dq, dk, dv = _nan_like(q), _nan_like(k), _nan_like(v)
    ws = torch.full((sparse_attn_bwd_workspace_floats(q, k, idx, cu_k),), float("nan"), device=q.device)
    sparse_attn_bwd_launch(dout, q, k, v, out, lse, sort_topk_idx(idx), cu_q, cu_k, max_seqlen(cu_q), max_seqlen(cu_k),
                           scale, dq, dk, dv, ws)
    return dq, dk, dv


def _reference(q, k, v, cu_q, cu_k, idx, dout):
    """(out, lse, dq, dk, dv) of the reference computed in q's dtype."""
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.sparse_attn_varlen(qq, kk, vv, cu_q, cu_k, idx)
    grads = torch.autograd.grad(out, (qq, kk, vv), dout)
    return (out.detach(), lse, *grads)


def _check_against_reference(q, k, v, cu_q, cu_k, idx, what):
    dout = torch.randn_like(q)
    out, lse = _fwd_poisoned(q, k, v, cu_q, cu_k, idx)
    dq, dk, dv = _bwd_poisoned(q, k, v, out, lse, dout, cu_q, cu_k, idx)
    torch.cuda.synchronize()
    ref32 = _reference(q.float(), k.float(), v.float(), cu_q, cu_k, idx, dout.float())
    lowp = _reference(q, k, v, cu_q, cu_k, idx, dout)
    for name, got, r32, lp in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref32, lowp):
        if name == "lse":
            fin = torch.isfinite(r32)
            assert torch.equal(torch.isfinite(got), fin), f"{what}: lse -inf rows differ"
            got, r32, lp = got[fin], r32[fin], lp[fin]
        assert_close_to_reference(got, lp, r32, what=f"{what} {name}", floor=GRAD_FLOOR if name[0] == "d" else None)


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("lengths", list(LENGTH_MIXES))
def test_matches_reference(dtype, head_dim, G, lengths):
    lq, lk = LENGTH_MIXES[lengths]
    case = _case(lq, lk, G, head_dim, dtype, seed=G + head_dim)
    _check_against_reference(*case, what=f"{dtype} D{head_dim} G{G} {lengths}")


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [1, 33, 96, 128])
def test_topk_sizes_and_unsorted_rows_with_repeats(topk):
    lq = lk = [300, 2000]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 4, 128, torch.bfloat16, topk=topk, local_blocks=3)
    # scramble the order, repeat an entry: the torch layer and the reference treat rows as sets
    perm = torch.randperm(topk, device="cuda")
    idx = idx[:, :, perm].contiguous()
    if topk > 1:
        idx[:, :, -1] = idx[:, :, 0]
    _check_against_reference(q, k, v, cu_q, cu_k, idx, what=f"topk={topk}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [4, 16])
def test_future_entries_are_dropped_per_token(G):
    # Lk - Lq = 2 and 5: query tiles straddle 64-token blocks, so a token listing the block after
    # its own (its future: dropped) shares a tile with tokens for which that block is their own
    lq, lk = [128, 70], [130, 75]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, G, 128, torch.bfloat16, topk=4)
    pos = torch.cat([torch.arange(b - a, b, device="cuda") for a, b in zip(lq, lk)])
    idx[:, :, -1] = (pos // 64 + 1).to(idx.dtype)
    _check_against_reference(q, k, v, cu_q, cu_k, idx, what=f"future entries G{G}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 3, 16, 64])
def test_long_sequences_and_odd_groups(G):
    # bwd_members counts a sequence's queries in 64 slices (of 266 rows here, not a multiple of
    # its 16-row loads); bwd_dkdv takes a key block's member list 2048 at a time, in two
    # segments split at a 2048-row boundary, and the members 64 // G at a time: 17000 tokens
    # need several of each, whose last groups are partial; G = 3 leaves rows of every group
    # unused. (At G = 64 the reference's scores of 17000 tokens would not fit an 80 GB GPU.)
    n = 17000 if G <= 16 else 5000
    lq, lk = [n, 70, 2100], [n, 70, 4500]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, G, 128, torch.bfloat16, topk=12, local_blocks=3, heads_k=1, seed=G)
    _check_against_reference(q, k, v, cu_q, cu_k, idx, what=f"long G{G}")


@pytest.mark.gpu
def test_empty_selection_rows_and_unselected_blocks():
    lq = lk = [400]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 16, 128, torch.bfloat16, topk=4, local_blocks=0)
    idx[:, 100:150] = -1  # these tokens select nothing
    idx[:, :, :] = torch.where(idx == 2, -1, idx)  # nobody selects block 2
    dout = torch.randn_like(q)
    out, lse = _fwd_poisoned(q, k, v, cu_q, cu_k, idx)
    dq, dk, dv = _bwd_poisoned(q, k, v, out, lse, dout, cu_q, cu_k, idx)
    torch.cuda.synchronize()
    assert not any(torch.isnan(t).any() for t in (out, dq, dk, dv))
    assert torch.equal(out[100:150], torch.zeros_like(out[100:150]))
    assert torch.isneginf(lse[:, 100:150]).all()
    assert torch.equal(dq[100:150], torch.zeros_like(dq[100:150]))
    assert torch.equal(dk[128:192], torch.zeros_like(dk[128:192]))
    assert torch.equal(dv[128:192], torch.zeros_like(dv[128:192]))
    _check_against_reference(q, k, v, cu_q, cu_k, idx, what="empty rows")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [16, 32, 64])
def test_cluster_pairs_with_empty_halves(G):
    # On sm_90a, G >= 16 runs the forward as clusters of two tiles of 64 // G tokens that walk the
    # union of both tiles' selections, the lower rank multicasting each K/V block into both: a
    # pair whose first or second tile selects nothing, a pair that selects nothing at all, and a
    # second tile past the end of its sequence (301 and 77 tokens: odd tile counts at G = 16 and
    # 64).
    lq = lk = [301, 77]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, G, 128, torch.bfloat16, topk=6, local_blocks=1, seed=G)
    t = 64 // G
    idx[:, 6 * t : 7 * t] = -1  # the first tile of pair 3
    idx[:, 11 * t : 12 * t] = -1  # the second tile of pair 5
    idx[:, 14 * t : 16 * t] = -1  # all of pair 7
    _check_against_reference(q, k, v, cu_q, cu_k, idx, what=f"pairs G{G}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [4, 16])
def test_first_key_blocks_of_long_sequences_in_pieces(G):
    # dK/dV of the first 4 key blocks of a sequence of more than 8192 queries come from one thread
    # block per 8192-row piece of the packed queries that the sequence overlaps, summed by a
    # second kernel: two long sequences meeting inside a piece (one of them chunked, Lq < Lk), a
    # short one, and a long one starting mid-piece; block 0 is every query's init block.
    lq, lk = [9000, 9000, 100, 8300], [9000, 9100, 100, 8300]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, G, 128, torch.bfloat16, topk=6, local_blocks=1, heads_k=1, seed=G)
    _check_against_reference(q, k, v, cu_q, cu_k, idx, what=f"pieces G{G}")
    dout = torch.randn_like(q)
    out, lse = _fwd_poisoned(q, k, v, cu_q, cu_k, idx)
    first = _bwd_poisoned(q, k, v, out, lse, dout, cu_q, cu_k, idx)
    again = _bwd_poisoned(q, k, v, out, lse, dout, cu_q, cu_k, idx)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_backward_is_bitwise_deterministic():
    lq = lk = [3000, 1000]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 16, 128, torch.bfloat16, topk=16, local_blocks=4)
    dout = torch.randn_like(q)
    out, lse = _fwd_poisoned(q, k, v, cu_q, cu_k, idx)
    first = _bwd_poisoned(q, k, v, out, lse, dout, cu_q, cu_k, idx)
    for _ in range(3):
        again = _bwd_poisoned(q, k, v, out, lse, dout, cu_q, cu_k, idx)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[300, 1000], [9000, 300]])
def test_backward_with_cu_seqlens_past_total_q_stays_in_its_workspace(lengths):
    # cu_seqlens_q ending past total_q (a C caller's bug) gives wrong gradients but writes
    # nothing past the workspace. bwd_dkdv had taken the last sequence for one of more than
    # 8192 queries and written partial dK/dV where the host, having split no sequence, had
    # allotted no slots: the first case wrote past the workspace. The second has slots; its
    # pieces past the packed rows' last must stay out of them too.
    q, k, v, cu_q, cu_k, idx = _case(lengths, lengths, 8, 128, torch.bfloat16)
    out, lse = _fwd_poisoned(q, k, v, cu_q, cu_k, idx)
    bad_q = cu_q.clone()
    bad_q[-1] = 1_000_000
    mq = mk = max(lengths)
    n = sparse_attn_bwd_workspace_floats(q, k, idx, cu_k)
    ws = torch.full((n + (1 << 20),), 7.0, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    sparse_attn_bwd_launch(torch.randn_like(q), q, k, v, out, lse, sort_topk_idx(idx), bad_q, cu_k, mq, mk, 0.0, dq,
                           dk, dv, ws[:n])
    torch.cuda.synchronize()
    assert bool((ws[n:] == 7.0).all()), "the backward wrote past its workspace"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_portable_arch_variants_through_ptx(arch, G, arch_override):
    if arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} not compiled into this build")
    arch_override(arch)
    for dtype, D in ((torch.bfloat16, 128), (torch.float16, 64)):
        lq, lk = LENGTH_MIXES["mix"]
        _check_against_reference(*_case(lq, lk, G, D, dtype, seed=G), what=f"{arch} G{G} {dtype} D{D}")
        lq, lk = LENGTH_MIXES["chunked"]
        _check_against_reference(*_case(lq, lk, G, D, dtype, seed=G), what=f"{arch} G{G} chunked")


@pytest.mark.gpu
def test_autograd_function_matches_reference():
    lq = lk = [129, 500]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 8, 64, torch.float16, topk=6)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = infllmv2.sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref32 = _reference(q.float(), k.float(), v.float(), cu_q, cu_k, idx, dout.float())
    lowp = _reference(q, k, v, cu_q, cu_k, idx, dout)
    for name, got, r32, lp in zip(("out", "dq", "dk", "dv"), (out, *grads), ref32[:1] + ref32[2:], lowp[:1] + lowp[2:]):
        assert_close_to_reference(got.detach(), lp, r32, what=name, floor=GRAD_FLOOR if name[0] == "d" else None)


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    lq = lk = [256, 64]
    q, k, v, cu_q, cu_k, idx = _case(lq, lk, 16, 128, torch.bfloat16, topk=4)

    def f(q, k, v):
        return infllmv2.sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, max_seqlen_q=256, max_seqlen_k=256)

    compiled = torch.compile(f, fullgraph=True)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    out_c = compiled(q1, k1, v1)
    out_e = f(q2, k2, v2)
    assert torch.equal(out_c, out_e)
    out_c.sum().backward()
    out_e.sum().backward()
    assert torch.equal(q1.grad, q2.grad) and torch.equal(k1.grad, k2.grad) and torch.equal(v1.grad, v2.grad)


@pytest.mark.gpu
def test_cuda_bad_inputs():
    q, k, v, cu_q, cu_k, idx = _case([128], [128], 4, 128, torch.bfloat16, topk=4)
    call = infllmv2.sparse_attn_varlen
    with pytest.raises(ValueError, match="q must be bfloat16 or float16 on CUDA"):
        call(q.float(), k.float(), v.float(), cu_q, cu_k, idx)
    with pytest.raises(ValueError, match="q must be contiguous"):
        call(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, cu_q, cu_k, idx)
    with pytest.raises(ValueError, match="topk_idx must have shape"):
        call(q, k, v, cu_q, cu_k, idx[:, :10])
    with pytest.raises(ValueError, match="CUDA supports 1..128"):
        call(q, k, v, cu_q, cu_k, torch.zeros((2, 128, 129), dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="block_size must be 64 on CUDA"):
        call(q, k, v, cu_q, cu_k, idx, block_size=32)
    with pytest.raises(ValueError, match="cu_seqlens_k is on cpu"):
        call(q, k, v, cu_q, cu_k.cpu(), idx)
    with pytest.raises(ValueError, match="multiple of k heads"):
        call(q[:, :7], k, v, cu_q, cu_k, idx)


@pytest.mark.gpu
def test_c_abi_errors():
    lib = _lib.lib()
    q, k, v, cu_q, cu_k, idx = _case([128], [128], 4, 128, torch.bfloat16, topk=4)
    p = [t.data_ptr() for t in (q, k, v, idx, cu_q, cu_k, q, q)]
    st = lib.infllmv2_sparse_attn_fwd(*p, 1, 128, 128, 128, 8, 2, 128, 200, 0, 0.0, None)
    assert st == _lib.ERR_UNSUPPORTED and "topk must be in [1, 128], got 200" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_sparse_attn_fwd(*p, 1, 128, 128, 128, 130, 2, 128, 4, 0, 0.0, None)
    assert st == _lib.ERR_UNSUPPORTED and "exceeds 64" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_sparse_attn_fwd(*p, 1, 128, 128, 128, 7, 2, 128, 4, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "heads (7) must be a multiple of heads_k (2)" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_sparse_attn_fwd(*p, 1, 128, 128, 128, 8, 2, 128, 4, 0, float("nan"), None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "softmax_scale" in lib.infllmv2_last_error().decode()
    # rows move by 16-byte vector loads (and K/V blocks by TMA on sm_90a): a 2-byte offset is
    # refused, not a misaligned-address fault
    for i, name in ((0, "q"), (1, "k"), (2, "v"), (6, "out")):
        st = lib.infllmv2_sparse_attn_fwd(*p[:i], p[i] + 2, *p[i + 1 :], 1, 128, 128, 128, 8, 2, 128, 4, 0, 0.0, None)
        assert st == _lib.ERR_INVALID_ARGUMENT and f"{name} must be 16-byte aligned" in lib.infllmv2_last_error().decode()
    host = torch.zeros(10)
    p_host = [host.data_ptr()] + p[1:]
    st = lib.infllmv2_sparse_attn_fwd(*p_host, 1, 128, 128, 128, 8, 2, 128, 4, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "q must be device memory" in lib.infllmv2_last_error().decode()
    pb = [t.data_ptr() for t in (q, k, v, q, q, cu_q, idx, cu_q, cu_k, q, k, v, q)]
    st = lib.infllmv2_sparse_attn_bwd(*pb, 16, 1, 128, 128, 128, 128, 8, 2, 128, 4, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "workspace_size is 16 bytes" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_sparse_attn_bwd(*pb, 4096, 1, 128, 128, 128, 128, 8, 2, 128, 4, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "asks for 18176" in lib.infllmv2_last_error().decode()
    ws = torch.empty(18176 // 4, device="cuda")
    pw = pb[:12] + [ws.data_ptr()]
    for i, name in ((4, "dout"), (10, "dk")):
        st = lib.infllmv2_sparse_attn_bwd(*pw[:i], pw[i] + 2, *pw[i + 1 :], 18176, 1, 128, 128, 128, 128, 8, 2, 128, 4,
                                          0, 0.0, None)
        assert st == _lib.ERR_INVALID_ARGUMENT and f"{name} must be 16-byte aligned" in lib.infllmv2_last_error().decode()


# ---------------------------------------------------------------------------------- CPU tier


def test_cpu_path_is_the_reference():
    lq = lk = [70, 130]
    q = random_tokens(lq, 4, 16, torch.float64, seed=1).requires_grad_()
    k = random_tokens(lk, 2, 16, torch.float64, seed=2).requires_grad_()
    v = random_tokens(lk, 2, 16, torch.float64, seed=3).requires_grad_()
    cu = cu_seqlens(lq)
    idx = realistic_topk(lq, lk, 2, 3, local_blocks=1)
    out = infllmv2.sparse_attn_varlen(q, k, v, cu, cu, idx)
    ref, _ = reference.sparse_attn_varlen(q, k, v, cu, cu, idx)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("correlated", [True, False])
def test_realistic_topk_keeps_each_window_when_scores_tie(monkeypatch, correlated):
    # scores drawn from eight values tie at nearly every row's cut; a full row must still hold
    # exactly its init block, its whole window and `topk` picks, none of them cut off its end
    uniform = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **kw: torch.floor(uniform(*a, **kw) * 8) / 8)
    lengths, local, topk = [3000, 65, 1, 700], 8, 16
    idx = realistic_topk(lengths, lengths, 2, topk, local_blocks=local, correlated=correlated)
    off = 0
    for length in lengths:
        blk = torch.arange(length)[None, :] // 64
        rows = idx[:, off:off + length]
        window = ((rows >= torch.clamp(blk - local, min=0)[..., None]) & (rows <= blk[..., None])).sum(-1)
        assert torch.equal(window, torch.clamp(blk, max=local).expand_as(window) + 1)
        assert bool(((rows == 0).sum(-1) == 1).all())
        assert torch.equal((rows >= 0).sum(-1), torch.clamp(blk + 1, max=topk).expand_as(window))
        off += length


def test_cpu_custom_ops_forward_and_backward():
    lq = lk = [70, 130]
    q = random_tokens(lq, 4, 16, torch.float64, seed=1).requires_grad_()
    k = random_tokens(lk, 2, 16, torch.float64, seed=2).requires_grad_()
    v = random_tokens(lk, 2, 16, torch.float64, seed=3).requires_grad_()
    cu = cu_seqlens(lq)
    idx = sort_topk_idx(realistic_topk(lq, lk, 2, 3, local_blocks=1))
    out, lse = torch.ops.infllmv2.sparse_attn_fwd(q, k, v, idx, cu, cu, 130, 130, 0.0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref, ref_lse = reference.sparse_attn_varlen(q, k, v, cu, cu, idx)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert torch.allclose(out, ref) and torch.equal(lse, ref_lse)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b)


def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(10, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(12, 2, 64, dtype=torch.bfloat16)
        idx = torch.empty(2, 10, 5, dtype=torch.int32)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.infllmv2.sparse_attn_fwd(q, k, k, idx, cu, cu, 5, 6, 0.0)
        dq, dk, dv = torch.ops.infllmv2.sparse_attn_bwd(q, q, k, k, q, lse, idx, cu, cu, 5, 6, 0.0)
    assert out.shape == q.shape and lse.shape == (8, 10) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(q=a["q"][:, :3]), "q heads \\(3\\) must be a multiple of k heads \\(2\\)"),
        (lambda a: a.update(v=a["v"][:-1]), "must share"),
        (lambda a: a.update(topk_idx=a["topk_idx"].float()), "topk_idx must be an int32"),
        (lambda a: a.update(topk_idx=a["topk_idx"][:1]), "topk_idx must have shape"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be a 1-D int32"),
        (lambda a: a.update(cu_seqlens_k=cu_seqlens([10, 10, 5])), "describes 2 sequences but cu_seqlens_k 3"),
        (lambda a: a.update(k=a["k"].double()), "k dtype torch.float64 differs from q dtype"),
    ],
)
def test_bad_arguments_name_the_argument(mutate, message):
    args = dict(q=random_tokens([10, 15], 4, 16, torch.float32), k=random_tokens([10, 15], 2, 16, torch.float32),
                v=random_tokens([10, 15], 2, 16, torch.float32), cu_seqlens_q=cu_seqlens([10, 15]),
                cu_seqlens_k=cu_seqlens([10, 15]), topk_idx=torch.zeros((2, 25, 2), dtype=torch.int32))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        infllmv2.sparse_attn_varlen(**args)


@pytest.mark.parametrize("tile_tokens", [1, 4, 16])
def test_tile_union_blocks_counts_distinct_visible_blocks(tile_tokens):
    # the benchmarks' measure of how many blocks the tiled kernels walk, against a set count
    from infllmv2.testing import tile_union_blocks

    lengths_q, lengths_k = [1, 63, 65, 200], [1, 63, 130, 700]
    idx = realistic_topk(lengths_q, lengths_k, 2, 6, local_blocks=1, correlated=False, seed=3)
    idx[0, 5, 2] = -1  # a padding entry
    idx[1, 70, 0] = 500  # a block past the token's own: not walked
    want, off = 0, 0
    for lq, lk in zip(lengths_q, lengths_k):
        for g in range(idx.shape[0]):
            for t0 in range(0, lq, tile_tokens):
                blocks = set()
                for t in range(t0, min(t0 + tile_tokens, lq)):
                    own = (lk - lq + t) // 64
                    blocks |= {b for b in idx[g, off + t].tolist() if 0 <= b <= own}
                want += len(blocks)
        off += lq
    assert tile_union_blocks(idx, lengths_q, lengths_k, tile_tokens) == want


def _graph_case():
    """A backward call with every input and output allocated up front (nothing allocates while a
    graph is captured): the call, its (dq, dk, dv), and the eager gradients of a first call."""
    lengths = [700, 65, 1, 2000]
    q, k, v, cu_q, cu_k, idx = _case(lengths, lengths, 16, 128, torch.bfloat16, seed=31)
    idx = sort_topk_idx(idx)
    out, lse = _fwd_poisoned(q, k, v, cu_q, cu_k, idx)
    dout = random_tokens(lengths, q.shape[1], 128, torch.bfloat16, "cuda", seed=32)
    ws = torch.empty(sparse_attn_bwd_workspace_floats(q, k, idx, cu_k), device="cuda")
    grads = [torch.empty_like(t) for t in (q, k, v)]
    mq = max(lengths)

    def run():
        sparse_attn_bwd_launch(dout, q, k, v, out, lse, idx, cu_q, cu_k, mq, mq, 0.0, *grads, ws)

    run()
    torch.cuda.synchronize()
    want = [g.clone() for g in grads]
    for g in grads:
        g.fill_(float("nan"))
    torch.cuda.synchronize()  # a call on another stream must not overtake the fill
    return run, grads, want


def _in_new_thread(fn):
    """fn() in a thread of its own (one without the library's member-list stream), its
    exception re-raised here."""
    errors = []

    def body():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(e)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if errors:
        raise errors[0]


@pytest.mark.gpu
@pytest.mark.parametrize("thread", ["with_side_stream", "new"])
def test_backward_in_cuda_graph(thread):
    """Captured into a CUDA graph, the backward replays to the eager gradients bit for bit: in a
    thread whose member-list stream exists (the capture forks into it and joins it back) and in a
    new one (no stream is created while capturing; the lists stay on the captured stream)."""
    run, grads, want = _graph_case()

    def capture_and_replay():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()

    if thread == "new":
        _in_new_thread(capture_and_replay)
    else:
        capture_and_replay()  # _graph_case's eager call made this thread's member-list stream
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert torch.equal(g, w), f"{name} replayed from the graph differs from the eager call"


@pytest.mark.gpu
def test_backward_beside_another_threads_capture():
    """A thread's first backward creates its member-list stream, and the thread's exit destroys
    it. Another thread's capture in global mode (torch.cuda.graph's default) must survive both."""
    run, grads, want = _graph_case()
    side = torch.cuda.Stream()
    x = torch.zeros(8, device="cuda")

    def first_backward():
        with torch.cuda.stream(side):
            run()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="global"):
        y = x + 1
        _in_new_thread(first_backward)  # the thread starts and exits while this capture is open
        y = y * 2
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 2.0))
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert torch.equal(g, w), f"{name} of the backward beside the capture differs from the eager call"
