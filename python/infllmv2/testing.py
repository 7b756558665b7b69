"""Workloads and error rules shared by the tests, the benchmarks and `python -m infllmv2 check`.

The oracle is ``infllmv2.reference``; this module only builds inputs and states how a kernel
result is judged against it: the kernel's error against an fp32 reference must be at most
``factor`` (2) times the error of the same PyTorch computation done in the input dtype.
"""

from __future__ import annotations

import torch


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 offsets (B+1) of sequences of the given lengths."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + int(n))
    return torch.tensor(offs, dtype=torch.int32, device=device)


def random_tokens(lengths, heads, head_dim, dtype, device="cpu", seed=0, scale=1.0) -> torch.Tensor:
    """(sum(lengths), heads, head_dim) normal random data (never zeros), reproducible by seed."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn((sum(lengths), heads, head_dim), generator=g) * scale
    return x.to(device=device, dtype=dtype)


def random_mask(n, p, device="cpu", seed=0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.rand(n, generator=g) < p).to(device)


def error_ratio(out: torch.Tensor, lowp: torch.Tensor, ref32: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref32|, max |lowp - ref32|) over all elements, in fp32."""
    ref = ref32.float()
    return (out.float() - ref).abs().max().item(), (lowp.float() - ref).abs().max().item()


def within_error_rule(out, lowp, ref32, factor=2.0) -> tuple[bool, float, float]:
    """The library's error rule: ``err(out) <= factor * err(lowp)`` against the fp32 oracle.

    ``lowp`` is the same computation in PyTorch in the input dtype. A floor of a few fp32
    ulps of the output's magnitude covers the case where the PyTorch result is exact.
    Returns ``(ok, err, lowp_err)``; NaN anywhere in ``out`` fails.
    """
    if out.numel() == 0:
        return True, 0.0, 0.0
    err, base = error_ratio(out, lowp, ref32)
    floor = 4 * torch.finfo(torch.float32).eps * max(ref32.float().abs().max().item(), 1.0)
    ok = not torch.isnan(out).any().item() and err <= factor * base + floor
    return ok, err, base


def assert_close_to_reference(out, lowp, ref32, factor=2.0, what="output"):
    assert out.shape == ref32.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref32.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or poisoned rows?)"
    ok, err, base = within_error_rule(out, lowp, ref32, factor)
    assert ok, f"{what}: error {err:.3g} > {factor} x PyTorch {out.dtype} error {base:.3g}"
