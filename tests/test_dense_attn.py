"""dense_attn: the dense kernels against the reference, forward and backward, every layer."""

import re

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.ops import dense_attn_bwd_launch, dense_attn_bwd_workspace_floats, dense_attn_fwd_launch
from infllmv2.testing import GRAD_FLOOR, assert_close_to_reference, cu_seqlens, max_seqlen, random_tokens

LENGTH_MIXES = {
    "one": ([1], [1]),
    "63": ([63], [63]),
    "64": ([64], [64]),
    "65": ([65], [65]),
    "mix": ([1, 63, 64, 65, 200, 257, 3, 700], [1, 63, 64, 65, 200, 257, 3, 700]),
    "chunked": ([1, 17, 64, 100, 1], [300, 64, 130, 700, 1000]),  # Lq < Lk: chunked prefill and decode
}


def _case(lengths_q, lengths_k, G, D, dtype, seed=0, heads_k=2):
    q = random_tokens(lengths_q, G * heads_k, D, dtype, "cuda", seed=seed)
    k = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 1)
    v = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 2)
    return q, k, v, cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda")


def _nan_like(t):
    return torch.full(t.shape, float("nan"), dtype=t.dtype, device=t.device)


def _kernels_poisoned(q, k, v, cu_q, cu_k, dout, causal, scale=0.0):
    """Forward and backward kernels into NaN-poisoned outputs, so an unwritten element cannot pass."""
    out, lse = _nan_like(q), torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device)
    msq, msk = max_seqlen(cu_q), max_seqlen(cu_k)
    dense_attn_fwd_launch(q, k, v, cu_q, cu_k, msq, msk, causal, scale, out, lse)
    dq, dk, dv = _nan_like(q), _nan_like(k), _nan_like(v)
    ws = torch.full((dense_attn_bwd_workspace_floats(q),), float("nan"), device=q.device)
    dense_attn_bwd_launch(dout, q, k, v, out, lse, cu_q, cu_k, msq, msk, causal, scale, dq, dk, dv, ws)
    torch.cuda.synchronize()
    return out, lse, dq, dk, dv


def _reference(q, k, v, cu_q, cu_k, dout, causal, scale=None):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = reference.dense_attn_varlen(qq, kk, vv, cu_q, cu_k, scale, causal)
    return (out.detach(), lse, *torch.autograd.grad(out, (qq, kk, vv), dout))


def _check_against_reference(q, k, v, cu_q, cu_k, causal=True, what="", scale=None):
    dout = torch.randn_like(q)
    got = _kernels_poisoned(q, k, v, cu_q, cu_k, dout, causal, scale or 0.0)
    ref32 = _reference(q.float(), k.float(), v.float(), cu_q, cu_k, dout.float(), causal, scale)
    lowp = _reference(q, k, v, cu_q, cu_k, dout, causal, scale)
    for name, g, r32, lp in zip(("out", "lse", "dq", "dk", "dv"), got, ref32, lowp):
        if name == "lse":
            fin = torch.isfinite(r32)
            assert torch.equal(torch.isfinite(g), fin), f"{what}: lse -inf rows differ"
            g, r32, lp = g[fin], r32[fin], lp[fin]
        assert_close_to_reference(g, lp, r32, what=f"{what} {name}", floor=GRAD_FLOOR if name[0] == "d" else None)


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 8, 16, 32])
@pytest.mark.parametrize("lengths", list(LENGTH_MIXES))
def test_matches_reference(dtype, head_dim, G, lengths):
    lq, lk = LENGTH_MIXES[lengths]
    _check_against_reference(*_case(lq, lk, G, head_dim, dtype, seed=G + head_dim), what=f"{dtype} D{head_dim} G{G} {lengths}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 16])
@pytest.mark.parametrize("lengths", ["mix", "chunked"])
def test_not_causal(G, lengths):
    lq, lk = LENGTH_MIXES[lengths]
    _check_against_reference(*_case(lq, lk, G, 128, torch.bfloat16, seed=G), causal=False, what=f"non-causal G{G}")


@pytest.mark.gpu
def test_softmax_scale_and_long_sequence():
    lq = lk = [4100, 33]
    _check_against_reference(*_case(lq, lk, 16, 128, torch.bfloat16, seed=3), scale=0.05, what="scale 0.05")


@pytest.mark.gpu
def test_queries_before_any_key_get_zero_and_neg_inf():
    # causal with Lq > Lk: the first Lq - Lk queries see no key (bottom-right alignment)
    q, k, v, cu_q, cu_k = _case([100], [40], 4, 64, torch.float16)
    dout = torch.randn_like(q)
    out, lse, dq, dk, dv = _kernels_poisoned(q, k, v, cu_q, cu_k, dout, True)
    assert torch.equal(out[:60], torch.zeros_like(out[:60])) and torch.isneginf(lse[:, :60]).all()
    assert torch.equal(dq[:60], torch.zeros_like(dq[:60]))
    assert not any(torch.isnan(t).any() for t in (out, lse[:, 60:], dq, dk, dv))


@pytest.mark.gpu
def test_backward_is_bitwise_deterministic():
    q, k, v, cu_q, cu_k = _case([3000, 1000], [3000, 1000], 16, 128, torch.bfloat16)
    dout = torch.randn_like(q)
    first = _kernels_poisoned(q, k, v, cu_q, cu_k, dout, True)
    for _ in range(2):
        again = _kernels_poisoned(q, k, v, cu_q, cu_k, dout, True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_portable_arch_variants_through_ptx(arch, G, arch_override):
    if arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} not compiled into this build")
    arch_override(arch)
    for dtype, D in ((torch.bfloat16, 128), (torch.float16, 64)):
        for lengths in ("mix", "chunked"):
            lq, lk = LENGTH_MIXES[lengths]
            _check_against_reference(*_case(lq, lk, G, D, dtype, seed=G), what=f"{arch} G{G} {dtype} D{D} {lengths}")


@pytest.mark.gpu
def test_autograd_and_torch_compile_fullgraph():
    q, k, v, cu_q, cu_k = _case([256, 64], [256, 64], 16, 128, torch.bfloat16)

    def f(q, k, v):
        return infllmv2.dense_attn_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=256, max_seqlen_k=256)

    compiled = torch.compile(f, fullgraph=True)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    out_c, out_e = compiled(q1, k1, v1), f(q2, k2, v2)
    assert torch.equal(out_c, out_e)
    dout = torch.randn_like(out_e)
    out_c.backward(dout)
    out_e.backward(dout)
    assert torch.equal(q1.grad, q2.grad) and torch.equal(k1.grad, k2.grad) and torch.equal(v1.grad, v2.grad)
    ref32 = _reference(q.float(), k.float(), v.float(), cu_q, cu_k, dout.float(), True)
    lowp = _reference(q, k, v, cu_q, cu_k, dout, True)
    for name, got, r32, lp in zip(("out", "dq", "dk", "dv"), (out_e, q2.grad, k2.grad, v2.grad),
                                  ref32[:1] + ref32[2:], lowp[:1] + lowp[2:]):
        assert_close_to_reference(got.detach(), lp, r32, what=name, floor=GRAD_FLOOR if name[0] == "d" else None)


@pytest.mark.gpu
def test_c_abi_errors():
    lib = _lib.lib()
    q, k, v, cu_q, cu_k = _case([128], [128], 4, 128, torch.bfloat16)
    p = [t.data_ptr() for t in (q, k, v, cu_q, cu_k, q, q)]
    st = lib.infllmv2_dense_attn_fwd(*p, 1, 128, 128, 128, 128, 8, 2, 128, 2, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "causal must be 0 or 1, got 2" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_dense_attn_fwd(*p, 1, 128, 128, 128, 129, 8, 2, 128, 1, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "max_seqlen_k must be in [0, total_k=128]" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_dense_attn_fwd(*p, 1, 128, 128, 128, 128, 8, 2, 96, 1, 0, 0.0, None)
    assert st == _lib.ERR_UNSUPPORTED and "head_dim must be 64 or 128" in lib.infllmv2_last_error().decode()
    host = torch.zeros(10)
    st = lib.infllmv2_dense_attn_fwd(host.data_ptr(), *p[1:], 1, 128, 128, 128, 128, 8, 2, 128, 1, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "q must be device memory" in lib.infllmv2_last_error().decode()
    pb = [t.data_ptr() for t in (q, k, v, q, q, q, cu_q, cu_k, q, k, v, q)]
    st = lib.infllmv2_dense_attn_bwd(*pb, 16, 1, 128, 128, 128, 128, 8, 2, 128, 1, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "workspace_size is 16 bytes" in lib.infllmv2_last_error().decode()
    # key blocks past the grid's z limit (65535 blocks of 128 keys on sm_90a, 64 elsewhere) are
    # refused before any kernel runs
    n = 65536 * 128
    st = lib.infllmv2_dense_attn_bwd(*pb, 1 << 30, 1, 128, n, 128, n, 8, 2, 128, 1, 0, 0.0, None)
    assert st == _lib.ERR_UNSUPPORTED
    assert re.search(r"max_seqlen_k must be at most (8388480|4194240)", lib.infllmv2_last_error().decode())
    # TMA and vector loads need 16-byte aligned tensors
    st = lib.infllmv2_dense_attn_fwd(p[0] + 2, *p[1:], 1, 128, 128, 128, 128, 8, 2, 128, 1, 0, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "q must be 16-byte aligned" in lib.infllmv2_last_error().decode()


# ---------------------------------------------------------------------------------- CPU tier


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_custom_ops_forward_and_backward(causal):
    lq, lk = [70, 30], [130, 30]
    q = random_tokens(lq, 4, 16, torch.float64, seed=1).requires_grad_()
    k = random_tokens(lk, 2, 16, torch.float64, seed=2).requires_grad_()
    v = random_tokens(lk, 2, 16, torch.float64, seed=3).requires_grad_()
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    out, lse = torch.ops.infllmv2.dense_attn_fwd(q, k, v, cu_q, cu_k, 70, 130, causal, 0.0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref, ref_lse = reference.dense_attn_varlen(q, k, v, cu_q, cu_k, None, causal)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert torch.allclose(out, ref) and torch.equal(lse, ref_lse)
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b)
    assert torch.equal(infllmv2.dense_attn_varlen(q, k, v, cu_q, cu_k, causal=causal), ref)


def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(10, 8, 64, dtype=torch.bfloat16)
        k = torch.empty(12, 2, 64, dtype=torch.bfloat16)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.infllmv2.dense_attn_fwd(q, k, k, cu, cu, 5, 6, True, 0.0)
        dq, dk, dv = torch.ops.infllmv2.dense_attn_bwd(q, q, k, k, q, lse, cu, cu, 5, 6, True, 0.0)
    assert out.shape == q.shape and lse.shape == (8, 10) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(q=a["q"][:, :3]), "q heads \\(3\\) must be a multiple of k heads \\(2\\)"),
        (lambda a: a.update(v=a["v"][:-1]), "must share"),
        (lambda a: a.update(cu_seqlens_q=a["cu_seqlens_q"].long()), "cu_seqlens_q must be a 1-D int32"),
        (lambda a: a.update(causal=1), "causal must be a bool"),
    ],
)
def test_bad_arguments_name_the_argument(mutate, message):
    args = dict(q=random_tokens([10, 15], 4, 16, torch.float32), k=random_tokens([10, 15], 2, 16, torch.float32),
                v=random_tokens([10, 15], 2, 16, torch.float32), cu_seqlens_q=cu_seqlens([10, 15]),
                cu_seqlens_k=cu_seqlens([10, 15]))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        infllmv2.dense_attn_varlen(**args)
