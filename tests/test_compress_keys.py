"""compress_keys (stage 0): the torch layer on CPU, the kernels on a GPU against the reference."""

import pytest
import torch

import infllmv2
from infllmv2 import reference
from infllmv2.ops import compress_keys_launch
from infllmv2.testing import assert_close_to_reference, cu_seqlens, random_mask, random_tokens

LENGTH_MIXES = [
    [1],
    [31],
    [32],
    [33, 63, 64, 65],
    [1, 63, 64, 65, 200, 257, 3, 1000],
    [4099],
]
# MiniCPM4's fine and coarse keys; windows that are several strides (48/16) and a pair whose
# common divisor is 1 (5/3), which the kernel sums key by key
GEOMETRIES = [(32, 16), (128, 64), (48, 16), (5, 3)]


# ---------------------------------------------------------------------------------- CPU tier


def test_cpu_runs_the_reference():
    k = random_tokens([40, 100], 2, 64, torch.float32)
    cu = cu_seqlens([40, 100])
    ck, cu_c = infllmv2.compress_keys(k, cu)
    ref, ref_cu = reference.compress_keys(k, cu)
    assert torch.equal(cu_c, ref_cu) and cu_c.tolist() == [0, 1, 6]
    assert torch.equal(ck, ref)


def test_cpu_phsa_runs_the_reference():
    k = random_tokens([300], 1, 64, torch.bfloat16)
    cu = cu_seqlens([300])
    mask = random_mask(300, 0.1)
    ck, _ = infllmv2.compress_keys(k, cu, 128, 64, punct_mask=mask, phsa_lambda=0.3)
    ref, _ = reference.compress_keys(k, cu, 128, 64, punct_mask=mask, phsa_lambda=0.3)
    assert torch.equal(ck, ref)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(k=a["k"].int()), "k must be a floating-point tensor"),
        (lambda a: a.update(k=a["k"][:, 0]), "k must have 3 dimensions"),
        (lambda a: a.update(cu_seqlens_k=a["cu_seqlens_k"].long()), "cu_seqlens_k must be int32"),
        (lambda a: a.update(cu_seqlens_k=cu_seqlens([40, 99])), "cu_seqlens_k ends at 139"),
        (lambda a: a.update(cu_seqlens_k=torch.tensor([0, 60, 50, 140], dtype=torch.int32)), "non-decreasing"),
        (lambda a: a.update(cu_seqlens_k=torch.tensor([1, 140], dtype=torch.int32)), "must start at 0"),
        (lambda a: a.update(cu_seqlens_k=[0, 140]), "cu_seqlens_k must be a torch.Tensor"),
        (lambda a: a.update(kernel_size=0), "kernel_size must be >= 1"),
        (lambda a: a.update(kernel_stride=2.0), "kernel_stride must be an int"),
        (lambda a: a.update(punct_mask=torch.zeros(140, dtype=torch.uint8)), "punct_mask must be a bool tensor"),
        (lambda a: a.update(punct_mask=torch.zeros(139, dtype=torch.bool)), "punct_mask must have shape"),
        (lambda a: a.update(punct_mask=torch.zeros(140, dtype=torch.bool), phsa_lambda=1.5), "phsa_lambda must be in"),
    ],
)
def test_bad_arguments_name_the_argument(mutate, message):
    args = dict(k=random_tokens([40, 100], 2, 64, torch.bfloat16), cu_seqlens_k=cu_seqlens([40, 100]))
    mutate(args)
    with pytest.raises(ValueError, match=message):
        infllmv2.compress_keys(**args)


def test_registered_as_custom_op_with_fake():
    assert hasattr(torch.ops.infllmv2, "compress_keys")
    from torch._subclasses.fake_tensor import FakeTensorMode

    k = random_tokens([100], 2, 64, torch.bfloat16)
    cu, cu_c = cu_seqlens([100]), cu_seqlens([5])
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = torch.ops.infllmv2.compress_keys(k, cu, cu_c, None, 0.5, 5, 5, 32, 16)
    assert out.shape == (5, 2, 64) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------- GPU tier


def _run_poisoned(k, cu, ks, st, mask, lam):
    """The kernel into a NaN-poisoned output, so that an unwritten row cannot pass."""
    ref32, ref_cu = reference.compress_keys(k.float(), cu, ks, st, mask, lam)
    out = torch.full(ref32.shape, float("nan"), dtype=k.dtype, device=k.device)
    n = [b - a for a, b in zip(ref_cu.tolist(), ref_cu.tolist()[1:])]
    compress_keys_launch(k, cu, ref_cu, mask, lam, out, max(n), ks, st)
    torch.cuda.synchronize()
    lowp, _ = reference.compress_keys(k, cu, ks, st, mask, lam)
    return out, lowp, ref32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads_k", [1, 2, 3])
@pytest.mark.parametrize("lengths", LENGTH_MIXES)
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("phsa", [False, True])
def test_kernel_matches_reference(dtype, head_dim, heads_k, lengths, geometry, phsa):
    ks, st = geometry
    k = random_tokens(lengths, heads_k, head_dim, dtype, "cuda", seed=len(lengths) * 7 + heads_k)
    cu = cu_seqlens(lengths, "cuda")
    mask = random_mask(k.shape[0], 0.05, "cuda", seed=3) if phsa else None
    out, lowp, ref32 = _run_poisoned(k, cu, ks, st, mask, 0.25)
    assert_close_to_reference(out, lowp, ref32, what=f"compress_keys {lengths}")


@pytest.mark.gpu
def test_public_function_on_cuda_matches_cpu():
    lengths = [1, 63, 64, 65, 300]
    k = random_tokens(lengths, 2, 128, torch.bfloat16, "cuda", seed=11)
    cu = cu_seqlens(lengths, "cuda")
    ck, cu_c = infllmv2.compress_keys(k, cu)
    ref, ref_cu = infllmv2.compress_keys(k.cpu(), cu.cpu())
    assert torch.equal(cu_c.cpu(), ref_cu)
    assert_close_to_reference(ck.cpu(), ref, reference.compress_keys(k.cpu().float(), cu.cpu())[0])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
@pytest.mark.parametrize("phsa", [False, True])
def test_every_arch_variant_on_this_gpu(arch, phsa, arch_override):
    """sm_80/sm_89 variants run here through their embedded PTX (JIT by the driver)."""
    if arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} not compiled into this build")
    major, minor = torch.cuda.get_device_capability()
    if arch == "sm_90a" and (major, minor) != (9, 0):
        pytest.skip("sm_90a code runs only on compute capability 9.0")
    arch_override(arch)
    assert infllmv2.selected_arch() == arch
    lengths = [1, 63, 64, 65, 257, 1000]
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            k = random_tokens(lengths, 2, head_dim, dtype, "cuda", seed=head_dim)
            cu = cu_seqlens(lengths, "cuda")
            mask = random_mask(k.shape[0], 0.05, "cuda") if phsa else None
            out, lowp, ref32 = _run_poisoned(k, cu, 32, 16, mask, 0.5)
            assert_close_to_reference(out, lowp, ref32, what=f"{arch} {dtype} d{head_dim}")


@pytest.mark.gpu
def test_cuda_bad_inputs():
    k = random_tokens([100], 2, 128, torch.bfloat16, "cuda")
    cu = cu_seqlens([100], "cuda")
    with pytest.raises(ValueError, match="k must be bfloat16 or float16 on CUDA, got torch.float32"):
        infllmv2.compress_keys(k.float(), cu)
    with pytest.raises(ValueError, match="k head_dim must be 64 or 128 on CUDA, got 96"):
        infllmv2.compress_keys(random_tokens([100], 2, 96, torch.bfloat16, "cuda"), cu)
    with pytest.raises(ValueError, match="k must be contiguous"):
        infllmv2.compress_keys(random_tokens([100], 4, 128, torch.bfloat16, "cuda")[:, ::2], cu)
    with pytest.raises(ValueError, match="cu_seqlens_k is on cpu but k is on cuda"):
        infllmv2.compress_keys(k, cu.cpu())
    with pytest.raises(ValueError, match="cu_seqlens_k ends at 99"):
        infllmv2.compress_keys(k, cu_seqlens([99], "cuda"))


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    lengths = [4096] * 4
    k = random_tokens(lengths, 2, 128, torch.bfloat16, "cuda")
    cu = cu_seqlens(lengths, "cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ck, _ = infllmv2.compress_keys(k, cu)
    s.synchronize()
    ref, _ = reference.compress_keys(k, cu)
    assert_close_to_reference(ck, ref, reference.compress_keys(k.float(), cu)[0])
