"""The C ABI itself, through ctypes: build info, arch override, status codes and messages."""

import ctypes
from types import SimpleNamespace

import pytest
import torch

import infllmv2
from infllmv2 import _lib
from infllmv2.testing import cu_seqlens, random_tokens


def _compress(k=1, cu_k=1, cu_c=1, punct=None, lam=0.5, ck=1, batch=1, total_k=64, total_c=3, max_nc=3,
              heads_k=2, head_dim=128, dtype=_lib.DTYPE_BF16, ks=32, st=16):
    lib = _lib.lib()
    status = lib.infllmv2_compress_keys(k, cu_k, cu_c, punct, lam, ck, batch, total_k, total_c, max_nc, heads_k,
                                        head_dim, dtype, ks, st, None)
    return status, lib.infllmv2_last_error().decode()


def test_build_info_lists_archs_and_kernels():
    info = infllmv2.build_info()
    assert info["abi_version"] == _lib.ABI_VERSION == _lib.lib().infllmv2_abi_version()
    assert info["tilelang"] == "0.1.15"
    assert info["archs"] and set(info["archs"]) <= {"sm_80", "sm_89", "sm_90a"}
    for arch in info["archs"]:
        names = {u["name"] for u in info["kernels"] if u["arch"] == arch and u["kernel"].startswith("compress_keys")}
        # {plain, phsa, kvcache, kvcache phsa} x {bf16, fp16} x {64, 128}
        assert len(names) == 16, (arch, names)


def test_library_identity_names_the_loaded_binary():
    import hashlib

    from infllmv2.testing import library_identity

    ident = library_identity()
    with open(_lib.library_path(), "rb") as f:
        assert ident["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert ident["archs"] == infllmv2.build_info()["archs"] and "kernels" not in ident


def test_unknown_arch_override_is_refused():
    with pytest.raises(infllmv2.Infllmv2UnsupportedError, match="arch 'sm_75' is not compiled in; compiled archs: sm_"):
        infllmv2.set_arch_override("sm_75")
    infllmv2.set_arch_override(None)


@pytest.mark.parametrize(
    "kwargs, status, message",
    [
        (dict(head_dim=96), _lib.ERR_UNSUPPORTED, "head_dim must be 64 or 128, got 96"),
        (dict(dtype=7), _lib.ERR_INVALID_ARGUMENT, "dtype must be INFLLMV2_DTYPE_BF16 or INFLLMV2_DTYPE_FP16, got 7"),
        (dict(batch=0), _lib.ERR_INVALID_ARGUMENT, "batch must be in \\[1, 65535\\], got 0"),
        (dict(heads_k=70000), _lib.ERR_INVALID_ARGUMENT, "heads_k must be in \\[1, 65535\\], got 70000"),
        (dict(total_k=-1), _lib.ERR_INVALID_ARGUMENT, "total_k must be in"),
        (dict(total_k=2**31), _lib.ERR_INVALID_ARGUMENT, "total_k must be in"),
        (dict(max_nc=4), _lib.ERR_INVALID_ARGUMENT, "max_nc must be in \\[0, total_c=3\\], got 4"),
        (dict(ks=0), _lib.ERR_INVALID_ARGUMENT, "kernel_size and kernel_stride must be >= 1"),
        (dict(total_c=100, max_nc=1), _lib.ERR_INVALID_ARGUMENT, "total_c=100 exceeds what total_k=64 keys"),
        (dict(punct=1, lam=2.0), _lib.ERR_INVALID_ARGUMENT, "phsa_lambda must be in \\[0, 1\\], got 2"),
    ],
)
def test_invalid_arguments_are_named(kwargs, status, message):
    got, text = _compress(**kwargs)
    assert got == status
    assert text.startswith("infllmv2_compress_keys: ")
    import re

    assert re.search(message, text), text


@pytest.mark.parametrize(
    "batch, ks, st, message",
    [
        (0, 32, 16, "batch must be in \\[1, 65535\\], got 0"),
        (65536, 32, 16, "batch must be in \\[1, 65535\\], got 65536"),
        (1, 0, 16, "kernel_size and kernel_stride must be >= 1, got 0 and 16"),
        (1, 32, -1, "kernel_size and kernel_stride must be >= 1, got 32 and -1"),
    ],
)
def test_compressed_offsets_arguments_are_named(batch, ks, st, message):
    lib = _lib.lib()
    status = lib.infllmv2_attention_compressed_offsets(1, 1, batch, ks, st, None)
    text = lib.infllmv2_last_error().decode()
    import re

    assert status == _lib.ERR_INVALID_ARGUMENT and text.startswith("infllmv2_attention_compressed_offsets: ")
    assert re.search(message, text), text


@pytest.mark.gpu
@pytest.mark.parametrize("ks, st", [(32, 16), (128, 64), (16, 32), (1, 1)])
def test_compressed_offsets_match_the_reference(ks, st):
    from infllmv2.reference import _compressed_offsets

    lengths = [0, 1, 15, 16, 31, 32, 33, 47, 48, 127, 128, 129, 1000, 4096, 5]
    cu_k = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = torch.full((len(lengths) + 1,), -7, dtype=torch.int32, device="cuda")
    lib = _lib.lib()
    assert lib.infllmv2_attention_compressed_offsets(cu_k.data_ptr(), out.data_ptr(), len(lengths), ks, st, None) == 0
    torch.cuda.synchronize()
    assert out.tolist() == _compressed_offsets(cu_k.tolist(), ks, st)[1]
    # device pointers are checked like every other entry point's
    status = lib.infllmv2_attention_compressed_offsets(cu_k.data_ptr(), cu_k.cpu().data_ptr(), len(lengths), ks, st,
                                                       None)
    assert status == _lib.ERR_INVALID_ARGUMENT and "cu_seqlens_c must be device memory" in \
        lib.infllmv2_last_error().decode()


def _select_from_keys(q=1, k=1, cu_q=1, cu_k=1, punct=None, lam=0.5, out=1, ws=1, ws_size=1 << 30, batch=1,
                      total_q=64, total_k=64, max_q=64, max_k=64, heads=32, heads_k=2, head_dim=128, topk=96, init=1,
                      local=32, approx=1, norm_ks=128, norm_st=64, dtype=_lib.DTYPE_BF16, scale=0.0):
    lib = _lib.lib()
    status = lib.infllmv2_select_blocks_from_keys(q, k, cu_q, cu_k, punct, lam, out, ws, ws_size, batch, total_q, total_k,
                                                  max_q, max_k, heads, heads_k, head_dim, topk, init, local, approx,
                                                  norm_ks, norm_st, dtype, scale, None)
    return status, lib.infllmv2_last_error().decode()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch=0), "batch must be in \\[1, 65535\\], got 0"),
        (dict(total_k=-1), "total_k must be >= 0 and heads_k, head_dim >= 1, got -1, 2, 128"),
        (dict(heads_k=0), "total_k must be >= 0 and heads_k, head_dim >= 1, got 64, 0, 128"),
        (dict(approx=2), "approx_lse must be 0 or 1, got 2"),
        (dict(norm_st=0), "norm_kernel_size and norm_kernel_stride must be >= 1, got 128 and 0"),
        (dict(max_k=32), "max_seqlen_k must be >= max_seqlen_q \\(64\\) and >= 0, got 32"),
        (dict(ws_size=100), "workspace_size is 100 bytes, infllmv2_select_blocks_from_keys_workspace_size\\(\\) asks for"),
    ],
)
def test_select_blocks_from_keys_arguments_are_named(kwargs, message):
    import re

    status, text = _select_from_keys(**kwargs)
    assert status == _lib.ERR_INVALID_ARGUMENT and text.startswith("infllmv2_select_blocks_from_keys: "), text
    assert re.search(message, text), text


def test_select_blocks_from_keys_workspace_size():
    size = _lib.lib().infllmv2_select_blocks_from_keys_workspace_size
    # offsets (two 256-byte slots), then the fine and coarse keys at their bounds total_k // s + batch
    row = 2 * 128 * 2
    exact = 2 * 256 + -(-(1000 // 16 + 3) * row // 256) * 256
    assert size(3, 1000, 2, 128, 0, 64) == exact
    assert size(3, 1000, 2, 128, 1, 64) == exact + -(-(1000 // 64 + 3) * row // 256) * 256
    for bad in [(0, 1000, 2, 128, 1, 64), (3, -1, 2, 128, 1, 64), (3, 1000, 0, 128, 1, 64), (3, 1000, 2, 128, 2, 64),
                (3, 1000, 2, 128, 1, 0)]:
        assert size(*bad) == 0, bad


def test_sparse_attn_bwd_workspace_size():
    size = _lib.lib().infllmv2_sparse_attn_bwd_workspace_size
    # (total_q, total_k, batch, heads, heads_k, topk). Regions at 256-byte boundaries: Delta
    # (fp32 heads x total_q); each row's (LSE, Delta) for dK/dV (fp32 total_q x heads x 2); the
    # member index's counts (2 KV heads x 64 slices x n_gb key block indices, n_gb = total_k // 64
    # + batch), its offsets (2 x (n_gb + 1)) and its lists (2 x total_q x topk), all int32; past
    # 8192 queries the partial dK/dV of the first 4 key blocks: 4 x heads_k x ceil(total_q / 8192)
    # pieces x 2 sides x (dK, dV) x 64 x 128 fp32.
    # 4096 + 8192 -> 12288 + 2 * 64 * 3 * 4 -> 13824 + 2 * 4 * 4 -> 14080 + 2 * 128 * 4 * 4
    assert size(128, 128, 1, 8, 2, 4) == 18176
    # 4128 -> 4352 + 8256 -> 12608 -> 12800 + 2 * 64 * 66 * 4 -> 46592 + 2 * 67 * 4 -> 47360 + 2 * 129 * 4 * 4
    assert size(129, 4160, 1, 8, 2, 4) == 51488
    # 3 sequences: n_gb = 4160 // 64 + 3, so 12800 + 34816 -> 47616 + 552 -> 48384 + 4128
    assert size(129, 4160, 3, 8, 2, 4) == 52512
    # 262144 + 524288 -> 786432 + 2 * 64 * 129 * 4 -> 852480 + 2 * 130 * 4 -> 853760 + 2 * 8192 * 64 * 4:
    # no partial
    assert size(8192, 8192, 1, 8, 2, 64) == 853760 + 2 * 8192 * 64 * 4
    # 262176 -> 262400 + 524352 -> 786944 + 66048 -> 852992 + 1040 -> 854272 + 262176 -> 1116672 + the partial
    assert size(8193, 8193, 1, 8, 2, 4) == 1116672 + 4 * 2 * 2 * 2 * 2 * 64 * 128 * 4
    assert size(128, 0, 1, 8, 2, 4) == 12288  # no key block: Delta and the rows' stats alone
    assert size(0, 128, 1, 8, 2, 128) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("phsa", [False, True], ids=["plain", "phsa"])
def test_select_blocks_from_keys_matches_the_ops_it_runs(approx, phsa):
    """Bitwise the selection of the three ops called one by one (each tested against the reference)."""
    from infllmv2.ops import compress_keys, select_blocks_launch

    torch.manual_seed(0)
    lengths = [1, 63, 64, 65, 3000, 777]
    cu = cu_seqlens(lengths, "cuda")
    n = sum(lengths)
    q = torch.randn(n, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(n, 2, 128, device="cuda", dtype=torch.bfloat16)
    punct = (torch.rand(n, device="cuda") < 0.1) if phsa else None
    ck, cu_c = compress_keys(k, cu, 32, 16, punct_mask=punct, phsa_lambda=0.3)
    nk, cu_n = compress_keys(k, cu, 128, 64, punct_mask=punct, phsa_lambda=0.3) if approx else (None, None)
    want = torch.empty(2, n, 40, dtype=torch.int32, device="cuda")
    select_blocks_launch(q, ck, nk, cu, cu, cu_c, cu_n, want, 1, 8, 128, 64, 0.0, max(lengths), max(lengths))
    lib = _lib.lib()
    size = lib.infllmv2_select_blocks_from_keys_workspace_size(len(lengths), n, 2, 128, int(approx), 64)
    # NaN-filled: the compressed keys are written into it by a bound, and the selection's last key
    # chunk of a sequence reads rows past its keys (masked)
    ws = torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda")
    got = torch.full_like(want, -7)
    # held for the calls: the pointer of a temporary is freed memory by the time the C side checks it
    punct_u8 = punct.to(torch.uint8) if phsa else None
    call = dict(q=q.data_ptr(), k=k.data_ptr(), cu_q=cu.data_ptr(), cu_k=cu.data_ptr(),
                punct=punct_u8.data_ptr() if phsa else None, lam=0.3, out=got.data_ptr(),
                ws=ws.data_ptr(), ws_size=size, batch=len(lengths), total_q=n, total_k=n, max_q=max(lengths),
                max_k=max(lengths), heads=16, heads_k=2, head_dim=128, topk=40, init=1, local=8, approx=int(approx))
    status, text = _select_from_keys(**call)
    assert status == _lib.OK, text
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    # Every row of the compressed keys' regions, up to their bounds, was written: the keys, and
    # zeros past the last sequence's, so the selection reads no unwritten memory (the layout of
    # attention.cpp's select_layout: two offset arrays, then the fine and the coarse keys, each
    # at a 256-byte boundary).
    a256 = lambda nbytes: (nbytes + 255) // 256 * 256  # noqa: E731
    row, b = 2 * 128 * 2, len(lengths)
    regions = [(2 * a256((b + 1) * 4), (n // 16 + b) * row)]
    if approx:
        regions.append((regions[0][0] + a256(regions[0][1]), (n // 64 + b) * row))
    for start, nbytes in regions:
        keys = ws[start : start + nbytes].view(torch.bfloat16)
        assert not keys.isnan().any(), "compressed-key rows left unwritten"
    assert regions[-1][0] + a256(regions[-1][1]) == size
    # one byte short of the workspace is refused before anything runs
    status, text = _select_from_keys(**{**call, "ws_size": size - 1})
    assert status == _lib.ERR_INVALID_ARGUMENT and "workspace_size is" in text
    status, text = _select_from_keys(**{**call, "ws": ws.cpu().data_ptr()})
    assert status == _lib.ERR_INVALID_ARGUMENT and "workspace must be device memory" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_calls_fail_cleanly():
    status, text = _compress()
    assert status == _lib.ERR_CUDA and "no usable CUDA device" in text
    assert _lib.lib().infllmv2_selected_arch() is None


@pytest.mark.gpu
def test_pointer_checks_on_gpu():
    k = torch.randn(64, 2, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    cu_c = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    out = torch.empty(3, 2, 128, device="cuda", dtype=torch.bfloat16)
    host = torch.randn(64, 2, 128).bfloat16()
    good = dict(k=k.data_ptr(), cu_k=cu.data_ptr(), cu_c=cu_c.data_ptr(), ck=out.data_ptr())
    assert _compress(**good) == (_lib.OK, "")
    status, text = _compress(**{**good, "k": host.data_ptr()})
    assert status == _lib.ERR_INVALID_ARGUMENT and "k must be device memory, got a host pointer" in text
    status, text = _compress(**{**good, "cu_k": None})
    assert status == _lib.ERR_INVALID_ARGUMENT and "cu_seqlens_k is NULL" in text
    status, text = _compress(**{**good, "ck": ctypes.addressof(ctypes.c_int(0))})
    assert status == _lib.ERR_INVALID_ARGUMENT and "ck must be device memory" in text
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_dispatch_picks_the_native_arch():
    major, minor = torch.cuda.get_device_capability()
    arch = infllmv2.selected_arch()
    archs = infllmv2.build_info()["archs"]
    if (major, minor) == (9, 0) and "sm_90a" in archs:
        assert arch == "sm_90a"
    else:
        assert int(arch[3:5]) <= 10 * major + minor


@pytest.mark.gpu
def test_inconsistent_cu_seqlens_cannot_fault():
    """cu_seqlens that point past the tensors give garbage rows, never an illegal access."""
    k = torch.randn(100, 2, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 1_000_000], dtype=torch.int32, device="cuda")
    cu_c = torch.tensor([0, 6], dtype=torch.int32, device="cuda")
    out = torch.empty(6, 2, 128, device="cuda", dtype=torch.bfloat16)
    status, text = _compress(k=k.data_ptr(), cu_k=cu.data_ptr(), cu_c=cu_c.data_ptr(), ck=out.data_ptr(),
                             total_k=100, total_c=6, max_nc=6)
    assert status == _lib.OK, text
    torch.cuda.synchronize()  # an illegal address would surface here


def _misaligned(t):
    """A contiguous copy of t whose data pointer is one element (2 bytes) past 16-byte alignment."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


_SPARSE = infllmv2.SparseConfig(topk=8, dense_len=0)
# op.argument -> a call on tensors t (q, k, v, cu, ck, cu_c) with that argument misaligned
MISALIGNED = {
    "compress_keys.k": lambda t: infllmv2.compress_keys(_misaligned(t.k), t.cu),
    "select_blocks.q": lambda t: infllmv2.select_blocks(_misaligned(t.q), t.k, t.cu, t.cu, topk=8),
    "select_blocks.k": lambda t: infllmv2.select_blocks(t.q, _misaligned(t.k), t.cu, t.cu, topk=8),
    "group_scores.q": lambda t: infllmv2.group_scores(_misaligned(t.q), t.ck, t.cu, t.cu, t.cu_c),
    "group_scores.ck": lambda t: infllmv2.group_scores(t.q, _misaligned(t.ck), t.cu, t.cu, t.cu_c),
    "attention.sparse.q": lambda t: infllmv2.attention(_misaligned(t.q), t.k, t.v, t.cu, t.cu, config=_SPARSE),
    "attention.sparse.k": lambda t: infllmv2.attention(t.q, _misaligned(t.k), t.v, t.cu, t.cu, config=_SPARSE),
    "attention.dense.k": lambda t: infllmv2.attention(t.q, _misaligned(t.k), t.v, t.cu, t.cu),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(MISALIGNED))
def test_misaligned_tensors_are_refused(case):
    # TileLang moves rows by 16-byte vector loads (and tiles by TMA on sm_90a): a tensor one
    # element past alignment had faulted with a misaligned address in the first five of these
    lengths = [300, 1000]
    t = SimpleNamespace(q=random_tokens(lengths, 16, 128, torch.bfloat16, "cuda", seed=1),
                        k=random_tokens(lengths, 2, 128, torch.bfloat16, "cuda", seed=2),
                        v=random_tokens(lengths, 2, 128, torch.bfloat16, "cuda", seed=3),
                        cu=cu_seqlens(lengths, "cuda"))
    t.ck, t.cu_c = infllmv2.compress_keys(t.k, t.cu)
    name = case.rsplit(".", 1)[1]
    with pytest.raises(infllmv2.Infllmv2ArgumentError, match=f"{name} must be 16-byte aligned"):
        MISALIGNED[case](t)
    torch.cuda.synchronize()  # a fault would surface here
