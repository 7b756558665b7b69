"""The torch layer: argument checks, custom ops with fake implementations, dispatch.

CUDA tensors run the library's kernels on the current stream; CPU tensors run the PyTorch
reference (python/infllmv2/reference.py), so the same call works everywhere. Ops are
registered as torch custom ops (namespace ``infllmv2``) with fake implementations, so that
torch.compile traces them.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _lib, reference
from .reference import _check_int, _check_tensor3, _num_windows, _offsets

_KERNEL_DTYPES = {torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_FP16}
_KERNEL_HEAD_DIMS = (64, 128)


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _check_kernel_tensor(t: torch.Tensor, name: str) -> None:
    """What the CUDA kernels need beyond what the reference accepts."""
    if t.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float16 on CUDA, got {t.dtype}")
    if t.shape[-1] not in _KERNEL_HEAD_DIMS:
        raise ValueError(f"{name} head_dim must be 64 or 128 on CUDA, got {t.shape[-1]}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


# --------------------------------------------------------------------------------------------
# compress_keys (stage 0)
# --------------------------------------------------------------------------------------------


def compress_keys_launch(k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, out, max_nc, kernel_size, kernel_stride):
    """Runs the CUDA kernel into ``out`` (already allocated, ``(total_c, Hk, D)``)."""
    with torch.cuda.device(k.device):
        status = _lib.lib().infllmv2_compress_keys(
            _ptr(k), _ptr(cu_seqlens_k), _ptr(cu_seqlens_c),
            _ptr(punct_mask.view(torch.uint8)) if punct_mask is not None else None, float(phsa_lambda),
            _ptr(out), cu_seqlens_k.numel() - 1, k.shape[0], out.shape[0], max_nc, k.shape[1], k.shape[2],
            _KERNEL_DTYPES[k.dtype], kernel_size, kernel_stride, _stream(k.device),
        )
    _lib.check(status)


@torch.library.custom_op("infllmv2::compress_keys", mutates_args=())
def _compress_keys_op(
    k: torch.Tensor, cu_seqlens_k: torch.Tensor, cu_seqlens_c: torch.Tensor, punct_mask: Optional[torch.Tensor],
    phsa_lambda: float, total_c: int, max_nc: int, kernel_size: int, kernel_stride: int,
) -> torch.Tensor:
    if k.is_cuda:
        out = k.new_empty((total_c, k.shape[1], k.shape[2]))
        compress_keys_launch(k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, out, max_nc, kernel_size, kernel_stride)
        return out
    return reference.compress_keys(k, cu_seqlens_k, kernel_size, kernel_stride, punct_mask, phsa_lambda)[0]


@_compress_keys_op.register_fake
def _(k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, total_c, max_nc, kernel_size, kernel_stride):
    return k.new_empty((total_c, k.shape[1], k.shape[2]))


def compress_keys(k, cu_seqlens_k, kernel_size=32, kernel_stride=16, punct_mask=None, phsa_lambda=0.5):
    """Stage 0: mean-pooled compressed keys ("semantic kernels"), optionally PHSA-weighted.

    Per sequence of length ``L`` and KV head, ``ck[j] = mean(k[j*s : j*s + w])`` for
    ``j < n = (L - w) // s + 1`` (0 if ``L < w``), ``w = kernel_size``, ``s = kernel_stride``.
    With ``punct_mask`` (bool ``(total_k,)``): ``lam * mean(window) + (1 - lam) *
    mean(punctuation tokens of the window)``, the plain mean where a window has none.

    Args: ``k (total_k, Hk, D)`` bf16/fp16 on CUDA (D 64 or 128), any float dtype on CPU;
    ``cu_seqlens_k`` int32 ``(B+1)`` on k's device.
    Returns ``(ck (total_c, Hk, D) in k.dtype, cu_seqlens_c int32 (B+1))``.

    Reads ``cu_seqlens_k`` on the host once (the output size depends on it).
    """
    _check_tensor3(k, "k")
    _check_int(kernel_size, "kernel_size", 1)
    _check_int(kernel_stride, "kernel_stride", 1)
    if not isinstance(cu_seqlens_k, torch.Tensor):
        raise ValueError(f"cu_seqlens_k must be a torch.Tensor, got {type(cu_seqlens_k).__name__}")
    if cu_seqlens_k.device != k.device:
        raise ValueError(f"cu_seqlens_k is on {cu_seqlens_k.device} but k is on {k.device}")
    offs = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if len(offs) < 2:
        raise ValueError("cu_seqlens_k must describe at least one sequence (B+1 >= 2 entries)")
    if punct_mask is not None:
        if not isinstance(punct_mask, torch.Tensor) or punct_mask.dtype != torch.bool:
            raise ValueError("punct_mask must be a bool tensor of shape (total_k,)")
        if punct_mask.shape != (k.shape[0],):
            raise ValueError(f"punct_mask must have shape ({k.shape[0]},), got {tuple(punct_mask.shape)}")
        if punct_mask.device != k.device:
            raise ValueError(f"punct_mask is on {punct_mask.device} but k is on {k.device}")
        if not punct_mask.is_contiguous():
            raise ValueError("punct_mask must be contiguous")
    phsa_lambda = float(phsa_lambda)
    if not (0.0 <= phsa_lambda <= 1.0):
        raise ValueError(f"phsa_lambda must be in [0, 1], got {phsa_lambda}")
    if k.is_cuda:
        _check_kernel_tensor(k, "k")
    counts = [_num_windows(b - a, kernel_size, kernel_stride) for a, b in zip(offs, offs[1:])]
    offs_c = [0]
    for n in counts:
        offs_c.append(offs_c[-1] + n)
    cu_seqlens_c = torch.tensor(offs_c, dtype=torch.int32).to(k.device, non_blocking=True)
    ck = _compress_keys_op(
        k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, offs_c[-1], max(counts), kernel_size, kernel_stride
    )
    return ck, cu_seqlens_c
