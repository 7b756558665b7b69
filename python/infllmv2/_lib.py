"""ctypes binding of the C ABI (cpp/include/infllmv2.h).

ctypes rather than a compiled extension: the library has a C ABI and no Python or torch
symbols, so one wheel serves every Python >= 3.10 and every torch. The library is loaded on
first use, from $INFLLMV2_LIBRARY or from beside this file (where the wheel installs it), so
`import infllmv2` works on a machine with no GPU and no library at all.
"""

from __future__ import annotations

import ctypes
import json
import os
import threading

ABI_VERSION = 5

OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_UNSUPPORTED = 2
ERR_UNSUPPORTED_ARCH = 3
ERR_CUDA = 4

DTYPE_BF16 = 0
DTYPE_FP16 = 1


class Infllmv2Error(RuntimeError):
    """An error reported by the C library; `status` is the infllmv2_status code."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Infllmv2ArgumentError(Infllmv2Error, ValueError):
    """The C library rejected an argument (INFLLMV2_ERR_INVALID_ARGUMENT)."""


class Infllmv2UnsupportedError(Infllmv2Error, NotImplementedError):
    """No kernel for this request or for this GPU's arch."""


class SparseConfigC(ctypes.Structure):
    """infllmv2_sparse_config (cpp/include/infllmv2.h), field for field."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "kernel_size", "kernel_stride", "block_size", "init_blocks", "window_size", "topk", "dense_len", "approx_lse",
        "norm_kernel_size", "norm_kernel_stride")]


_lock = threading.Lock()
_lib = None

_c = ctypes
_SIGNATURES = {
    "infllmv2_abi_version": (_c.c_int, []),
    "infllmv2_version": (_c.c_char_p, []),
    "infllmv2_build_info": (_c.c_char_p, []),
    "infllmv2_last_error": (_c.c_char_p, []),
    "infllmv2_set_arch_override": (_c.c_int, [_c.c_char_p]),
    "infllmv2_selected_arch": (_c.c_char_p, []),
    "infllmv2_compress_keys": (
        _c.c_int,
        [_c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_void_p, _c.c_float, _c.c_void_p,
         _c.c_int32, _c.c_int64, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_int,
         _c.c_int32, _c.c_int32, _c.c_void_p],
    ),
    "infllmv2_compress_keys_kvcache": (
        _c.c_int,
        [_c.c_void_p] * 4 + [_c.c_float, _c.c_void_p, _c.c_int32, _c.c_int64] + [_c.c_int32] * 6
        + [_c.c_int, _c.c_int32, _c.c_int32, _c.c_void_p],
    ),
    "infllmv2_attention_compressed_offsets": (
        _c.c_int, [_c.c_void_p, _c.c_void_p, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_void_p],
    ),
    "infllmv2_sparse_attn_fwd": (
        _c.c_int,
        [_c.c_void_p] * 8 + [_c.c_int32, _c.c_int64, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_int32,
                             _c.c_int32, _c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_sparse_attn_bwd_workspace_size": (_c.c_size_t, [_c.c_int64, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32,
                                                              _c.c_int32]),
    "infllmv2_sparse_attn_bwd": (
        _c.c_int,
        [_c.c_void_p] * 13 + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32,
                              _c.c_int32, _c.c_int32, _c.c_int32, _c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_sparse_decode_splits": (_c.c_int32, [_c.c_int32] * 6),
    "infllmv2_sparse_decode_workspace_size": (_c.c_size_t, [_c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32]),
    "infllmv2_sparse_decode": (
        _c.c_int,
        [_c.c_void_p] * 9 + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int64] + [_c.c_int32] * 6
        + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_sparse_decode_kvcache_workspace_size": (_c.c_size_t, [_c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32]),
    "infllmv2_sparse_decode_kvcache": (
        _c.c_int,
        [_c.c_void_p] * 10 + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int32, _c.c_int64] + [_c.c_int32] * 7
        + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_dense_decode_kvcache_splits": (_c.c_int32, [_c.c_int32] * 6),
    "infllmv2_dense_decode_kvcache_workspace_size": (_c.c_size_t, [_c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32]),
    "infllmv2_dense_decode_kvcache": (
        _c.c_int,
        [_c.c_void_p] * 9 + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int32, _c.c_int64] + [_c.c_int32] * 6
        + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_select_decode_splits": (_c.c_int32, [_c.c_int32] * 6),
    "infllmv2_select_decode_workspace_size": (
        _c.c_size_t, [_c.c_int32, _c.c_int64, _c.c_int64] + [_c.c_int32] * 8,
    ),
    "infllmv2_select_decode": (
        _c.c_int,
        [_c.c_void_p] * 5 + [_c.c_float, _c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int64]
        + [_c.c_int32] * 11 + [_c.c_int, _c.c_float, _c.c_int32, _c.c_void_p],
    ),
    "infllmv2_select_decode_kvcache_workspace_size": (_c.c_size_t, [_c.c_int32, _c.c_int64] + [_c.c_int32] * 5),
    "infllmv2_select_decode_kvcache": (
        _c.c_int,
        [_c.c_void_p] * 7 + [_c.c_size_t, _c.c_int32, _c.c_int64] + [_c.c_int32] * 12
        + [_c.c_int, _c.c_float, _c.c_int32, _c.c_void_p],
    ),
    "infllmv2_dense_attn_fwd": (
        _c.c_int,
        [_c.c_void_p] * 7 + [_c.c_int32, _c.c_int64, _c.c_int64] + [_c.c_int32] * 6
        + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_dense_attn_bwd_workspace_size": (_c.c_size_t, [_c.c_int64, _c.c_int32]),
    "infllmv2_dense_attn_bwd": (
        _c.c_int,
        [_c.c_void_p] * 12 + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int64] + [_c.c_int32] * 6
        + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_sparse_config_default": (None, [_c.c_void_p]),
    "infllmv2_attention_fwd_workspace_size": (
        _c.c_size_t, [_c.c_int32, _c.c_int64, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_void_p],
    ),
    "infllmv2_attention_fwd": (
        _c.c_int,
        [_c.c_void_p] * 6 + [_c.c_float] + [_c.c_void_p] * 4 + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int64]
        + [_c.c_int32] * 5 + [_c.c_int, _c.c_float, _c.c_void_p, _c.c_void_p],
    ),
    "infllmv2_attention_kvcache_workspace_size": (
        _c.c_size_t, [_c.c_int32, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int64] + [_c.c_int32] * 5 + [_c.c_void_p],
    ),
    "infllmv2_attention_kvcache": (
        _c.c_int,
        [_c.c_void_p] * 7 + [_c.c_float] + [_c.c_void_p] * 5
        + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int64]
        + [_c.c_int32] * 8 + [_c.c_int, _c.c_float, _c.c_void_p, _c.c_void_p],
    ),
    "infllmv2_attention_bwd_workspace_size": (
        _c.c_size_t, [_c.c_int32, _c.c_int64, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_void_p],
    ),
    "infllmv2_attention_bwd": (
        _c.c_int,
        [_c.c_void_p] * 13 + [_c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int64] + [_c.c_int32] * 5
        + [_c.c_int, _c.c_float, _c.c_void_p, _c.c_void_p],
    ),
    "infllmv2_select_blocks": (
        _c.c_int,
        [_c.c_void_p] * 8 + [_c.c_int32, _c.c_int64, _c.c_int64, _c.c_int64] + [_c.c_int32] * 10
        + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_select_blocks_from_keys_workspace_size": (
        _c.c_size_t, [_c.c_int32, _c.c_int64, _c.c_int32, _c.c_int32, _c.c_int32, _c.c_int32],
    ),
    "infllmv2_select_blocks_from_keys": (
        _c.c_int,
        [_c.c_void_p] * 5 + [_c.c_float, _c.c_void_p, _c.c_void_p, _c.c_size_t, _c.c_int32, _c.c_int64, _c.c_int64]
        + [_c.c_int32] * 11 + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_group_scores": (
        _c.c_int,
        [_c.c_void_p] * 8 + [_c.c_int32, _c.c_int64, _c.c_int64, _c.c_int64] + [_c.c_int32] * 7
        + [_c.c_int, _c.c_float, _c.c_void_p],
    ),
    "infllmv2_max_pool_blocks": (
        _c.c_int,
        [_c.c_void_p] * 5 + [_c.c_int32, _c.c_int64] + [_c.c_int32] * 6 + [_c.c_void_p],
    ),
}


def library_path() -> str:
    env = os.environ.get("INFLLMV2_LIBRARY")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libinfllmv2.so")


def lib():
    """The loaded library; raises with the path tried if it cannot be loaded."""
    global _lib
    with _lock:
        if _lib is None:
            path = library_path()
            if not os.path.exists(path):
                raise Infllmv2Error(
                    ERR_UNSUPPORTED,
                    f"infllmv2: the kernel library is not at {path}; install the wheel (pip install .) "
                    "or point INFLLMV2_LIBRARY at a built libinfllmv2.so",
                )
            handle = ctypes.CDLL(path)
            for name, (restype, argtypes) in _SIGNATURES.items():
                fn = getattr(handle, name)
                fn.restype = restype
                fn.argtypes = argtypes
            if handle.infllmv2_abi_version() != ABI_VERSION:
                raise Infllmv2Error(
                    ERR_UNSUPPORTED,
                    f"infllmv2: {path} has ABI version {handle.infllmv2_abi_version()}, this binding needs {ABI_VERSION}",
                )
            _lib = handle
        return _lib


def available() -> bool:
    try:
        lib()
        return True
    except (Infllmv2Error, OSError):
        return False


def check(status: int) -> None:
    """Raise the Python exception matching a non-OK status, with the library's message."""
    if status == OK:
        return
    message = lib().infllmv2_last_error().decode()
    if status == ERR_INVALID_ARGUMENT:
        raise Infllmv2ArgumentError(status, message)
    if status in (ERR_UNSUPPORTED, ERR_UNSUPPORTED_ARCH):
        raise Infllmv2UnsupportedError(status, message)
    raise Infllmv2Error(status, message)


def build_info() -> dict:
    return json.loads(lib().infllmv2_build_info().decode())


def set_arch_override(arch: str | None) -> None:
    check(lib().infllmv2_set_arch_override(arch.encode() if arch else None))


def selected_arch() -> str:
    out = lib().infllmv2_selected_arch()
    if out is None:
        raise Infllmv2Error(ERR_CUDA, lib().infllmv2_last_error().decode())
    return out.decode()
