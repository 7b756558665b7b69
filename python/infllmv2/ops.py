"""The torch layer: argument checks, custom ops with fake implementations, dispatch.

CUDA tensors run the library's kernels on the current stream; CPU tensors run the PyTorch
reference (python/infllmv2/reference.py), so the same call works everywhere. Ops are
registered as torch custom ops (namespace ``infllmv2``) with fake implementations, so that
torch.compile traces them; plain eager calls of the ops without a gradient (decoding's) skip
the dispatcher, whose host time exceeds a decoding step's kernels (``_ForwardOnlyOp``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import math
from typing import Optional

import torch

from . import _lib, reference
from .reference import _check_int, _check_punct_mask, _check_tensor3, _compressed_offsets, _offsets

_KERNEL_DTYPES = {torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_FP16}
_KERNEL_HEAD_DIMS = (64, 128)


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None or t.numel() == 0 else t.data_ptr()


# torch's own raw-stream query (what its compiled kernels use): current_stream(device) builds a
# Stream object and resolves the device, about 3 us a call against 0.1, and a decoding step's
# host time is what an eager decoding loop waits for.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_SAME_DEVICE = contextlib.nullcontext()


def _stream(device: torch.device) -> int:
    if _raw_stream is not None and device.index is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _on(device: torch.device):
    """``torch.cuda.device(device)``, or nothing when it is current already (the usual case, and
    entering the device context costs about 2 us a call)."""
    return _SAME_DEVICE if device.index == torch.cuda.current_device() else torch.cuda.device(device)


# Tracing (torch.compile's, make_fx) and fake tensors need the op itself; a plain eager call does
# not. None: this torch does not say, so every call goes through the op.
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)


class _ForwardOnlyOp:
    """``torch.library.custom_op`` for an op with no gradient (the decoding path's ops), whose plain
    eager calls run the function itself. Through the dispatcher a call cost about 100 us of host
    time, more than a decoding step's kernels (session 34, ``bench_sparse_decode.py --eager``:
    ``attention_kvcache``'s step 203 -> 99 us of host time a call on an H100, against 54-104 us of
    kernels). So the op is called only where something must see it: torch.compile's or
    torch.jit's tracing, a dispatch mode (make_fx, FakeTensorMode, a user's mode), or tensor
    subclasses (fake tensors). Otherwise the function runs, and the version counters of the
    arguments it writes are bumped as the op's would be. Positional arguments only, as the op's
    callers here pass them."""

    def __init__(self, fn, name, mutates_args, check):
        self.fn = fn
        self.op = torch.library.custom_op(name, mutates_args=mutates_args)(_checked(fn, name, check))
        self.register_fake = self.op.register_fake
        params = list(inspect.signature(fn).parameters)
        self.mutated = tuple(params.index(n) for n in mutates_args)

    def __call__(self, *args):
        # is_compiling() first: torch.compile folds it to True and must not trace the rest
        if torch.compiler.is_compiling():
            return self.op(*args)
        for i in self.mutated:
            # The kernels write through the C library, where torch sees no in-place op (nor does the
            # custom op check): refuse what torch refuses of an in-place op, as the CPU path (the
            # reference, then copy_) does.
            if args[i] is not None and args[i].is_inference() and not torch.is_inference_mode_enabled():
                raise RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed. You can "
                                   "make a clone to get a normal tensor before doing inplace update.")
        if torch.jit.is_tracing() or _dispatch_modes is None or _dispatch_modes() \
                or any(isinstance(a, torch.Tensor) and type(a) is not torch.Tensor for a in args):
            return self.op(*args)
        out = self.fn(*args)
        for i in self.mutated:
            if args[i] is not None:
                torch.autograd.graph.increment_version(args[i])
        return out


def _forward_only_op(name, check, mutates_args=()):
    return lambda fn: _ForwardOnlyOp(fn, name, mutates_args, check)


def _kernel_op(name, check, mutates_args=()):
    """``torch.library.custom_op`` of ``fn`` checked as ``_checked`` does (the ops with a gradient)."""
    return lambda fn: torch.library.custom_op(name, mutates_args=mutates_args)(_checked(fn, name, check))


# An op's tensors by argument name: what the kernels read them as. The rest (q, k, v, the caches,
# dout, out) are data in q's (the first one's) dtype.
_OP_INT32_ARGS = frozenset(("cu_seqlens_q", "cu_seqlens_k", "cu_seqlens_c", "topk_idx", "cache_seqlens", "block_table"))
_OP_DTYPES = {"lse": torch.float32, "punct_mask": torch.bool, "punct_cache": torch.bool,
              **{name: torch.int32 for name in _OP_INT32_ARGS}}


def _check_op_tensors(op, names, args):
    """Every tensor of a CUDA op call on one device, contiguous, in the dtype its kernels read."""
    device = data = None
    for name, t in zip(names, args):
        if not isinstance(t, torch.Tensor):
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first} is on {device}")
        want = _OP_DTYPES.get(name)
        if want is None:
            if data is None:
                if t.dtype not in _KERNEL_DTYPES:
                    raise ValueError(f"{op}: {name} must be bfloat16 or float16 on CUDA, got {t.dtype}")
                data = (name, t.dtype)
            elif t.dtype != data[1]:
                raise ValueError(f"{op}: {name} dtype {t.dtype} differs from {data[0]} dtype {data[1]}")
        elif t.dtype != want:
            raise ValueError(f"{op}: {name} must be {want}, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def _checked(fn, name, check):
    """``fn`` as its custom op runs it: on CUDA, its arguments checked first. The public functions
    check and convert what they pass an op, but the op itself (``torch.ops.infllmv2.*``, called
    directly or from a compiled graph) hands data pointers to the C library, which sees neither
    dtypes nor strides nor the shapes it is not given. ``check`` takes the op's arguments and
    checks their shapes and values (the public functions' checks); the dtypes, devices and
    contiguity are checked here."""
    names = tuple(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def run(*args):
        if args[0].is_cuda:
            _check_op_tensors(name, names, args)
            check(*args)
        return fn(*args)

    return run


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


def _mask_ptr(punct_mask: Optional[torch.Tensor]):
    """The C ABI's uint8 punctuation mask (NULL for none) from a bool mask."""
    return None if punct_mask is None else _ptr(punct_mask.view(torch.uint8))


def compress_keys_launch(k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, out, max_nc, kernel_size, kernel_stride):
    """Runs the CUDA kernel into ``out`` (already allocated, ``(total_c, Hk, D)``)."""
    with _on(k.device):
        status = _lib.lib().infllmv2_compress_keys(
            _ptr(k), _ptr(cu_seqlens_k), _ptr(cu_seqlens_c), _mask_ptr(punct_mask), float(phsa_lambda), _ptr(out),
            cu_seqlens_k.numel() - 1, k.shape[0], out.shape[0], max_nc, k.shape[1], k.shape[2],
            _KERNEL_DTYPES[k.dtype], kernel_size, kernel_stride, _stream(k.device),
        )
    _lib.check(status)


def _check_compress_keys_call(k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, total_c, max_nc, kernel_size,
                              kernel_stride):
    _check_tensor3(k, "k")
    _check_kernel_tensor(k, "k")
    _check_offsets((("cu_seqlens_k", cu_seqlens_k), ("cu_seqlens_c", cu_seqlens_c)), k.device)
    _check_phsa_args(punct_mask, phsa_lambda, k)
    for value, name, least in ((total_c, "total_c", 0), (max_nc, "max_nc", 0), (kernel_size, "kernel_size", 1),
                               (kernel_stride, "kernel_stride", 1)):
        _check_int(value, name, least)


@_forward_only_op("infllmv2::compress_keys", _check_compress_keys_call)
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


def _check_phsa_args(punct_mask, phsa_lambda, k):
    """Checks compression's PHSA arguments; returns ``phsa_lambda`` as a float."""
    if punct_mask is not None:
        _check_punct_mask(punct_mask, k)
        if not punct_mask.is_contiguous():
            raise ValueError("punct_mask must be contiguous")
    phsa_lambda = float(phsa_lambda)
    if not (0.0 <= phsa_lambda <= 1.0):
        raise ValueError(f"phsa_lambda must be in [0, 1], got {phsa_lambda}")
    return phsa_lambda


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
    phsa_lambda = _check_phsa_args(punct_mask, phsa_lambda, k)
    if k.is_cuda:
        _check_kernel_tensor(k, "k")
    counts, offs_c = _compressed_offsets(offs, kernel_size, kernel_stride)
    cu_seqlens_c = torch.tensor(offs_c, dtype=torch.int32).to(k.device, non_blocking=True)
    ck = _compress_keys_op(
        k, cu_seqlens_k, cu_seqlens_c, punct_mask, phsa_lambda, offs_c[-1], max(counts), kernel_size, kernel_stride
    )
    return ck, cu_seqlens_c


def compress_keys_kvcache_launch(k_cache, cache_seqlens, block_table, ck_cache, new_keys, kernel_size, kernel_stride,
                                 punct_cache=None, phsa_lambda=0.5):
    """Runs the kernel: cache_seqlens and block_table int32 (or None), checked."""
    pages_per_seq = 0 if block_table is None else block_table.shape[1]
    with _on(k_cache.device):
        status = _lib.lib().infllmv2_compress_keys_kvcache(
            _ptr(k_cache), _ptr(block_table), _ptr(cache_seqlens), _mask_ptr(punct_cache), float(phsa_lambda),
            _ptr(ck_cache), cache_seqlens.numel(), k_cache.shape[0], k_cache.shape[1], pages_per_seq, ck_cache.shape[1],
            new_keys, k_cache.shape[2], k_cache.shape[3], _KERNEL_DTYPES[k_cache.dtype], kernel_size, kernel_stride,
            _stream(k_cache.device))
    _lib.check(status)


def _check_compress_keys_kvcache(k_cache, cache_seqlens, block_table, ck_cache, new_keys, kernel_size, kernel_stride,
                                 punct_cache, phsa_lambda):
    """compress_keys_kvcache's arguments (the kernels' needs on CUDA); returns cache_seqlens and
    block_table as int32, and phsa_lambda as a float."""
    _check_cache_tensor(k_cache, "k_cache", k_cache, "k_cache")
    batch = ck_cache.shape[0] if isinstance(ck_cache, torch.Tensor) and ck_cache.dim() == 4 else None
    if batch is None or ck_cache.shape[2:] != k_cache.shape[2:] or ck_cache.dtype != k_cache.dtype \
            or ck_cache.device != k_cache.device:
        raise ValueError(f"ck_cache must be a tensor of shape (batch, capacity_c, Hk={k_cache.shape[2]}, "
                         f"D={k_cache.shape[3]}) with k_cache's dtype and device ({k_cache.dtype}, {k_cache.device}), got "
                         + (f"{ck_cache.dtype} {tuple(ck_cache.shape)} on {ck_cache.device}"
                            if isinstance(ck_cache, torch.Tensor) else type(ck_cache).__name__))
    _check_int(new_keys, "new_keys", 0)
    _check_int(kernel_size, "kernel_size", 1)
    _check_int(kernel_stride, "kernel_stride", 1)
    cache_seqlens = _index_vector(cache_seqlens, "cache_seqlens", batch, k_cache.device)
    block_table = _check_block_table(block_table, k_cache, batch)
    _check_compressed_rows(ck_cache, "ck_cache", _cache_capacity(k_cache, block_table), kernel_size, kernel_stride)
    if not ck_cache.is_contiguous():
        raise ValueError("ck_cache must be contiguous (it is written in place)")
    if punct_cache is not None:
        phsa_lambda = _check_punct_cache(punct_cache, k_cache, phsa_lambda)
    if k_cache.is_cuda:
        _check_kernel_tensor(k_cache, "k_cache")
        _check_kernel_pages(block_table, k_cache)
    return cache_seqlens, block_table, phsa_lambda


@_forward_only_op("infllmv2::compress_keys_kvcache", _check_compress_keys_kvcache, mutates_args=("ck_cache",))
def _compress_keys_kvcache_op(
    k_cache: torch.Tensor, cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor], ck_cache: torch.Tensor,
    new_keys: int, kernel_size: int, kernel_stride: int, punct_cache: Optional[torch.Tensor], phsa_lambda: float,
) -> None:
    compress_keys_kvcache_launch(k_cache, cache_seqlens, block_table, ck_cache, new_keys, kernel_size, kernel_stride,
                                 punct_cache, phsa_lambda)


@_compress_keys_kvcache_op.register_fake
def _(k_cache, cache_seqlens, block_table, ck_cache, new_keys, kernel_size, kernel_stride, punct_cache, phsa_lambda):
    return None


def compressed_capacity(capacity, kernel_size=32, kernel_stride=16) -> int:
    """Rows a sequence's compressed cache needs: the compressed keys of ``capacity`` keys (at least 1)."""
    return max(reference._num_windows(capacity, kernel_size, kernel_stride), 1)


def _check_compressed_rows(cache, name, capacity, kernel_size, kernel_stride):
    """A compressed cache holds the compressed keys of a full KV cache of ``capacity`` keys."""
    need = compressed_capacity(capacity, kernel_size, kernel_stride)
    if cache.shape[1] < need:
        raise ValueError(f"{name} holds {cache.shape[1]} rows a sequence; a full cache of {capacity} keys has {need} "
                         f"compressed keys (window {kernel_size}, stride {kernel_stride}): compressed_capacity() "
                         f"gives the rows")


def _check_punct_cache(punct_cache, k_cache, phsa_lambda):
    """A bool punctuation cache laid out as k_cache's keys, as the kernels read it; returns
    ``phsa_lambda`` as a float."""
    reference._check_punct_cache(punct_cache, k_cache)
    if not punct_cache.is_contiguous():
        raise ValueError("punct_cache must be contiguous")
    return _check_phsa_args(None, phsa_lambda, k_cache)


def compress_keys_kvcache(k_cache, cache_seqlens, ck_cache, new_keys, block_table=None, kernel_size=32,
                          kernel_stride=16, punct_cache=None, phsa_lambda=0.5):
    """Stage 0 kept up to date over a KV cache: writes into ``ck_cache`` the compressed keys that
    each sequence's last ``new_keys`` keys completed, and returns it.

    ``k_cache (num_pages, page_size, Hk, D)`` with ``block_table`` as ``sparse_decode_kvcache``
    reads it (None: a padded cache); ``cache_seqlens`` the lengths after the new keys;
    ``ck_cache (batch, capacity_c, Hk, D)`` in k_cache's dtype, ``capacity_c`` at least
    ``compressed_capacity(capacity, kernel_size, kernel_stride)``. Entry ``j`` of sequence ``b``
    is ``mean(key j*s .. j*s + w - 1)``; the call writes ``j`` in ``[n(L - new_keys), n(L))`` and
    leaves the others (``n`` the count of ``compress_keys``; ``new_keys`` an upper bound: a decoding
    step passes the tokens it appended, a prefill into an empty cache its length). For 32/16 and
    128/64 the entries are bitwise ``compress_keys``' on the same keys packed. In place, no host
    synchronisation (CUDA); CPU runs the reference. ``punct_cache`` (bool ``(num_pages,
    page_size)``, each key's punctuation flag laid out as ``k_cache``): PHSA with ``phsa_lambda``,
    bitwise ``compress_keys``' PHSA entries (any window and stride).
    """
    cache_seqlens, block_table, phsa_lambda = _check_compress_keys_kvcache(
        k_cache, cache_seqlens, block_table, ck_cache, new_keys, kernel_size, kernel_stride, punct_cache, phsa_lambda)
    if not k_cache.is_cuda:
        ck_cache.copy_(reference.compress_keys_kvcache(k_cache, cache_seqlens, ck_cache, new_keys, block_table,
                                                       kernel_size, kernel_stride, punct_cache, phsa_lambda))
        return ck_cache
    _compress_keys_kvcache_op(k_cache, cache_seqlens, block_table, ck_cache, new_keys, kernel_size, kernel_stride,
                              punct_cache, float(phsa_lambda))
    return ck_cache



def _lengths(cu):
    return cu[1:] - cu[:-1]


def _equal_cu_seqlens(batch, n, device):
    """int32 offsets (batch + 1) of batch sequences of n tokens each (any n >= 0)."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * n


def _offsets_of(lengths):
    """int32 offsets (B+1) of per-sequence lengths, computed where they are (no host read)."""
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)


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
    with _on(q.device):
        status = _lib.lib().infllmv2_sparse_attn_fwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(topk_idx), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(out), _ptr(lse),
            cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0], max_seqlen_q, q.shape[1], k.shape[1], q.shape[2],
            topk_idx.shape[2], _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


def _floats(nbytes) -> int:
    """fp32 elements holding nbytes of workspace (at least one)."""
    return (max(nbytes, 4) + 3) // 4


def sparse_attn_bwd_workspace_floats(q, k, topk_idx, cu_seqlens_k) -> int:
    """fp32 elements of workspace the backward of a call with these tensors needs (at least one)."""
    return _floats(_lib.lib().infllmv2_sparse_attn_bwd_workspace_size(
        q.shape[0], k.shape[0], cu_seqlens_k.shape[0] - 1, q.shape[1], k.shape[1], topk_idx.shape[2]))


def dense_attn_bwd_workspace_floats(q) -> int:
    """fp32 elements of workspace the dense backward of a call with this q needs (at least one)."""
    return _floats(_lib.lib().infllmv2_dense_attn_bwd_workspace_size(q.shape[0], q.shape[1]))


def sparse_attn_bwd_launch(dout, q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, dq, dk, dv, workspace):
    """Runs the backward kernels into ``dq``, ``dk``, ``dv`` (already allocated) with an fp32 workspace."""
    with _on(q.device):
        status = _lib.lib().infllmv2_sparse_attn_bwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(dout), _ptr(lse), _ptr(topk_idx), _ptr(cu_seqlens_q),
            _ptr(cu_seqlens_k), _ptr(dq), _ptr(dk), _ptr(dv), _ptr(workspace), workspace.numel() * 4,
            cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1],
            q.shape[2], topk_idx.shape[2], _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


def _fwd_outputs(q):
    """Empty out (like q) and fp32 lse (Hq, total_q) of a stage-2 forward."""
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _reference_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale):
    """A stage-2 forward's custom op on CPU tensors: the reference (copies: an op's outputs may not alias)."""
    out, lse = reference.sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale or None)
    return out.clone(), lse.clone()


def _check_sparse_attn_call(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    _check_sparse_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, _KERNEL_BLOCK)
    _check_int(max_seqlen_q, "max_seqlen_q", 0)
    _check_int(max_seqlen_k, "max_seqlen_k", 0)


def _check_grad_args(q, dout, out, lse):
    """A backward's dout and out like q, lse (Hq, total_q)."""
    for name, t in (("dout", dout), ("out", out)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse must have shape (Hq, total_q) = {(q.shape[1], q.shape[0])}, got {tuple(lse.shape)}")


@_kernel_op("infllmv2::sparse_attn_fwd", _check_sparse_attn_call)
def _sparse_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        return _reference_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale)
    out, lse = _fwd_outputs(q)
    sparse_attn_fwd_launch(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, out, lse)
    return out, lse


@_sparse_attn_fwd_op.register_fake
def _(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale):
    return _fwd_outputs(q)


def _check_sparse_attn_bwd_call(dout, q, k, v, out, lse, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, softmax_scale):
    _check_sparse_attn_call(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale)
    _check_grad_args(q, dout, out, lse)


@_kernel_op("infllmv2::sparse_attn_bwd", _check_sparse_attn_bwd_call)
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
    workspace = torch.empty(sparse_attn_bwd_workspace_floats(q, k, topk_idx, cu_seqlens_k), dtype=torch.float32,
                            device=q.device)
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


def _check_offsets(named, device):
    """Each (name, cu_seqlens) is a 1-D int32 tensor of B+1 >= 2 offsets on ``device``, all of one B."""
    first_name, first = named[0]
    for name, cu in named:
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"{name} must be a 1-D int32 tensor of B+1 >= 2 offsets")
        if cu.device != device:
            raise ValueError(f"{name} is on {cu.device} but q is on {device}")
        if cu.is_cuda and not cu.is_contiguous():  # the kernels read it through its data pointer
            raise ValueError(f"{name} must be contiguous")
        if cu.numel() != first.numel():
            raise ValueError(f"{first_name} describes {first.numel() - 1} sequences but {name} {cu.numel() - 1}")


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
    _check_offsets((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)), q.device)
    if q.is_cuda:
        _check_kernel_attention(q, (("k", k), ("v", v)), k.shape[1])


def _check_kernel_attention(q, named_kv, heads_k):
    """What the attention kernels need of q and the named keys/values beyond what the reference accepts."""
    for name, t in (("q", q), *named_kv):
        _check_kernel_tensor(t, name)
    if q.shape[1] // heads_k > 64:
        raise ValueError(f"the group size heads/heads_k = {q.shape[1] // heads_k} exceeds 64 on CUDA")


def _max_seqlen(cu, given, name, total=None):
    """``given`` (checked), or the longest sequence of ``cu``: one host read of the offsets (pass
    max_seqlen_* to avoid it: torch.compile, CUDA graphs). With ``total`` (the tokens ``cu``
    spans), the offsets read are also checked, for callers whose kernels then trust them."""
    if given is not None:
        return _check_int(given, name, 0)
    if total is not None:
        offs = _offsets(cu, name.replace("max_seqlen", "cu_seqlens"), total)
        return max(b - a for a, b in zip(offs, offs[1:]))
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
    return _sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, softmax_scale,
                               block_size, return_lse, rows_sorted=False)


def _sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, softmax_scale,
                        block_size, return_lse, rows_sorted):
    """sparse_attn_varlen; rows_sorted for selections select_blocks wrote (int32, contiguous, rows
    ascending, -1 last), which skip the sort: at 32K x 8 with K = 96 it was a 2.9 ms radix sort and two
    where's per call (H100), and three (Hk, total_q, K) temporaries."""
    _check_sparse_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, block_size)
    if q.is_cuda:
        max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k, "max_seqlen_k")
        rows = topk_idx if rows_sorted else sort_topk_idx(topk_idx)
        out, lse = _sparse_attn_fwd_op(q, k, v, rows, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, _scale_or_zero(softmax_scale))
    else:
        out, lse = reference.sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale, block_size)
    return (out, lse) if return_lse else out


def _check_sparse_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, block_size):
    """The arguments stage 2 (sparse_attn_varlen, sparse_decode) takes, checked."""
    _check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _check_selection(topk_idx, q, k.shape[1], block_size)


def _check_selection(topk_idx, q, heads_k, block_size):
    """A stage-2 selection (heads_k, total_q, K) for q, and on CUDA what the kernels take of it."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("topk_idx must be an int32 (or int64) tensor of shape (heads_k, total_q, K)")
    if topk_idx.dim() != 3 or topk_idx.shape[:2] != (heads_k, q.shape[0]):
        raise ValueError(
            f"topk_idx must have shape (heads_k={heads_k}, total_q={q.shape[0]}, K), got {tuple(topk_idx.shape)}"
        )
    if topk_idx.device != q.device:
        raise ValueError(f"topk_idx is on {topk_idx.device} but q is on {q.device}")
    if not q.is_cuda:
        return
    if block_size != _KERNEL_BLOCK:
        raise ValueError(f"block_size must be {_KERNEL_BLOCK} on CUDA, got {block_size}")
    if not 1 <= topk_idx.shape[2] <= _KERNEL_MAX_TOPK:
        raise ValueError(f"topk_idx holds K={topk_idx.shape[2]} blocks per row; CUDA supports 1..{_KERNEL_MAX_TOPK}")


# --------------------------------------------------------------------------------------------
# sparse_decode: stage 2's forward split over the selected blocks (decoding)
# --------------------------------------------------------------------------------------------

_MAX_DECODE_SPLITS = 64


def _check_num_splits(num_splits, most=_MAX_DECODE_SPLITS):
    _check_int(num_splits, "num_splits", 0)
    if num_splits > most:
        raise ValueError(f"num_splits must be at most {most} (0 lets the library pick), got {num_splits}")


def _splits_or_raise(fn, splits):
    """A split query's answer; its 0 (no device to ask) raised with the library's message."""
    if splits == 0:
        raise _lib.Infllmv2Error(_lib.ERR_CUDA, f"{fn}: " + _lib.lib().infllmv2_last_error().decode())
    return splits


def sparse_decode_splits(q, k, topk_idx, cu_seqlens_q, max_seqlen_q, num_splits=0) -> int:
    """The splits sparse_decode runs on q's device (``num_splits`` 0: its own choice)."""
    return _decode_splits(q, k.shape[1], topk_idx, cu_seqlens_q, max_seqlen_q, num_splits)


def _decode_splits(q, heads_k, topk_idx, cu_seqlens_q, max_seqlen_q, num_splits):
    with _on(q.device):
        splits = _lib.lib().infllmv2_sparse_decode_splits(cu_seqlens_q.numel() - 1, max_seqlen_q, q.shape[1], heads_k,
                                                          topk_idx.shape[2], num_splits)
    return _splits_or_raise("infllmv2_sparse_decode_splits", splits)


def sparse_decode_workspace_floats(q, splits) -> int:
    """fp32 elements of workspace sparse_decode needs with this q and splits (0 for none)."""
    nbytes = _lib.lib().infllmv2_sparse_decode_workspace_size(q.shape[0], q.shape[1], q.shape[2], splits)
    return _floats(nbytes) if nbytes else 0


def sparse_decode_launch(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, splits, out, lse,
                         workspace):
    """Runs the split forward into ``out`` and ``lse`` (already allocated); topk_idx rows sorted."""
    with _on(q.device):
        status = _lib.lib().infllmv2_sparse_decode(
            _ptr(q), _ptr(k), _ptr(v), _ptr(topk_idx), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(out), _ptr(lse),
            _ptr(workspace), 0 if workspace is None else workspace.numel() * 4, cu_seqlens_q.numel() - 1, q.shape[0],
            k.shape[0], max_seqlen_q, q.shape[1], k.shape[1], q.shape[2], topk_idx.shape[2], splits,
            _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


def _check_sparse_decode_call(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, num_splits):
    _check_sparse_attn_call(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, 0, softmax_scale)
    _check_num_splits(num_splits)


@_forward_only_op("infllmv2::sparse_decode", _check_sparse_decode_call)
def _sparse_decode_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, softmax_scale: float, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        return _reference_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale)
    out, lse = _fwd_outputs(q)
    splits = sparse_decode_splits(q, k, topk_idx, cu_seqlens_q, max_seqlen_q, num_splits)
    n = sparse_decode_workspace_floats(q, splits)
    workspace = torch.empty(n, dtype=torch.float32, device=q.device) if n else None
    sparse_decode_launch(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, splits, out, lse,
                         workspace)
    return out, lse


@_sparse_decode_op.register_fake
def _(q, k, v, topk_idx, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, num_splits):
    return _fwd_outputs(q)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _stage2(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, softmax_scale, block_size,
            return_lse, rows_sorted):
    """Stage 2 as the whole attention runs it: on CUDA, a call that needs no gradient (inference,
    decoding) takes sparse_decode, which splits each query tile's blocks where the tiles leave the
    GPU idle and is the plain forward elsewhere; any other call takes sparse_attn_varlen."""
    if isinstance(q, torch.Tensor) and q.is_cuda and not _needs_grad(q, k, v):
        return _sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, softmax_scale, 0, block_size,
                              return_lse, rows_sorted)
    return _sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, softmax_scale,
                               block_size, return_lse, rows_sorted)


def sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q=None, softmax_scale=None, num_splits=0,
                  block_size=64, return_lse=False):
    """``sparse_attn_varlen``'s forward for inference calls with few queries a sequence (decoding).

    Same arguments and result; each query tile's selected blocks are split among ``num_splits``
    thread blocks (0: the library picks, so that one long sequence fills the GPU, and runs the
    plain forward, bitwise, where the query tiles already fill it), whose partial results a
    second kernel merges. Forward only: raises if a gradient would be needed (use
    ``sparse_attn_varlen``). No host synchronisation when ``max_seqlen_q`` is given.
    """
    return _sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, softmax_scale, num_splits,
                          block_size, return_lse, rows_sorted=False)


def _sparse_decode(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, softmax_scale, num_splits, block_size,
                   return_lse, rows_sorted):
    """sparse_decode; rows_sorted as for _sparse_attn_varlen."""
    _check_sparse_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, block_size)
    if _needs_grad(q, k, v):
        raise ValueError("sparse_decode is forward only, but q, k or v requires grad: use sparse_attn_varlen, or call "
                         "it under torch.no_grad()")
    _check_num_splits(num_splits)
    if q.is_cuda:
        max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        rows = topk_idx if rows_sorted else sort_topk_idx(topk_idx)
        out, lse = _sparse_decode_op(q, k, v, rows, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     _scale_or_zero(softmax_scale), num_splits)
    else:
        out, lse = reference.sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale, block_size)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# sparse_decode_kvcache: sparse_decode with the keys and values in a padded or paged KV cache
# --------------------------------------------------------------------------------------------


def sparse_decode_kvcache_launch(q, k_cache, v_cache, topk_idx, cu_seqlens_q, cache_seqlens, block_table, max_seqlen_q,
                                 softmax_scale, splits, out, lse, workspace):
    """Runs the split forward over the cache into ``out`` and ``lse`` (already allocated);
    topk_idx rows sorted, cache_seqlens and block_table int32."""
    pages_per_seq = 0 if block_table is None else block_table.shape[1]
    with _on(q.device):
        status = _lib.lib().infllmv2_sparse_decode_kvcache(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_table), _ptr(cache_seqlens), _ptr(topk_idx),
            _ptr(cu_seqlens_q), _ptr(out), _ptr(lse), _ptr(workspace), 0 if workspace is None else workspace.numel() * 4,
            cu_seqlens_q.numel() - 1, q.shape[0], max_seqlen_q, k_cache.shape[0], k_cache.shape[1], pages_per_seq,
            q.shape[1], k_cache.shape[2], q.shape[2], topk_idx.shape[2], splits, _KERNEL_DTYPES[q.dtype], softmax_scale,
            _stream(q.device),
        )
    _lib.check(status)


def sparse_decode_kvcache_workspace_floats(q, splits) -> int:
    """fp32 elements of workspace sparse_decode_kvcache needs with this q and splits."""
    return _floats(_lib.lib().infllmv2_sparse_decode_kvcache_workspace_size(q.shape[0], q.shape[1], q.shape[2], splits))


def _check_sparse_decode_kvcache_call(q, k_cache, v_cache, topk_idx, cu_seqlens_q, cache_seqlens, block_table,
                                      max_seqlen_q, softmax_scale, num_splits):
    _check_decode_kvcache("sparse_decode_kvcache", q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table)
    _check_selection(topk_idx, q, k_cache.shape[2], _KERNEL_BLOCK)
    _check_int(max_seqlen_q, "max_seqlen_q", 0)
    _check_num_splits(num_splits)


@_forward_only_op("infllmv2::sparse_decode_kvcache", _check_sparse_decode_kvcache_call)
def _sparse_decode_kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, topk_idx: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor], max_seqlen_q: int, softmax_scale: float,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        out, lse = reference.sparse_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, topk_idx,
                                                   block_table, softmax_scale or None)
        return out.clone(), lse.clone()
    out, lse = _fwd_outputs(q)
    splits = _decode_splits(q, k_cache.shape[2], topk_idx, cu_seqlens_q, max_seqlen_q, num_splits)
    workspace = torch.empty(sparse_decode_kvcache_workspace_floats(q, splits), dtype=torch.float32, device=q.device)
    sparse_decode_kvcache_launch(q, k_cache, v_cache, topk_idx, cu_seqlens_q, cache_seqlens, block_table, max_seqlen_q,
                                 softmax_scale, splits, out, lse, workspace)
    return out, lse


@_sparse_decode_kvcache_op.register_fake
def _(q, k_cache, v_cache, topk_idx, cu_seqlens_q, cache_seqlens, block_table, max_seqlen_q, softmax_scale, num_splits):
    return _fwd_outputs(q)


def _index_vector(t, name, length, device):
    """An integer tensor of ``length`` entries on ``device``, as int32 (a device op: no host read)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 (or int64) tensor of {length} entries, got "
                         + (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if t.numel() != length:
        raise ValueError(f"{name} must have {length} entries (one a sequence), got {t.numel()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    return t.to(torch.int32).contiguous()


def _check_cache_tensor(t, name, like, like_name):
    """A 4-D cache tensor with ``like``'s dtype and device."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        raise ValueError(f"{name} must be a tensor of shape (num_pages, page_size, Hk, D), got "
                         + (f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name} must match {like_name}'s dtype and device ({like.dtype}, {like.device}), got {t.dtype}, "
                         f"{t.device}")


def _check_kv_cache(q, k_cache, v_cache):
    """k_cache and v_cache of one shape (num_pages, page_size, Hk, D) in q's dtype and device, D q's,
    Hk dividing q's heads."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_cache_tensor(t, name, q, "q")
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k_cache and v_cache must both have shape (num_pages, page_size, Hk, D={q.shape[2]}), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of the cache's heads_k ({k_cache.shape[2]})")


def _check_block_table(block_table, k_cache, batch):
    """The block table as int32 (None for a padded cache, which needs a page a sequence)."""
    if block_table is None:
        if k_cache.shape[0] < batch:
            raise ValueError(f"a padded cache (block_table None) needs a page a sequence: k_cache has "
                             f"{k_cache.shape[0]} for a batch of {batch}")
        return None
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in (torch.int32, torch.int64) \
            or block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be an int32 tensor of shape (batch={batch}, pages_per_seq >= 1), got "
                         + (f"{block_table.dtype} {tuple(block_table.shape)}" if isinstance(block_table, torch.Tensor)
                            else type(block_table).__name__))
    if block_table.device != k_cache.device:
        raise ValueError(f"block_table is on {block_table.device} but the cache is on {k_cache.device}")
    return block_table.to(torch.int32).contiguous()


def _check_kernel_pages(block_table, k_cache):
    if block_table is not None and block_table.shape[1] > 1 and k_cache.shape[1] % _KERNEL_BLOCK:
        raise ValueError(f"page_size (k_cache.shape[1]) must be a multiple of {_KERNEL_BLOCK} on CUDA when a "
                         f"sequence has several pages, got {k_cache.shape[1]}")


def _cache_capacity(k_cache, block_table) -> int:
    """Keys a sequence of the cache can hold."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def _check_decode_kvcache(op, q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table):
    """The checks both split ops over a KV cache make of q, the cache and its layout (the kernels'
    own on CUDA); returns cache_seqlens and block_table as int32."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor of shape (total_q, Hq, D)")
    _check_kv_cache(q, k_cache, v_cache)
    _check_offsets((("cu_seqlens_q", cu_seqlens_q),), q.device)
    batch = cu_seqlens_q.numel() - 1
    cache_seqlens = _index_vector(cache_seqlens, "cache_seqlens", batch, q.device)
    block_table = _check_block_table(block_table, k_cache, batch)
    if _needs_grad(q, k_cache, v_cache):
        raise ValueError(f"{op} is forward only, but q or the cache requires grad: call it under torch.no_grad()")
    if q.is_cuda:
        _check_kernel_attention(q, (("k_cache", k_cache), ("v_cache", v_cache)), k_cache.shape[2])
        _check_kernel_pages(block_table, k_cache)
    return cache_seqlens, block_table


def sparse_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, topk_idx, block_table=None,
                          max_seqlen_q=None, softmax_scale=None, num_splits=0, block_size=64, return_lse=False):
    """``sparse_decode`` with the keys and values in a KV cache, padded or paged.

    ``k_cache, v_cache (num_pages, page_size, Hk, D)``: sequence ``b`` has ``cache_seqlens[b]``
    keys, its key ``j`` at row ``j % page_size`` of page ``block_table[b, j // page_size]``
    (``block_table`` int ``(batch, pages_per_seq)``; on CUDA ``page_size`` a multiple of 64 when
    a sequence has several pages), or of page ``b`` when ``block_table`` is None (a padded cache,
    ``page_size`` its capacity). The new tokens' keys are in the cache already: the queries
    ``q (total_q, Hq, D)`` (packed by ``cu_seqlens_q``) are each sequence's last tokens, causal
    bottom-right as in ``sparse_attn_varlen``, whose ``topk_idx`` this takes. Returns ``out``
    (and ``lse`` with ``return_lse``). On CUDA the lengths and the table are read on the device
    only (no host synchronisation when ``max_seqlen_q`` is given; lengths past a sequence's
    capacity are clamped to it); on CPU, the reference.
    """
    cache_seqlens, block_table = _check_decode_kvcache("sparse_decode_kvcache", q, k_cache, v_cache, cache_seqlens,
                                                       cu_seqlens_q, block_table)
    _check_selection(topk_idx, q, k_cache.shape[2], block_size)
    _check_num_splits(num_splits)
    if q.is_cuda:
        max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        out, lse = _sparse_decode_kvcache_op(q, k_cache, v_cache, sort_topk_idx(topk_idx), cu_seqlens_q, cache_seqlens,
                                             block_table, max_seqlen_q, _scale_or_zero(softmax_scale), num_splits)
    else:
        out, lse = reference.sparse_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, topk_idx,
                                                   block_table, softmax_scale, block_size)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# dense_decode_kvcache: dense causal attention of few queries over a KV cache, split-KV
# --------------------------------------------------------------------------------------------

_MAX_DENSE_DECODE_SPLITS = 128


def dense_decode_kvcache_splits(q, heads_k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, num_splits):
    with _on(q.device):
        splits = _lib.lib().infllmv2_dense_decode_kvcache_splits(cu_seqlens_q.numel() - 1, max_seqlen_q, q.shape[1],
                                                                 heads_k, max_seqlen_k, num_splits)
    return _splits_or_raise("infllmv2_dense_decode_kvcache_splits", splits)


def dense_decode_kvcache_workspace_floats(q, splits) -> int:
    """fp32 elements of workspace dense_decode_kvcache needs with this q and splits."""
    return _floats(_lib.lib().infllmv2_dense_decode_kvcache_workspace_size(q.shape[0], q.shape[1], q.shape[2], splits))


def dense_decode_kvcache_launch(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table, max_seqlen_q,
                                softmax_scale, splits, out, lse, workspace):
    """Runs the split kernel over the cache into ``out`` and ``lse`` (already allocated);
    cache_seqlens and block_table int32."""
    pages_per_seq = 0 if block_table is None else block_table.shape[1]
    with _on(q.device):
        status = _lib.lib().infllmv2_dense_decode_kvcache(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_table), _ptr(cache_seqlens), _ptr(cu_seqlens_q),
            _ptr(out), _ptr(lse), _ptr(workspace), 0 if workspace is None else workspace.numel() * 4,
            cu_seqlens_q.numel() - 1, q.shape[0], max_seqlen_q, k_cache.shape[0], k_cache.shape[1], pages_per_seq,
            q.shape[1], k_cache.shape[2], q.shape[2], splits, _KERNEL_DTYPES[q.dtype], softmax_scale,
            _stream(q.device),
        )
    _lib.check(status)


def _check_dense_decode_kvcache_call(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table, max_seqlen_q,
                                     max_seqlen_k, softmax_scale, num_splits):
    _check_decode_kvcache("dense_decode_kvcache", q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table)
    _check_int(max_seqlen_q, "max_seqlen_q", 0)
    _check_int(max_seqlen_k, "max_seqlen_k", 0)
    _check_num_splits(num_splits, _MAX_DENSE_DECODE_SPLITS)


@_forward_only_op("infllmv2::dense_decode_kvcache", _check_dense_decode_kvcache_call)
def _dense_decode_kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor, block_table: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
    softmax_scale: float, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        out, lse = reference.dense_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                                                  softmax_scale or None)
        return out.clone(), lse.clone()
    out, lse = _fwd_outputs(q)
    splits = dense_decode_kvcache_splits(q, k_cache.shape[2], cu_seqlens_q, max_seqlen_q, max_seqlen_k, num_splits)
    workspace = torch.empty(dense_decode_kvcache_workspace_floats(q, splits), dtype=torch.float32, device=q.device)
    dense_decode_kvcache_launch(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table, max_seqlen_q,
                                softmax_scale, splits, out, lse, workspace)
    return out, lse


@_dense_decode_kvcache_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table, max_seqlen_q, max_seqlen_k, softmax_scale,
      num_splits):
    return _fwd_outputs(q)


def dense_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table=None, max_seqlen_q=None,
                         max_seqlen_k=None, softmax_scale=None, num_splits=0, return_lse=False):
    """Dense causal attention of a few queries a sequence over a KV cache, padded or paged.

    What ``sparse_decode_kvcache`` computes with every block selected (the cache layouts,
    ``q``, ``cu_seqlens_q``, ``cache_seqlens`` and the bottom-right alignment are its), for
    caches of any length: on CUDA each query tile's key blocks are cut into ``num_splits``
    ranges (0: the library picks), whose partial results a second kernel merges. The lengths
    and the table are read on the device only; ``max_seqlen_k``, the longest length the call
    may see (default: the cache's capacity), only sizes the split count. No host
    synchronisation when ``max_seqlen_q`` is given. Returns ``out`` (and ``lse`` with
    ``return_lse``); forward only. On CPU, the reference.
    """
    cache_seqlens, block_table = _check_decode_kvcache("dense_decode_kvcache", q, k_cache, v_cache, cache_seqlens,
                                                       cu_seqlens_q, block_table)
    _check_num_splits(num_splits, _MAX_DENSE_DECODE_SPLITS)
    capacity = _cache_capacity(k_cache, block_table)
    if max_seqlen_k is None:
        max_seqlen_k = capacity
    _check_int(max_seqlen_k, "max_seqlen_k", 0)
    if q.is_cuda:
        max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        out, lse = _dense_decode_kvcache_op(q, k_cache, v_cache, cu_seqlens_q, cache_seqlens, block_table,
                                            max_seqlen_q, min(max_seqlen_k, capacity), _scale_or_zero(softmax_scale),
                                            num_splits)
    else:
        out, lse = reference.dense_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table,
                                                  softmax_scale)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# dense_attn: causal (or full) attention, the short-input side of the dense-sparse switch
# --------------------------------------------------------------------------------------------


def dense_attn_fwd_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out,
                          lse):
    """Runs the dense forward kernel into ``out`` and ``lse`` (already allocated)."""
    with _on(q.device):
        status = _lib.lib().infllmv2_dense_attn_fwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(out), _ptr(lse),
            cu_seqlens_q.numel() - 1, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1],
            q.shape[2], int(causal), _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


def dense_attn_bwd_launch(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, dq, dk, dv, workspace):
    """Runs the dense backward kernels into ``dq``, ``dk``, ``dv`` (already allocated)."""
    with _on(q.device):
        status = _lib.lib().infllmv2_dense_attn_bwd(
            _ptr(q), _ptr(k), _ptr(v), _ptr(out), _ptr(dout), _ptr(lse), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k),
            _ptr(dq), _ptr(dk), _ptr(dv), _ptr(workspace), workspace.numel() * 4, cu_seqlens_q.numel() - 1,
            q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], int(causal),
            _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


def _check_dense_attn_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    _check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _check_int(max_seqlen_q, "max_seqlen_q", 0)
    _check_int(max_seqlen_k, "max_seqlen_k", 0)


@_kernel_op("infllmv2::dense_attn_fwd", _check_dense_attn_call)
def _dense_attn_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        out, lse = reference.dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale or None, causal)
        return out.clone(), lse.clone()
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    dense_attn_fwd_launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out,
                          lse)
    return out, lse


@_dense_attn_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return _fwd_outputs(q)


def _check_dense_attn_bwd_call(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                               softmax_scale):
    _check_dense_attn_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    _check_grad_args(q, dout, out, lse)


@_kernel_op("infllmv2::dense_attn_bwd", _check_dense_attn_bwd_call)
def _dense_attn_bwd_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not q.is_cuda:
        def fwd(q_, k_, v_):
            return reference.dense_attn_varlen(q_, k_, v_, cu_seqlens_q, cu_seqlens_k, softmax_scale or None, causal)[0]

        _, vjp = torch.func.vjp(fwd, q, k, v)
        return tuple(g.contiguous() for g in vjp(dout))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    workspace = torch.empty(dense_attn_bwd_workspace_floats(q), dtype=torch.float32, device=q.device)
    dense_attn_bwd_launch(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                          softmax_scale, dq, dk, dv, workspace)
    return dq, dk, dv


@_dense_attn_bwd_op.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _dense_attn_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.args = (max_seqlen_q, max_seqlen_k, causal, softmax_scale)


def _dense_attn_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = torch.ops.infllmv2.dense_attn_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                   *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_dense_attn_fwd_op.register_autograd(_dense_attn_backward, setup_context=_dense_attn_setup_context)


def dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                      causal=True, return_lse=False):
    """Dense GQA attention over each sequence's keys (``reference.dense_attn_varlen``).

    ``q (total_q, Hq, D)``, ``k, v (total_k, Hk, D)``; ``causal`` is bottom-right aligned at
    token granularity (a query with no visible key, only when ``Lq > Lk``, gets ``out = 0``,
    ``lse = -inf``). Returns ``out`` (and ``lse fp32 (Hq, total_q)`` with ``return_lse``);
    differentiable in q, k, v. CUDA runs the library's dense kernels (bf16/fp16, D 64/128,
    G <= 64, deterministic backward); CPU runs the reference.
    """
    _check_varlen_qkv(q, k, v, cu_seqlens_q, cu_seqlens_k)
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if q.is_cuda:
        max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k, "max_seqlen_k")
        out, lse = _dense_attn_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      _scale_or_zero(softmax_scale))
    else:
        out, lse = reference.dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------------------------
# stage 1: select_blocks (fused), group_scores and max_pool_blocks (the scores path)
# --------------------------------------------------------------------------------------------

# DSL build parameters of the stage-1 kernels (dsl/select_blocks.py): the fine compression and
# the block size they were generated for.
_KERNEL_FINE = (32, 16)
_KERNEL_MAX_SELECT_TOPK = 8192




def _check_keys_like_q(q, keys, name):
    """A (tokens, heads, D) tensor the CUDA kernels take, in q's dtype and on q's device."""
    _check_tensor3(keys, name)
    _check_kernel_tensor(keys, name)
    if keys.dtype != q.dtype or keys.device != q.device:
        raise ValueError(f"{name} must match q in dtype and device ({q.dtype}, {q.device}), got {keys.dtype}, "
                         f"{keys.device}")


def _check_scoring_qk(q, keys, name, kernel_size, kernel_stride, softmax_scale):
    """What the CUDA scoring kernels need of q and of the keys (``k`` or ``ck``) they score against."""
    _check_tensor3(q, "q")
    _check_kernel_tensor(q, "q")
    _check_keys_like_q(q, keys, name)
    if keys.shape[2] != q.shape[2]:
        raise ValueError(f"{name} head_dim {keys.shape[2]} differs from q head_dim {q.shape[2]}")
    if keys.shape[1] == 0 or q.shape[1] % keys.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of {name} heads ({keys.shape[1]})")
    if q.shape[1] // keys.shape[1] > 64:
        raise ValueError(f"the group size heads/heads_k = {q.shape[1] // keys.shape[1]} exceeds 64 on CUDA")
    if (kernel_size, kernel_stride) != _KERNEL_FINE:
        raise ValueError(
            f"kernel_size/kernel_stride must be {_KERNEL_FINE[0]}/{_KERNEL_FINE[1]} on CUDA (the stage-1 kernels are "
            f"generated for them; rerun `python -m dsl.build` with other FINE_W/FINE_S), got {kernel_size}/{kernel_stride}"
        )
    if softmax_scale is not None and not (float(softmax_scale) > 0 and math.isfinite(float(softmax_scale))):
        raise ValueError(f"softmax_scale must be finite and > 0 on CUDA, got {softmax_scale}")


def _check_scoring_args(q, ck, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, norm_keys, cu_seqlens_norm,
                        kernel_size, kernel_stride, softmax_scale):
    """Checks for the CUDA scoring kernels (the reference does its own, more general, checks)."""
    _check_scoring_qk(q, ck, "ck", kernel_size, kernel_stride, softmax_scale)
    if norm_keys is not None:
        _check_keys_like_q(q, norm_keys, "norm_keys")
        if norm_keys.shape[1:] != ck.shape[1:]:
            raise ValueError(f"norm_keys shape {tuple(norm_keys.shape)} must be (tokens, heads_k, head_dim) like ck "
                             f"{tuple(ck.shape)}")
    cus = [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("cu_seqlens_c", cu_seqlens_c)]
    if norm_keys is not None:
        if cu_seqlens_norm is None:
            raise ValueError("cu_seqlens_norm is required when norm_keys is given")
        cus.append(("cu_seqlens_norm", cu_seqlens_norm))
    _check_offsets(cus, q.device)


def select_blocks_launch(q, ck, norm_keys, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, cu_seqlens_norm, out, init_blocks,
                         local_blocks, norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q, max_seqlen_k):
    """Runs the fused selection kernel into ``out`` (int32 ``(Hk, total_q, K)``, already allocated)."""
    with _on(q.device):
        status = _lib.lib().infllmv2_select_blocks(
            _ptr(q), _ptr(ck), _ptr(norm_keys), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(cu_seqlens_c),
            _ptr(cu_seqlens_norm), _ptr(out), cu_seqlens_q.numel() - 1, q.shape[0], ck.shape[0],
            0 if norm_keys is None else norm_keys.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1], ck.shape[1],
            q.shape[2], out.shape[2], init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride,
            _KERNEL_DTYPES[q.dtype], softmax_scale, _stream(q.device),
        )
    _lib.check(status)


def group_scores_launch(q, ck, norm_keys, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, cu_seqlens_norm, out,
                        norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q):
    """Runs the scores kernel into ``out`` (fp32 ``(Hk, total_q, width)``, already allocated)."""
    with _on(q.device):
        status = _lib.lib().infllmv2_group_scores(
            _ptr(q), _ptr(ck), _ptr(norm_keys), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(cu_seqlens_c),
            _ptr(cu_seqlens_norm), _ptr(out), cu_seqlens_q.numel() - 1, q.shape[0], ck.shape[0],
            0 if norm_keys is None else norm_keys.shape[0], max_seqlen_q, out.shape[2], q.shape[1], ck.shape[1],
            q.shape[2], norm_kernel_size, norm_kernel_stride, _KERNEL_DTYPES[q.dtype], softmax_scale,
            _stream(q.device),
        )
    _lib.check(status)


def max_pool_blocks_launch(S, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, out, init_blocks, local_blocks, max_seqlen_q):
    """Runs the pooling kernel on fp32 ``S`` into ``out`` (fp32 ``(Hk, total_q, n_blocks)``)."""
    with _on(S.device):
        status = _lib.lib().infllmv2_max_pool_blocks(
            _ptr(S), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _ptr(cu_seqlens_c), _ptr(out), cu_seqlens_q.numel() - 1,
            S.shape[1], S.shape[2], out.shape[2], max_seqlen_q, S.shape[0], init_blocks, local_blocks,
            _stream(S.device),
        )
    _lib.check(status)


def _select_cuda(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk, init_blocks, local_blocks, approx_lse,
                 norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q, max_seqlen_k, splits):
    """Stages 0 and 1 on the GPU with no host read: one C call runs the offsets and compression of
    each level into a workspace sized by the bound total_k // s + B, then the selection: the
    fused kernel (infllmv2_select_blocks_from_keys, ``splits`` None) or the split one
    (infllmv2_select_decode). One call, not five: the caller waits for the host work before the
    first launch."""
    batch = cu_seqlens_q.numel() - 1
    lib = _lib.lib()
    if splits is None:
        size = lib.infllmv2_select_blocks_from_keys_workspace_size(batch, k.shape[0], k.shape[1], k.shape[2],
                                                                    int(approx_lse), norm_kernel_stride)
    else:
        size = lib.infllmv2_select_decode_workspace_size(batch, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                                                         q.shape[1], k.shape[1], q.shape[2], int(approx_lse),
                                                         norm_kernel_stride, splits)
    workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
    out = torch.empty((k.shape[1], q.shape[0], topk), dtype=torch.int32, device=q.device)
    args = [_ptr(q), _ptr(k), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k), _mask_ptr(punct_mask), float(phsa_lambda),
            _ptr(out), _ptr(workspace), size, batch, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1],
            k.shape[1], q.shape[2], topk, init_blocks, local_blocks, int(approx_lse), norm_kernel_size,
            norm_kernel_stride, _KERNEL_DTYPES[q.dtype], softmax_scale]
    with _on(q.device):
        if splits is None:
            status = lib.infllmv2_select_blocks_from_keys(*args, _stream(q.device))
        else:
            status = lib.infllmv2_select_decode(*args, splits, _stream(q.device))
    _lib.check(status)
    return out


def _check_select_call(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk, init_blocks, local_blocks,
                       approx_lse, norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q, max_seqlen_k,
                       num_splits=0):
    """select_blocks' and select_decode's op arguments (the compressed keys' offsets are the op's)."""
    _check_scoring_qk(q, k, "k", *_KERNEL_FINE, softmax_scale or None)
    _check_offsets((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)), q.device)
    _check_phsa_args(punct_mask, phsa_lambda, k)
    for value, name, least in ((topk, "topk", 1), (init_blocks, "init_blocks", 0), (local_blocks, "local_blocks", 0),
                               (num_splits, "num_splits", 0), (norm_kernel_size, "norm_kernel_size", 1),
                               (norm_kernel_stride, "norm_kernel_stride", 1), (max_seqlen_q, "max_seqlen_q", 0),
                               (max_seqlen_k, "max_seqlen_k", 0)):
        _check_int(value, name, least)
    _check_select_limits(topk, num_splits)


def _check_select_limits(topk, num_splits):
    """The selection kernels' limits on topk and num_splits (both checked as ints already)."""
    if topk > _KERNEL_MAX_SELECT_TOPK:
        raise ValueError(f"topk must be <= {_KERNEL_MAX_SELECT_TOPK} on CUDA, got {topk}")
    if num_splits > _MAX_SELECT_SPLITS:
        raise ValueError(f"num_splits must be at most {_MAX_SELECT_SPLITS} (0 lets the library pick), got {num_splits}")


@_forward_only_op("infllmv2::select_blocks", _check_select_call)
def _select_blocks_op(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    punct_mask: Optional[torch.Tensor], phsa_lambda: float, topk: int, init_blocks: int, local_blocks: int,
    approx_lse: bool, norm_kernel_size: int, norm_kernel_stride: int, softmax_scale: float, max_seqlen_q: int,
    max_seqlen_k: int,
) -> torch.Tensor:
    return _select_cuda(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk, init_blocks, local_blocks,
                        approx_lse, norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q, max_seqlen_k,
                        None)


@_select_blocks_op.register_fake
def _(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk, init_blocks, local_blocks, approx_lse,
      norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q, max_seqlen_k):
    return q.new_empty((k.shape[1], q.shape[0], topk), dtype=torch.int32)


_MAX_SELECT_SPLITS = 64


def select_decode_splits(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, num_splits=0) -> int:
    """The splits select_decode runs on q's device (``num_splits`` 0: its own choice)."""
    with _on(q.device):
        splits = _lib.lib().infllmv2_select_decode_splits(cu_seqlens_q.numel() - 1, max_seqlen_q, max_seqlen_k,
                                                          q.shape[1], k.shape[1], num_splits)
    return _splits_or_raise("infllmv2_select_decode_splits", splits)


@_forward_only_op("infllmv2::select_decode", _check_select_call)
def _select_decode_op(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    punct_mask: Optional[torch.Tensor], phsa_lambda: float, topk: int, init_blocks: int, local_blocks: int,
    approx_lse: bool, norm_kernel_size: int, norm_kernel_stride: int, softmax_scale: float, max_seqlen_q: int,
    max_seqlen_k: int, num_splits: int,
) -> torch.Tensor:
    splits = select_decode_splits(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, num_splits)
    return _select_cuda(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk, init_blocks, local_blocks,
                        approx_lse, norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q, max_seqlen_k,
                        splits)


@_select_decode_op.register_fake
def _(q, k, cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk, init_blocks, local_blocks, approx_lse,
      norm_kernel_size, norm_kernel_stride, softmax_scale, max_seqlen_q, max_seqlen_k, num_splits):
    return q.new_empty((k.shape[1], q.shape[0], topk), dtype=torch.int32)


def select_blocks(q, k, cu_seqlens_q, cu_seqlens_k, topk=96, kernel_size=32, kernel_stride=16, block_size=64,
                  init_blocks=1, local_blocks=32, approx_lse=True, norm_kernel_size=128, norm_kernel_stride=64,
                  softmax_scale=None, punct_mask=None, phsa_lambda=0.5, max_seqlen_q=None, max_seqlen_k=None):
    """Block selection, stages 0 and 1: ``topk_idx`` int32 ``(Hk, total_q, topk)`` for stage 2.

    Same meaning and arguments as ``reference.select_blocks`` (SPEC.md, stage 1): compressed keys
    (``kernel_size``/``kernel_stride``, optionally PHSA), per-head probabilities normalised over the
    coarse keys (``approx_lse``) or the fine keys, summed over the head group, max-pooled to
    ``block_size`` blocks, init and local blocks forced, future blocks excluded, the ``topk`` best
    per (KV head, query) ascending and -1 padded. No gradient.

    CUDA runs ``compress_keys`` and one fused selection kernel (bf16/fp16, D 64/128, G <= 64;
    compression 32/16 and block 64, the DSL build parameters; K <= 8192; sequences up to 512K
    keys on sm_90a, 384K on sm_80/sm_89): the score matrices never exist in device memory.
    Ties at the K-th score go to the lower block index. The compressed keys' offsets are computed
    on the GPU and their buffers sized by a bound. With ``max_seqlen_q`` and ``max_seqlen_k``
    given nothing is read on the host (no synchronisation), and the offsets are trusted as the C
    ABI trusts them (inconsistent ones give wrong selections, never an out-of-bounds access).
    Otherwise the longest sequences are read on the host, and ``cu_seqlens_k`` is checked there.
    CPU runs the reference.
    """
    return _select(q, k, cu_seqlens_q, cu_seqlens_k, topk, kernel_size, kernel_stride, block_size, init_blocks,
                   local_blocks, approx_lse, norm_kernel_size, norm_kernel_stride, softmax_scale, punct_mask,
                   phsa_lambda, max_seqlen_q, max_seqlen_k, None)


def _select(q, k, cu_seqlens_q, cu_seqlens_k, topk, kernel_size, kernel_stride, block_size, init_blocks, local_blocks,
            approx_lse, norm_kernel_size, norm_kernel_stride, softmax_scale, punct_mask, phsa_lambda, max_seqlen_q,
            max_seqlen_k, num_splits):
    """select_blocks (num_splits None) or select_decode."""
    _check_tensor3(q, "q")
    _check_tensor3(k, "k")
    if k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"k must match q in dtype and device ({q.dtype}, {q.device}), got {k.dtype}, {k.device}")
    _check_int(topk, "topk", 1)
    _check_int(init_blocks, "init_blocks", 0)
    _check_int(local_blocks, "local_blocks", 0)
    if not q.is_cuda:
        return reference.select_blocks(
            q, k, cu_seqlens_q, cu_seqlens_k, topk, kernel_size, kernel_stride, block_size, init_blocks, local_blocks,
            approx_lse, norm_kernel_size, norm_kernel_stride, softmax_scale, punct_mask, phsa_lambda,
        )
    if block_size != _KERNEL_BLOCK:
        raise ValueError(f"block_size must be {_KERNEL_BLOCK} on CUDA, got {block_size}")
    _check_select_limits(topk, num_splits or 0)
    _check_int(kernel_size, "kernel_size", 1)
    _check_int(kernel_stride, "kernel_stride", 1)
    _check_scoring_qk(q, k, "k", kernel_size, kernel_stride, softmax_scale)
    _check_offsets((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)), q.device)
    phsa_lambda = _check_phsa_args(punct_mask, phsa_lambda, k)
    if approx_lse:
        _check_int(norm_kernel_size, "norm_kernel_size", 1)
        _check_int(norm_kernel_stride, "norm_kernel_stride", 1)
    max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k, "max_seqlen_k", k.shape[0])
    args = (q.detach(), k.detach(), cu_seqlens_q, cu_seqlens_k, punct_mask, phsa_lambda, topk, init_blocks, local_blocks,
            bool(approx_lse), norm_kernel_size, norm_kernel_stride, _scale_or_zero(softmax_scale), max_seqlen_q,
            max_seqlen_k)
    return _select_blocks_op(*args) if num_splits is None else _select_decode_op(*args, num_splits)


def select_decode(q, k, cu_seqlens_q, cu_seqlens_k, topk=96, kernel_size=32, kernel_stride=16, block_size=64,
                  init_blocks=1, local_blocks=32, approx_lse=True, norm_kernel_size=128, norm_kernel_stride=64,
                  softmax_scale=None, punct_mask=None, phsa_lambda=0.5, max_seqlen_q=None, max_seqlen_k=None,
                  num_splits=0):
    """``select_blocks`` for calls with few queries a sequence (decoding against a long cache).

    Same arguments and result; each query tile's compressed keys are split among ``num_splits``
    thread blocks (0: the library picks, so that one long sequence fills the GPU, and runs
    ``select_blocks`` itself, bitwise, where the query tiles already fill it): partial
    normalisers, block scores, then the top-K. With more than one split the normaliser's sums
    are merged in another (fixed) order than ``select_blocks``' kernel, so scores may differ in
    the last bits and ties at the K-th score may resolve otherwise. No host synchronisation when
    ``max_seqlen_q`` and ``max_seqlen_k`` are given. CPU runs the reference.
    """
    _check_int(num_splits, "num_splits", 0)
    if num_splits > _MAX_SELECT_SPLITS:
        raise ValueError(f"num_splits must be at most {_MAX_SELECT_SPLITS} (0 lets the library pick), got {num_splits}")
    return _select(q, k, cu_seqlens_q, cu_seqlens_k, topk, kernel_size, kernel_stride, block_size, init_blocks,
                   local_blocks, approx_lse, norm_kernel_size, norm_kernel_stride, softmax_scale, punct_mask,
                   phsa_lambda, max_seqlen_q, max_seqlen_k, num_splits)


def select_decode_kvcache_launch(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, out, capacity, max_seqlen_q,
                                 init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride, softmax_scale,
                                 splits):
    """Runs the selection into ``out`` (Hk, total_q, topk) int32; arguments checked."""
    batch = cu_seqlens_q.numel() - 1
    lib = _lib.lib()
    size = lib.infllmv2_select_decode_kvcache_workspace_size(batch, q.shape[0], max_seqlen_q, capacity, q.shape[1],
                                                             ck_cache.shape[2], splits)
    workspace = torch.empty(size, dtype=torch.uint8, device=q.device)
    with _on(q.device):
        status = lib.infllmv2_select_decode_kvcache(
            _ptr(q), _ptr(ck_cache), _ptr(nk_cache), _ptr(cache_seqlens), _ptr(cu_seqlens_q), _ptr(out),
            _ptr(workspace), size, batch, q.shape[0], max_seqlen_q, capacity, ck_cache.shape[1],
            0 if nk_cache is None else nk_cache.shape[1], q.shape[1], ck_cache.shape[2], q.shape[2], out.shape[2],
            init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride, _KERNEL_DTYPES[q.dtype], softmax_scale,
            splits, _stream(q.device))
    _lib.check(status)


def _check_select_decode_kvcache_call(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, topk, capacity, max_seqlen_q,
                                      init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride, softmax_scale,
                                      num_splits):
    _check_select_decode_kvcache(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, capacity, topk, *_KERNEL_FINE,
                                 init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride, num_splits)
    _check_scoring_qk(q, ck_cache[0], "ck_cache", *_KERNEL_FINE, softmax_scale or None)
    _check_select_limits(topk, num_splits)
    _check_int(max_seqlen_q, "max_seqlen_q", 0)


@_forward_only_op("infllmv2::select_decode_kvcache", _check_select_decode_kvcache_call)
def _select_decode_kvcache_op(
    q: torch.Tensor, ck_cache: torch.Tensor, nk_cache: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, topk: int, capacity: int, max_seqlen_q: int, init_blocks: int, local_blocks: int,
    norm_kernel_size: int, norm_kernel_stride: int, softmax_scale: float, num_splits: int,
) -> torch.Tensor:
    out = torch.empty((ck_cache.shape[2], q.shape[0], topk), dtype=torch.int32, device=q.device)
    # one sequence's rows: (capacity_c, Hk, D), the shape select_decode_splits reads heads_k from
    splits = select_decode_splits(q, ck_cache[0], cu_seqlens_q, max_seqlen_q, capacity, num_splits)
    select_decode_kvcache_launch(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, out, capacity, max_seqlen_q,
                                 init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride, softmax_scale, splits)
    return out


@_select_decode_kvcache_op.register_fake
def _(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, topk, capacity, max_seqlen_q, init_blocks, local_blocks,
      norm_kernel_size, norm_kernel_stride, softmax_scale, num_splits):
    return q.new_empty((ck_cache.shape[2], q.shape[0], topk), dtype=torch.int32)


def _check_compressed_caches(q, ck_cache, nk_cache, batch, capacity, kernel_size, kernel_stride, norm_kernel_size,
                             norm_kernel_stride):
    """``ck_cache`` (and ``nk_cache`` unless None): (batch, rows, Hk, D) in q's dtype and device,
    Hk dividing q's heads, rows enough for a full cache of ``capacity`` keys; on CUDA, as the
    kernels need them (contiguous: they are written in place)."""
    _check_cache_tensor(ck_cache, "ck_cache", q, "q")
    if ck_cache.shape[3] != q.shape[2] or q.shape[1] % ck_cache.shape[2] != 0:
        raise ValueError(f"ck_cache must have shape (batch, capacity_c, Hk, D={q.shape[2]}) with Hk dividing q's "
                         f"{q.shape[1]} heads, got {tuple(ck_cache.shape)}")
    if nk_cache is not None:
        _check_cache_tensor(nk_cache, "nk_cache", q, "q")
        if nk_cache.shape[0] != ck_cache.shape[0] or nk_cache.shape[2:] != ck_cache.shape[2:]:
            raise ValueError(f"nk_cache must have shape (batch={ck_cache.shape[0]}, capacity_n, Hk={ck_cache.shape[2]}, "
                             f"D={ck_cache.shape[3]}), got {tuple(nk_cache.shape)}")
    if ck_cache.shape[0] != batch:
        raise ValueError(f"ck_cache must hold a sequence per batch entry ({batch}), got {ck_cache.shape[0]}")
    _check_compressed_rows(ck_cache, "ck_cache", capacity, kernel_size, kernel_stride)
    if nk_cache is not None:
        _check_compressed_rows(nk_cache, "nk_cache", capacity, norm_kernel_size, norm_kernel_stride)
    if q.is_cuda:
        for name, t in (("ck_cache", ck_cache), ("nk_cache", nk_cache)):
            if t is not None:
                _check_kernel_tensor(t, name)


def select_decode_kvcache(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, capacity, topk=96, kernel_size=32,
                          kernel_stride=16, block_size=64, init_blocks=1, local_blocks=32, norm_kernel_size=128,
                          norm_kernel_stride=64, softmax_scale=None, max_seqlen_q=None, num_splits=0):
    """``select_decode`` over compressed caches kept by ``compress_keys_kvcache``: a decoding step
    that does not recompress its whole cache.

    Sequence ``b`` has ``cache_seqlens[b]`` keys (clamped to ``capacity``, the most a sequence can
    hold; the new tokens' keys included) and its queries ``q (total_q, Hq, D)``, packed by
    ``cu_seqlens_q``, are its last tokens. ``ck_cache (batch, capacity_c, Hk, D)`` holds its fine
    compressed keys (``kernel_size``/``kernel_stride``) in rows ``0 .. n(L)``, ``nk_cache``
    likewise the normaliser keys (``norm_kernel_size``/``norm_kernel_stride``; None: the exact
    normaliser over the fine keys); rows past them may hold anything. Returns ``topk_idx``
    ``(Hk, total_q, topk)`` as ``select_blocks`` on the same keys packed (with ``num_splits`` > 1
    merged as ``select_decode`` merges). No host synchronisation when ``max_seqlen_q`` is given.
    CPU runs the reference.
    """
    cache_seqlens = _check_select_decode_kvcache(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, capacity, topk,
                                                 kernel_size, kernel_stride, init_blocks, local_blocks, norm_kernel_size,
                                                 norm_kernel_stride, num_splits)
    if not q.is_cuda:
        return reference.select_decode_kvcache(q, ck_cache, nk_cache, cache_seqlens.clamp(0, capacity), cu_seqlens_q,
                                               topk, kernel_size, kernel_stride, block_size, init_blocks, local_blocks,
                                               norm_kernel_size, norm_kernel_stride, softmax_scale)
    if block_size != _KERNEL_BLOCK:
        raise ValueError(f"block_size must be {_KERNEL_BLOCK} on CUDA, got {block_size}")
    _check_select_limits(topk, num_splits)
    # the scoring kernels' limits (dtype, head_dim, group size, 32/16, scale) on one sequence's rows
    _check_scoring_qk(q, ck_cache[0], "ck_cache", kernel_size, kernel_stride, softmax_scale)
    max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    return _select_decode_kvcache_op(q.detach(), ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, topk, capacity,
                                     max_seqlen_q, init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride,
                                     _scale_or_zero(softmax_scale), num_splits)


def _check_select_decode_kvcache(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, capacity, topk, kernel_size,
                                 kernel_stride, init_blocks, local_blocks, norm_kernel_size, norm_kernel_stride,
                                 num_splits):
    """select_decode_kvcache's arguments; returns cache_seqlens as int32."""
    _check_tensor3(q, "q")
    _check_offsets((("cu_seqlens_q", cu_seqlens_q),), q.device)
    batch = cu_seqlens_q.numel() - 1
    for value, name, minimum in ((capacity, "capacity", 0), (topk, "topk", 1), (init_blocks, "init_blocks", 0),
                                 (local_blocks, "local_blocks", 0), (num_splits, "num_splits", 0),
                                 (kernel_size, "kernel_size", 1), (kernel_stride, "kernel_stride", 1)):
        _check_int(value, name, minimum)
    if nk_cache is not None:
        _check_int(norm_kernel_size, "norm_kernel_size", 1)
        _check_int(norm_kernel_stride, "norm_kernel_stride", 1)
    _check_compressed_caches(q, ck_cache, nk_cache, batch, capacity, kernel_size, kernel_stride, norm_kernel_size,
                             norm_kernel_stride)
    return _index_vector(cache_seqlens, "cache_seqlens", batch, q.device)


def group_scores(q, ck, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, kernel_size=32, kernel_stride=16,
                 softmax_scale=None, norm_keys=None, cu_seqlens_norm=None, norm_kernel_size=128,
                 norm_kernel_stride=64, width=None, max_seqlen_q=None):
    """Group-summed stage-1 scores ``S`` fp32 ``(Hk, total_q, width)`` (``reference.group_scores``).

    ``width`` defaults to the longest compressed sequence (one host read of ``cu_seqlens_c``);
    columns a row cannot see, and those past its sequence's compressed keys, are 0. CUDA runs the
    scores kernel (the fused ``select_blocks`` never writes this matrix); CPU runs the reference.
    """
    if not q.is_cuda:
        s = reference.group_scores(q, ck, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, kernel_size, kernel_stride,
                                   softmax_scale, norm_keys, cu_seqlens_norm, norm_kernel_size, norm_kernel_stride)
        if width is not None:
            s = torch.nn.functional.pad(s, (0, max(0, width - s.shape[2])))[:, :, :width]
        return s
    _check_scoring_args(q, ck, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, norm_keys, cu_seqlens_norm, kernel_size,
                        kernel_stride, softmax_scale)
    if width is None:
        width = max(_max_seqlen(cu_seqlens_c, None, "width"), 1)
    _check_int(width, "width", 1)
    max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    out = torch.empty((ck.shape[1], q.shape[0], width), dtype=torch.float32, device=q.device)
    group_scores_launch(q, ck, norm_keys, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, cu_seqlens_norm, out,
                        norm_kernel_size, norm_kernel_stride, _scale_or_zero(softmax_scale), max_seqlen_q)
    return out


def max_pool_blocks(S, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, kernel_size=32, kernel_stride=16, block_size=64,
                    init_blocks=1, local_blocks=32, n_blocks=None, max_seqlen_q=None):
    """Block scores fp32 ``(Hk, total_q, n_blocks)`` from ``S`` (``reference.max_pool_blocks``).

    ``n_blocks`` defaults to ``ceil(max Lk / block_size)`` (one host read of ``cu_seqlens_k``).
    CUDA runs the pooling kernel on fp32 ``S`` (other float dtypes are converted); CPU runs the
    reference.
    """
    if not S.is_cuda:
        out = reference.max_pool_blocks(S, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, kernel_size, kernel_stride,
                                        block_size, init_blocks, local_blocks)
        if n_blocks is not None:
            out = torch.nn.functional.pad(out, (0, max(0, n_blocks - out.shape[2])), value=float("-inf"))[:, :, :n_blocks]
        return out
    if not isinstance(S, torch.Tensor) or S.dim() != 3 or not S.is_floating_point():
        raise ValueError("S must be a floating-point tensor of shape (Hk, total_q, width)")
    if (kernel_size, kernel_stride) != _KERNEL_FINE or block_size != _KERNEL_BLOCK:
        raise ValueError(f"kernel_size/kernel_stride/block_size must be {_KERNEL_FINE[0]}/{_KERNEL_FINE[1]}/"
                         f"{_KERNEL_BLOCK} on CUDA, got {kernel_size}/{kernel_stride}/{block_size}")
    _check_int(init_blocks, "init_blocks", 0)
    _check_int(local_blocks, "local_blocks", 0)
    _check_offsets((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("cu_seqlens_c", cu_seqlens_c)),
                   S.device)
    if S.shape[1] == 0 or S.shape[2] == 0:
        raise ValueError(f"S must have total_q >= 1 rows and width >= 1 columns, got shape {tuple(S.shape)}")
    if n_blocks is None:
        n_blocks = max(-(-_max_seqlen(cu_seqlens_k, None, "max_seqlen_k") // block_size), 1)
    _check_int(n_blocks, "n_blocks", 1)
    max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q")
    S = S.float().contiguous()
    out = torch.empty((S.shape[0], S.shape[1], n_blocks), dtype=torch.float32, device=S.device)
    max_pool_blocks_launch(S, cu_seqlens_q, cu_seqlens_k, cu_seqlens_c, out, init_blocks, local_blocks, max_seqlen_q)
    return out


# --------------------------------------------------------------------------------------------
# attention_kvcache: the decoding step in one C call (infllmv2_attention_kvcache)
# --------------------------------------------------------------------------------------------


_step_workspace_sizes: dict = {}


def attention_kvcache_launch(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, ck_cache, nk_cache, block_table, out,
                             lse, new_keys, max_seqlen_q, max_seqlen_k, config, softmax_scale, punct_cache=None,
                             phsa_lambda=0.5):
    """Runs infllmv2_attention_kvcache; ``config`` the infllmv2_sparse_config fields in order."""
    lib = _lib.lib()
    c = _lib.SparseConfigC(*config)
    batch = cu_seqlens_q.numel() - 1
    pages_per_seq = 0 if block_table is None else block_table.shape[1]
    args = (batch, q.shape[0], max_seqlen_q, max_seqlen_k, k_cache.shape[0], k_cache.shape[1], pages_per_seq)
    key = (*args, q.shape[1], k_cache.shape[2], q.shape[2], *config, q.device.index)
    size = _step_workspace_sizes.get(key)
    if size is None:
        # a decoding loop asks the same question every step (and the answer, which depends on the
        # device's SM count through the split counts, never changes for it)
        size = lib.infllmv2_attention_kvcache_workspace_size(*args, q.shape[1], k_cache.shape[2], q.shape[2],
                                                             ctypes.byref(c))
        if len(_step_workspace_sizes) >= 1024:
            _step_workspace_sizes.clear()
        _step_workspace_sizes[key] = size
    # 0 is an argument error, which the call below reports
    workspace = torch.empty(max(size, 256), dtype=torch.uint8, device=q.device)
    with _on(q.device):
        status = lib.infllmv2_attention_kvcache(
            _ptr(q), _ptr(k_cache), _ptr(v_cache), _ptr(block_table), _ptr(cache_seqlens), _ptr(cu_seqlens_q),
            _mask_ptr(punct_cache), float(phsa_lambda), _ptr(ck_cache), _ptr(nk_cache), _ptr(out), _ptr(lse),
            _ptr(workspace), size, *args,
            ck_cache.shape[1], 0 if nk_cache is None else nk_cache.shape[1], new_keys, q.shape[1], k_cache.shape[2],
            q.shape[2], _KERNEL_DTYPES[q.dtype], softmax_scale, ctypes.byref(c), _stream(q.device))
    _lib.check(status)


def _check_attention_kvcache_call(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, ck_cache, nk_cache, block_table,
                                  new_keys, max_seqlen_q, max_seqlen_k, config, softmax_scale, punct_cache, phsa_lambda):
    """The step's shapes (the C call checks config's values and the compressed caches' rows)."""
    fields = [name for name, _ in _lib.SparseConfigC._fields_]
    if len(config) != len(fields):
        raise ValueError(f"config must hold the {len(fields)} infllmv2_sparse_config fields {fields}, got {len(config)}")
    cfg = dict(zip(fields, config))
    for name in ("kernel_size", "kernel_stride", "norm_kernel_size", "norm_kernel_stride"):
        _check_int(cfg[name], f"config's {name}", 1)
    _check_decode_kvcache("attention_kvcache", q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table)
    _check_compressed_caches(q, ck_cache, nk_cache, cu_seqlens_q.numel() - 1, _cache_capacity(k_cache, block_table),
                             cfg["kernel_size"], cfg["kernel_stride"], cfg["norm_kernel_size"], cfg["norm_kernel_stride"])
    if punct_cache is not None:
        _check_punct_cache(punct_cache, k_cache, phsa_lambda)
    for value, name in ((new_keys, "new_keys"), (max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k")):
        _check_int(value, name, 0)


@_forward_only_op("infllmv2::attention_kvcache", _check_attention_kvcache_call, mutates_args=("ck_cache", "nk_cache"))
def _attention_kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    cu_seqlens_q: torch.Tensor, ck_cache: torch.Tensor, nk_cache: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor], new_keys: int, max_seqlen_q: int, max_seqlen_k: int, config: list[int],
    softmax_scale: float, punct_cache: Optional[torch.Tensor], phsa_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fwd_outputs(q)
    attention_kvcache_launch(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, ck_cache, nk_cache, block_table, out,
                             lse, new_keys, max_seqlen_q, max_seqlen_k, config, softmax_scale, punct_cache, phsa_lambda)
    return out, lse


@_attention_kvcache_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, ck_cache, nk_cache, block_table, new_keys, max_seqlen_q,
      max_seqlen_k, config, softmax_scale, punct_cache, phsa_lambda):
    return _fwd_outputs(q)
