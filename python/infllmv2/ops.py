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
from .reference import _check_int, _check_punct_mask, _check_tensor3, _compressed_offsets, _offsets

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
        _check_punct_mask(punct_mask, k)
        if not punct_mask.is_contiguous():
            raise ValueError("punct_mask must be contiguous")
    phsa_lambda = float(phsa_lambda)
    if not (0.0 <= phsa_lambda <= 1.0):
        raise ValueError(f"phsa_lambda must be in [0, 1], got {phsa_lambda}")
    if k.is_cuda:
        _check_kernel_tensor(k, "k")
    counts, offs_c = _compressed_offsets(offs, kernel_size, kernel_stride)
    cu_seqlens_c = torch.tensor(offs_c, dtype=torch.int32).to(k.device, non_blocking=True)
    ck = _compress_keys_op(
        k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, offs_c[-1], max(counts), kernel_size, kernel_stride
    )
    return ck, cu_seqlens_c


# --------------------------------------------------------------------------------------------
# sparse_attn (stage 2): forward, backward, autograd
# --------------------------------------------------------------------------------------------

_KERNEL_BLOCK = 64
_KERNEL_MAX_TOPK = 128
_INT32_MAX = 2**31 - 1


def sort_topk_idx(topk_idx: torch.Tensor) -> torch.Tensor:
    """Rows ascending over their valid entries with -1 after them: the format the kernels need."""
    key = torch.where(topk_idx < 0, _INT32_MAX, topk_idx.to(torch.int32))
    key = key.sort(dim=-1).values
    return torch.where(key == _INT32_MAX, -1, key).contiguous()


def _scale_or_zero(softmax_scale):
    return 0.0 if softmax_scale is None else float(softmax_scale)


def sparse_attn_fwd_launch(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, out, lse):
    """Runs the forward kernel into ``out`` and ``lse`` (already allocated); topk_idx rows sorted."""
    with torch.cuda.device(q.device):
        status = _lib.lib().infllmv2_sparse_attn_fwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(topk_idx), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(out), _ptr(lse),
            cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0], max_seqlen_q, q.shape[1], k.shape[1], q.shape[2],
            topk_idx.shape[2], _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


def sparse_attn_bwd_workspace_floats(q) -> int:
    """fp32 elements of workspace the backward of a call with this q needs (at least one)."""
    return (max(_lib.lib().infllmv2_sparse_attn_bwd_workspace_size(q.shape[0], q.shape[1]), 4) + 3) // 4


def sparse_attn_bwd_launch(dout, q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, dq, dk, dv, workspace):
    """Runs the backward kernels into ``dq``, ``dk``, ``dv`` (already allocated) with an fp32 workspace."""
    with torch.cuda.device(q.device):
        status = _lib.lib().infllmv2_sparse_attn_bwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(dout), _ptr(lse), _ptr(topk_idx), _ptr(cu_seqlens_q),
            _ptr(cu_seqlens_k), _ptr(dq), _ptr(dk), _ptr(dv), _ptr(workspace), workspace.numel() * 4,
            cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1],
            q.shape[2], topk_idx.shape[2], _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


@torch.library.custom_op("infllmv2::sparse_attn_fwd", mutates_args=())
def _sparse_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        out, lse = reference.sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale or None)
        return out.clone(), lse.clone()
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    sparse_attn_fwd_launch(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, out, lse)
    return out, lse


@_sparse_attn_fwd_op.register_fake
def _(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("infllmv2::sparse_attn_bwd", mutates_args=())
def _sparse_attn_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        # torch.func.vjp differentiates the reference here, where the autograd tape is off
        def fwd(q_, k_, v_):
            return reference.sparse_attn_varlen(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale or None)[0]

        _, vjp = torch.func.vjp(fwd, q, k, v)
        return tuple(g.contiguous() for g in vjp(dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    workspace = torch.empty(sparse_attn_bwd_workspace_floats(q), dtype=torch.float32, device=q.device)
    sparse_attn_bwd_launch(dout, q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, dq, dk, dv, workspace)
    return dq, dk, dv


@_sparse_attn_bwd_op.register_fake
def _(dout, q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _sparse_attn_setup_context(ctx, inputs, output):
    q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k)
    ctx.max_seqlen_q = max_seqlen_q
    ctx.max_seqlen_k = max_seqlen_k
    ctx.softmax_scale = softmax_scale


def _sparse_attn_backward(ctx, dout, dlse):
    q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    # The LSE output is a by-product (as in FlashAttention): its gradient is not propagated.
    dq, dk, dv = torch.ops.infllmv2.sparse_attn_bwd(
        dout.contiguous(), q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q,
        ctx.max_seqlen_k, ctx.softmax_scale,
    )
    return dq, dk, dv, None, None, None, None, None, None


_sparse_attn_fwd_op.register_autograd(_sparse_attn_backward, setup_context=_sparse_attn_setup_context)


def _check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor3(t, name)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k.shape[2] != q.shape[2] or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must share (tokens, heads_k, head_dim={q.shape[2]})")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor of B+1 >= 2 offsets")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q describes {cu_seqlens_q.numel() - 1} sequences but cu_seqlens_k {cu_seqlens_k.numel() - 1}"
        )
    if q.is_cuda:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_kernel_tensor(t, name)
        if q.shape[1] // k.shape[1] > 64:
            raise ValueError(f"the group size heads/heads_k = {q.shape[1] // k.shape[1]} exceeds 64 on CUDA")


def _max_seqlen(cu, given, name):
    if given is not None:
        return _check_int(given, name, 0)
    # one host read of the offsets; pass max_seqlen_* to avoid it (torch.compile, CUDA graphs)
    return int((cu[1:] - cu[:-1]).max().item())


def sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q=None, max_seqlen_k=None,
                       softmax_scale=None, block_size=64, return_lse=False):
    """Stage 2: attention of each query over the keys of its group's selected blocks.

    ``q (total_q, Hq, D)``, ``k, v (total_k, Hk, D)``, ``topk_idx int (Hk, total_q, K)`` of
    per-sequence ``block_size``-token block indices (-1 unused, any order, repeats count once),
    bottom-right causal at token granularity. Returns ``out (total_q, Hq, D)`` (and ``lse fp32
    (Hq, total_q)`` with ``return_lse``); differentiable in q, k, v. CUDA runs the kernels
    (bf16/fp16, D 64/128, block 64, K <= 128, G <= 64; deterministic backward); CPU runs the
    reference. ``max_seqlen_q/k`` avoid a host read of the offsets when given.
    """
    _check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("topk_idx must be an int32 (or int64) tensor of shape (heads_k, total_q, K)")
    if topk_idx.dim() != 3 or topk_idx.shape[:2] != (k.shape[1], q.shape[0]):
        raise ValueError(
            f"topk_idx must have shape (heads_k={k.shape[1]}, total_q={q.shape[0]}, K), got {tuple(topk_idx.shape)}"
        )
    if topk_idx.device != q.device:
        raise ValueError(f"topk_idx is on {topk_idx.device} but q is on {q.device}")
    if q.is_cuda:
        if block_size != _KERNEL_BLOCK:
            raise ValueError(f"block_size must be {_KERNEL_BLOCK} on CUDA, got {block_size}")
        if not 1 <= topk_idx.shape[2] <= _KERNEL_MAX_TOPK:
            raise ValueError(f"topk_idx holds K={topk_idx.shape[2]} blocks per row; CUDA supports 1..{_KERNEL_MAX_TOPK}")
        max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k, "max_seqlen_k")
        out, lse = _sparse_attn_fwd_op(q, k, v, sort_topk_idx(topk_idx), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, _scale_or_zero(softmax_scale))
    else:
        out, lse = reference.sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale, block_size)
    return (out, lse) if return_lse else out
