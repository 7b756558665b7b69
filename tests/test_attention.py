"""attention: the dense-sparse switch over stages 0-2, and SparseConfig."""

import ctypes
import re

import pytest
import torch

import infllmv2
from infllmv2 import SparseConfig, reference
from infllmv2.testing import (GRAD_FLOOR, assert_close_to_reference, cu_seqlens, no_host_sync, oracle_block_scores,
                              random_tokens, selection_mismatch)

# small enough for the CPU reference: 64-token blocks, a 2-block window, 3 scored blocks
SMALL = SparseConfig(dense_len=300, window_size=128, topk=3)


def _ref_kwargs(cfg):
    return dict(dense_len=cfg.dense_len, topk=cfg.num_selected, kernel_size=cfg.kernel_size,
                kernel_stride=cfg.kernel_stride, block_size=cfg.block_size, init_blocks=cfg.init_blocks,
                local_blocks=cfg.local_blocks, approx_lse=cfg.approx_lse, norm_kernel_size=cfg.norm_kernel_size,
                norm_kernel_stride=cfg.norm_kernel_stride)


def _qkv(lengths_q, lengths_k, G, D, dtype, device="cpu", seed=0):
    q = random_tokens(lengths_q, 2 * G, D, dtype, device, seed=seed)
    k = random_tokens(lengths_k, 2, D, dtype, device, seed=seed + 1)
    v = random_tokens(lengths_k, 2, D, dtype, device, seed=seed + 2)
    return q, k, v, cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)


# ---------------------------------------------------------------------------------- CPU tier


@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 200], [400, 65, 1], [700, 350]])
@pytest.mark.parametrize("approx_lse", [True, False])
def test_cpu_matches_reference_both_paths(lengths, approx_lse):
    cfg = SparseConfig(dense_len=300, window_size=128, topk=3, approx_lse=approx_lse)
    q, k, v, cu_q, cu_k = _qkv(lengths, lengths, 4, 32, torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = infllmv2.attention(q, k, v, cu_q, cu_k, config=cfg, return_lse=True)
    ref, ref_lse = reference.attention(q, k, v, cu_q, cu_k, **_ref_kwargs(cfg))
    assert torch.allclose(out, ref) and torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b)


def test_cpu_switch_follows_max_seqlen_k():
    # below dense_len the result is dense causal attention, from dense_len on it is sparse
    q, k, v, cu_q, cu_k = _qkv([299], [299], 2, 16, torch.float64)
    dense = reference.dense_attn_varlen(q, k, v, cu_q, cu_k)[0]
    assert torch.allclose(infllmv2.attention(q, k, v, cu_q, cu_k, config=SMALL), dense)
    q, k, v, cu_q, cu_k = _qkv([700], [700], 2, 16, torch.float64)
    dense = reference.dense_attn_varlen(q, k, v, cu_q, cu_k)[0]
    sparse = infllmv2.attention(q, k, v, cu_q, cu_k, config=SMALL)
    assert not torch.allclose(sparse, dense)  # 5 of up to 11 blocks per query: not the dense result
    assert torch.allclose(sparse[:64 * 5], dense[:64 * 5])  # queries with <= 5 blocks: every block selected


def test_cpu_padded_layout_and_decode():
    B, S, G, D = 2, 320, 2, 16
    q = torch.randn(B, S, 2 * G, D, dtype=torch.float64)
    k = torch.randn(B, S, 2, D, dtype=torch.float64)
    v = torch.randn(B, S, 2, D, dtype=torch.float64)
    out, lse = infllmv2.attention_padded(q, k, v, config=SMALL, return_lse=True)
    cu = cu_seqlens([S] * B)
    ref, ref_lse = reference.attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, **_ref_kwargs(SMALL))
    assert out.shape == (B, S, 2 * G, D) and lse.shape == (B, 2 * G, S)
    assert torch.allclose(out.flatten(0, 1), ref)
    assert torch.allclose(lse, ref_lse.reshape(2 * G, B, S).transpose(0, 1))
    # one-token decode: the last query against the whole cache gives the last row of the prefill
    dec = infllmv2.attention_padded(q[:, -1:], k, v, config=SMALL)
    assert torch.allclose(dec[:, 0], out[:, -1])


def test_sparse_config_from_minicpm_dict():
    d = {"kernel_size": 32, "kernel_stride": 16, "init_blocks": 1, "block_size": 64, "window_size": 2048,
         "topk": 64, "use_nope": False, "dense_len": 8192}
    cfg = SparseConfig.from_dict(d)
    assert cfg == SparseConfig() and cfg.local_blocks == 32 and cfg.num_selected == 96
    assert SparseConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "d, message",
    [
        ({"window_size": 100}, "window_size \\(100\\) must be a multiple of block_size"),
        ({"block_size": 40, "window_size": 2000}, "block_size \\(40\\) must be a multiple of kernel_stride"),
        ({"kernel_size": 8}, "kernel_size \\(8\\) must be >= kernel_stride"),
        ({"topk": -1}, "SparseConfig.topk"),
        ({"topk": 0, "window_size": 0}, "must be >= 1"),
        ({"approx_lse": 1}, "approx_lse must be a bool"),
        ({"phsa_lambda": 2.0}, "phsa_lambda must be a number in \\[0, 1\\]"),
        ({"use_nope": True}, "use_nope=True is not supported"),
        ({"top_k": 3}, "unknown keys \\['top_k'\\]"),
    ],
)
def test_sparse_config_errors_name_the_key(d, message):
    with pytest.raises(ValueError, match=message):
        SparseConfig.from_dict(d)


def test_bad_inputs_name_the_argument():
    q, k, v, cu_q, cu_k = _qkv([10], [10], 2, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        infllmv2.attention(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match="sparse_config must be a mapping"):
        infllmv2.attention(q, k, v, cu_q, cu_k, config=3)
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        infllmv2.attention_padded(q, k, v)


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("G", [1, 4, 16])
@pytest.mark.parametrize("lengths", [[1, 63, 64, 65, 200], [700, 65, 1000, 1]])
def test_cuda_matches_reference(dtype, head_dim, G, lengths):
    """Dense path (all sequences below dense_len) or sparse path: the kernels' selection is
    checked tie-aware against the reference block scores, then the output and gradients
    against the reference attention over that selection, by the 2x error rule."""
    q, k, v, cu_q, cu_k = _qkv(lengths, lengths, G, head_dim, dtype, "cuda", seed=G)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = infllmv2.attention(q, k, v, cu_q, cu_k, config=SMALL)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    sparse = max(lengths) >= SMALL.dense_len
    if sparse:
        idx = infllmv2.select_decode(q, k, cu_q, cu_k, topk=SMALL.num_selected, local_blocks=SMALL.local_blocks)
        blocks = oracle_block_scores(q, k, cu_q, cu_k, SMALL.init_blocks, SMALL.local_blocks)
        why = selection_mismatch(idx.cpu(), blocks, SMALL.num_selected)
        assert why is None, why

    def ref(dt):
        qq, kk, vv = (t.detach().cpu().to(dt).requires_grad_() for t in (q, k, v))
        c_q, c_k = cu_q.cpu(), cu_k.cpu()
        if sparse:
            o = reference.sparse_attn_varlen(qq, kk, vv, c_q, c_k, idx.cpu())[0]
        else:
            o = reference.dense_attn_varlen(qq, kk, vv, c_q, c_k)[0]
        return [o.detach(), *torch.autograd.grad(o, (qq, kk, vv), dout.cpu().to(dt))]

    ref32, lowp = ref(torch.float32), ref(dtype)
    for name, got, r32, lp in zip(("out", "dq", "dk", "dv"), (out, *grads), ref32, lowp):
        assert_close_to_reference(got.detach().cpu(), lp, r32, what=f"{'sparse' if sparse else 'dense'} {name}",
                                  floor=GRAD_FLOOR if name[0] == "d" else None)


@pytest.mark.gpu
def test_cuda_dense_path_torch_compile_fullgraph():
    q, k, v, cu_q, cu_k = _qkv([200, 100], [200, 100], 16, 128, torch.bfloat16, "cuda")

    def f(q, k, v):
        return infllmv2.attention(q, k, v, cu_q, cu_k, 200, 200, config=SMALL)

    out_c = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(out_c, f(q, k, v))


@pytest.mark.gpu
def test_cuda_sparse_path_without_host_reads_and_torch_compile_fullgraph():
    """With max_seqlen_q/k given, compression, selection and sparse attention, forward and
    backward, read nothing on the host (a training step can be captured), and the call traces
    into one graph."""
    q, k, v, cu_q, cu_k = _qkv([700, 65, 1], [900, 65, 1], 16, 128, torch.bfloat16, "cuda", seed=7)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return infllmv2.attention(q, k, v, cu_q, cu_k, 700, 900, config=SMALL)

    want = f(q, k, v)
    want_grads = torch.autograd.grad(want.float().sum(), (q, k, v))
    with no_host_sync():
        out = f(q, k, v)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    assert torch.equal(out, want)
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)
    out_c = torch.compile(f, fullgraph=True)(q, k, v)
    assert torch.equal(out_c, want)


# ------------------------------------------------------------- the one-call C entry point


def _c_config(cfg):
    from infllmv2 import _lib

    return _lib.SparseConfigC(**{f: int(getattr(cfg, f)) for f, _ in _lib.SparseConfigC._fields_})


needs_library = pytest.mark.skipif(not infllmv2.library_available(), reason="no kernel library")


@needs_library
def test_c_config_default_is_sparse_config_default():
    from infllmv2 import _lib

    c = _lib.SparseConfigC()
    _lib.lib().infllmv2_sparse_config_default(ctypes.byref(c))
    assert {f: getattr(c, f) for f, _ in c._fields_} == {f: int(getattr(SparseConfig(), f)) for f, _ in c._fields_}


@needs_library
@pytest.mark.parametrize(
    "change, status, message",
    [
        (dict(kernel_size=64), "ERR_UNSUPPORTED", "kernel_size/kernel_stride/block_size must be 32/16/64"),
        (dict(window_size=100), "ERR_INVALID_ARGUMENT", "window_size must be a multiple of block_size"),
        (dict(topk=200), "ERR_UNSUPPORTED", "topk \\+ window_size / block_size must be in \\[1, 128\\], got 232"),
        (dict(approx_lse=2), "ERR_INVALID_ARGUMENT", "approx_lse must be 0 or 1"),
        (dict(init_blocks=-1), "ERR_INVALID_ARGUMENT", "init_blocks, topk and dense_len must be >= 0"),
    ],
)
@pytest.mark.parametrize("op", ["fwd", "bwd"])
def test_c_attention_config_errors(change, status, message, op):
    from infllmv2 import _lib

    c = _c_config(SparseConfig())
    for f, v in change.items():
        setattr(c, f, v)
    if op == "fwd":
        st = _lib.lib().infllmv2_attention_fwd(*[None] * 5, None, 0.0, *[None] * 4, 0, 1, 10, 10, 10, 10, 32, 2, 128, 0,
                                               0.0, ctypes.byref(c), None)
    else:
        st = _lib.lib().infllmv2_attention_bwd(*[None] * 13, 0, 1, 10, 10, 10, 10, 32, 2, 128, 0, 0.0, ctypes.byref(c),
                                               None)
    assert st == getattr(_lib, status)
    assert re.search(f"infllmv2_attention_{op}: config {message}", _lib.lib().infllmv2_last_error().decode())


@needs_library
def test_c_attention_bwd_workspace_and_selection_checks():
    """The backward's workspace query follows the forward's switch, and the sparse path asks for
    the forward's selection by name, before touching the device."""
    from infllmv2 import _lib

    lib = _lib.lib()
    cfg = SparseConfig(dense_len=1000, window_size=128, topk=3)
    c = _c_config(cfg)
    # below dense_len: the dense backward's rows of lse and Delta
    assert lib.infllmv2_attention_bwd_workspace_size(2, 700, 900, 999, 32, 2, ctypes.byref(c)) == \
        lib.infllmv2_dense_attn_bwd_workspace_size(700, 32)
    # at dense_len: the sparse backward's, with K = topk + window_size / block_size = 5
    assert lib.infllmv2_attention_bwd_workspace_size(2, 700, 1900, 1000, 32, 2, ctypes.byref(c)) == \
        lib.infllmv2_sparse_attn_bwd_workspace_size(700, 1900, 2, 32, 2, 5)
    assert lib.infllmv2_attention_bwd_workspace_size(2, 700, 1900, 1000, 32, 2, None) == 0
    need = lib.infllmv2_attention_bwd_workspace_size(2, 700, 1900, 1000, 32, 2, ctypes.byref(c))

    def call(workspace_size):
        return lib.infllmv2_attention_bwd(*[None] * 13, workspace_size, 2, 700, 1900, 500, 1000, 32, 2, 128, 0, 0.0,
                                          ctypes.byref(c), None)

    assert call(need - 1) == _lib.ERR_INVALID_ARGUMENT
    assert re.search(f"infllmv2_attention_bwd: workspace_size is {need - 1} bytes, "
                     f"infllmv2_attention_bwd_workspace_size\\(\\) asks for {need}", lib.infllmv2_last_error().decode())
    assert call(need) == _lib.ERR_INVALID_ARGUMENT
    assert re.search("infllmv2_attention_bwd: topk_idx must not be NULL on the sparse path \\(max_seqlen_k 1000 >= "
                     "config dense_len 1000\\)", lib.infllmv2_last_error().decode())


def _c_attention_fwd(q, k, v, cu_q, cu_k, out, lse, idx, ws, size, max_seqlen_k, c, punct=None, lam=0.0):
    """infllmv2_attention_fwd on torch tensors (None: a NULL pointer), max_seqlen_q 1000."""
    from infllmv2 import _lib
    from infllmv2.ops import _stream

    def ptr(t):
        return None if t is None else t.data_ptr()

    return _lib.lib().infllmv2_attention_fwd(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), cu_q.data_ptr(), cu_k.data_ptr(), ptr(punct), lam, ptr(out),
        ptr(lse), ptr(idx), ptr(ws), size, cu_q.numel() - 1, q.shape[0], k.shape[0], 1000, max_seqlen_k, q.shape[1],
        k.shape[1], q.shape[2], 0, 0.0, ctypes.byref(c), _stream(q.device))


@pytest.mark.gpu
@pytest.mark.parametrize("dense_len", [0, 100000])
@pytest.mark.parametrize("approx_lse", [True, False])
@pytest.mark.parametrize("phsa", [False, True])
def test_c_attention_fwd_equals_the_torch_layer(dense_len, approx_lse, phsa):
    from infllmv2 import _lib

    cfg = SparseConfig(dense_len=dense_len, window_size=128, topk=3, approx_lse=approx_lse)
    lengths = [700, 65, 1000, 1, 31]
    q, k, v, cu_q, cu_k = _qkv(lengths, lengths, 16, 128, torch.bfloat16, "cuda")
    punct = (torch.rand(k.shape[0], device="cuda") < 0.15) if phsa else None
    want, want_lse = infllmv2.attention(q, k, v, cu_q, cu_k, config=cfg, return_lse=True, punct_mask=punct)
    punct_c = punct.to(torch.uint8) if phsa else None
    lam = cfg.phsa_lambda if phsa else 0.0
    c = _c_config(cfg)
    lib = _lib.lib()
    size = lib.infllmv2_attention_fwd_workspace_size(len(lengths), q.shape[0], k.shape[0], 1000, 2, 128, ctypes.byref(c))
    assert (size == 0) == (dense_len > 1000)
    ws = torch.full((max(size, 1),), 255, dtype=torch.uint8, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    idx = torch.full((2, q.shape[0], cfg.num_selected), -7, dtype=torch.int32, device="cuda")
    st = _c_attention_fwd(q, k, v, cu_q, cu_k, out, lse, idx, ws, size, 1000, c, punct_c, lam)
    assert st == _lib.OK, lib.infllmv2_last_error().decode()
    torch.cuda.synchronize()
    # the same kernels on the same data: bitwise the torch layer's result
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    if dense_len == 0:
        sel = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=cfg.num_selected, local_blocks=cfg.local_blocks,
                                     approx_lse=approx_lse, punct_mask=punct)
        assert torch.equal(idx, sel)
        if phsa:
            # the punctuation flags reach the selection (with none of them, it differs)
            plain = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=cfg.num_selected, local_blocks=cfg.local_blocks,
                                           approx_lse=approx_lse)
            assert not torch.equal(idx, plain)
        # a max_seqlen_k above every length (it sizes grids only; at most total_k here) gives the
        # same result
        out2 = torch.full_like(q, float("nan"))
        st = _c_attention_fwd(q, k, v, cu_q, cu_k, out2, lse, None, ws, size, k.shape[0], c, punct_c, lam)
        assert st == _lib.OK, lib.infllmv2_last_error().decode()
        torch.cuda.synchronize()
        assert torch.equal(out2, want)
    else:
        assert (idx == -7).all()
    st = _c_attention_fwd(q, k, v, cu_q, cu_k, out, lse, None, ws, 16, 1000, c, punct_c, lam)
    if size > 16:
        assert st == _lib.ERR_INVALID_ARGUMENT and "workspace_size is 16 bytes" in lib.infllmv2_last_error().decode()


@pytest.mark.gpu
@pytest.mark.parametrize("dense_len", [0, 100000])
def test_c_attention_fwd_phsa_errors(dense_len):
    """A bad PHSA argument fails by name on either side of the switch, before any launch."""
    from infllmv2 import _lib

    cfg = SparseConfig(dense_len=dense_len, window_size=128, topk=3)
    lengths = [700, 1000]
    q, k, v, cu_q, cu_k = _qkv(lengths, lengths, 16, 128, torch.bfloat16, "cuda")
    c = _c_config(cfg)
    lib = _lib.lib()
    size = lib.infllmv2_attention_fwd_workspace_size(len(lengths), q.shape[0], k.shape[0], 1000, 2, 128, ctypes.byref(c))
    ws = torch.empty((max(size, 1),), dtype=torch.uint8, device="cuda")
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    punct = torch.zeros(k.shape[0], dtype=torch.uint8, device="cuda")
    for lam in (1.5, -0.25, float("nan")):
        st = _c_attention_fwd(q, k, v, cu_q, cu_k, out, lse, None, ws, size, 1000, c, punct, lam)
        assert st == _lib.ERR_INVALID_ARGUMENT
        assert re.search("infllmv2_attention_fwd: phsa_lambda must be in \\[0, 1\\], got", lib.infllmv2_last_error().decode())
    st = _c_attention_fwd(q, k, v, cu_q, cu_k, out, lse, None, ws, size, 1000, c, punct.cpu(), 0.5)
    assert st == _lib.ERR_INVALID_ARGUMENT
    assert "infllmv2_attention_fwd: punct_mask" in lib.infllmv2_last_error().decode()
    torch.cuda.synchronize()
    assert out.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("dense_len", [0, 100000])
@pytest.mark.parametrize("G", [4, 16])
def test_c_attention_bwd_equals_the_torch_layer(dense_len, G):
    """The one-call C backward on the forward's outputs and selection gives bitwise the gradients
    of the torch layer's autograd (the same deterministic kernels), on either side of the switch."""
    from infllmv2 import _lib
    from infllmv2.ops import _stream

    cfg = SparseConfig(dense_len=dense_len, window_size=128, topk=3)
    lengths = [700, 65, 1000, 1, 31]
    q, k, v, cu_q, cu_k = _qkv(lengths, lengths, G, 128, torch.bfloat16, "cuda")
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = infllmv2.attention(q, k, v, cu_q, cu_k, config=cfg, return_lse=True)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, k, v), dout)
    hq, total_q, total_k = q.shape[1], q.shape[0], k.shape[0]
    idx = torch.full((2, total_q, cfg.num_selected), -7, dtype=torch.int32, device="cuda")
    c = _c_config(cfg)
    lib = _lib.lib()
    size = lib.infllmv2_attention_fwd_workspace_size(len(lengths), total_q, total_k, 1000, 2, 128, ctypes.byref(c))
    ws = torch.empty((max(size, 1),), dtype=torch.uint8, device="cuda")
    out_c = torch.empty_like(out)
    lse_c = torch.empty_like(lse)
    st = _c_attention_fwd(q, k, v, cu_q, cu_k, out_c, lse_c, idx, ws, size, 1000, c)
    assert st == _lib.OK, lib.infllmv2_last_error().decode()

    size = lib.infllmv2_attention_bwd_workspace_size(len(lengths), total_q, total_k, 1000, hq, 2, ctypes.byref(c))
    ws = torch.full((size,), 255, dtype=torch.uint8, device="cuda")
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    # the dense side ignores the selection: NULL there
    sel = idx.data_ptr() if dense_len == 0 else None
    st = lib.infllmv2_attention_bwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), out_c.data_ptr(), dout.data_ptr(),
                                    lse_c.data_ptr(), sel, cu_q.data_ptr(), cu_k.data_ptr(),
                                    *[g.data_ptr() for g in grads], ws.data_ptr(), size, len(lengths), total_q,
                                    total_k, 1000, 1000, hq, 2, 128, 0, 0.0, ctypes.byref(c), _stream(q.device))
    assert st == _lib.OK, lib.infllmv2_last_error().decode()
    torch.cuda.synchronize()
    assert torch.equal(out_c, out) and torch.equal(lse_c, lse)
    for name, got, ref in zip("qkv", grads, want):
        assert torch.equal(got, ref), f"d{name}"
