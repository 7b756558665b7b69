"""The whole InfLLM-V2 attention as one call: the dense-sparse switch over stages 0-2.

``attention`` runs dense causal attention when the longest key sequence is shorter than
``config.dense_len``, and otherwise compression + fused block selection (no gradient) followed
by block-sparse attention (differentiable in q, k, v). Both paths take the same parameters: no
extra weights. ``SparseConfig`` carries MiniCPM4.1's ``sparse_config`` keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from . import _lib, reference
from .ops import (_attention_kvcache_op, _cache_capacity, _check_block_table, _check_compressed_caches,
                  _check_int, _check_kernel_attention, _check_kernel_pages, _check_kv_cache, _check_offsets,
                  _check_punct_cache, _check_tensor3, _equal_cu_seqlens, _index_vector, _max_seqlen, _needs_grad,
                  _scale_or_zero, _stage2, dense_attn_varlen, select_decode)


@dataclasses.dataclass(frozen=True)
class SparseConfig:
    """InfLLM-V2 parameters (MiniCPM4.1's ``sparse_config`` plus the normaliser choice).

    - ``kernel_size`` / ``kernel_stride``: the fine compression window and stride (32 / 16).
    - ``block_size``: tokens per selectable block (64).
    - ``init_blocks``: leading blocks every query attends to (1).
    - ``window_size``: the local window in tokens (2048), i.e. ``window_size // block_size``
      local blocks before the query's own block, all forced into the selection.
    - ``topk``: blocks chosen by score on top of the local window (64), so each query attends
      to ``num_selected = topk + window_size // block_size`` blocks (96).
    - ``dense_len``: batches whose longest key sequence is shorter run dense attention (8192).
    - ``approx_lse``: normalise the stage-1 scores over the coarse keys (``norm_kernel_size`` /
      ``norm_kernel_stride``, 128 / 64) instead of the fine keys (MiniCPM4.1 does).
    - ``phsa_lambda``: weight of the plain mean in the PHSA block representation, used when a
      punctuation mask is passed (``infllmv2.phsa``).
    """

    kernel_size: int = 32
    kernel_stride: int = 16
    block_size: int = 64
    init_blocks: int = 1
    window_size: int = 2048
    topk: int = 64
    dense_len: int = 8192
    approx_lse: bool = True
    norm_kernel_size: int = 128
    norm_kernel_stride: int = 64
    phsa_lambda: float = 0.5

    def __post_init__(self):
        for name in ("kernel_size", "kernel_stride", "block_size", "norm_kernel_size", "norm_kernel_stride"):
            _check_int(getattr(self, name), f"SparseConfig.{name}", 1)
        for name in ("init_blocks", "window_size", "topk", "dense_len"):
            _check_int(getattr(self, name), f"SparseConfig.{name}", 0)
        if self.window_size % self.block_size:
            raise ValueError(f"SparseConfig.window_size ({self.window_size}) must be a multiple of "
                             f"block_size ({self.block_size})")
        if self.block_size % self.kernel_stride:
            raise ValueError(f"SparseConfig.block_size ({self.block_size}) must be a multiple of "
                             f"kernel_stride ({self.kernel_stride})")
        if self.kernel_size < self.kernel_stride:
            raise ValueError(f"SparseConfig.kernel_size ({self.kernel_size}) must be >= kernel_stride "
                             f"({self.kernel_stride})")
        if self.num_selected < 1:
            raise ValueError("SparseConfig: topk + window_size // block_size must be >= 1")
        if not isinstance(self.approx_lse, bool):
            raise ValueError(f"SparseConfig.approx_lse must be a bool, got {self.approx_lse!r}")
        lam = self.phsa_lambda
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0.0 <= float(lam) <= 1.0:
            raise ValueError(f"SparseConfig.phsa_lambda must be a number in [0, 1], got {lam!r}")

    @property
    def local_blocks(self) -> int:
        return self.window_size // self.block_size

    @property
    def num_selected(self) -> int:
        """K, the width of ``topk_idx``: scored blocks plus the local window."""
        return self.topk + self.local_blocks

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SparseConfig":
        """From a model config's ``sparse_config`` dict; unknown keys are an error.

        ``use_nope`` (MiniCPM4.1: compress keys without rotary embedding) is a choice of which
        keys the model passes in, so only ``False`` is accepted here."""
        if not isinstance(d, Mapping):
            raise ValueError(f"sparse_config must be a mapping, got {type(d).__name__}")
        d = dict(d)
        if d.pop("use_nope", False):
            raise ValueError("sparse_config.use_nope=True is not supported: pass the keys to compress yourself")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"sparse_config has unknown keys {unknown}; known: {sorted(known | {'use_nope'})}")
        return cls(**d)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _config(config) -> SparseConfig:
    if config is None:
        return SparseConfig()
    if isinstance(config, SparseConfig):
        return config
    return SparseConfig.from_dict(config)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, config=None,
              softmax_scale=None, punct_mask=None, return_lse=False):
    """InfLLM-V2 attention of packed varlen sequences, bottom-right causal.

    ``q (total_q, Hq, D)``, ``k, v (total_k, Hk, D)``, ``cu_seqlens_q/k`` int32 ``(B+1)``;
    ``config`` a ``SparseConfig`` or a ``sparse_config`` dict (default: MiniCPM4.1's).
    ``punct_mask`` (bool ``(total_k,)``) switches compression to PHSA. ``max_seqlen_q/k`` avoid
    a host read of the offsets when given (the switch needs ``max_seqlen_k``): with both given
    nothing is read on the host and the offsets are trusted (see ``select_blocks``); an offsets
    tensor read for its maximum is also checked.

    Returns ``out (total_q, Hq, D)`` (and ``lse fp32 (Hq, total_q)`` with ``return_lse``),
    differentiable in q, k, v. Same result as ``reference.attention`` with the same config.
    Where the query tiles leave the GPU idle (decoding) the selection runs through
    ``select_decode``, which splits each tile's compressed keys among thread blocks; a sparse call
    that needs no gradient (inference, decoding) runs stage 2 through ``sparse_decode``, which
    splits each query tile's blocks likewise.
    """
    cfg = _config(config)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor3(t, name)
    _check_offsets((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)), q.device)
    # the kernels below read nothing on the host once both lengths are known: offsets read here
    # are checked
    max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q", q.shape[0])
    max_seqlen_k = _max_seqlen(cu_seqlens_k, max_seqlen_k, "max_seqlen_k", k.shape[0])
    if max_seqlen_k < cfg.dense_len:
        if punct_mask is not None and not isinstance(punct_mask, torch.Tensor):
            raise ValueError("punct_mask must be a bool tensor of shape (total_k,) or None")
        return dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                 causal=True, return_lse=return_lse)
    # select_decode is select_blocks itself (bitwise) unless the query tiles leave the GPU idle
    topk_idx = select_decode(
        q, k, cu_seqlens_q, cu_seqlens_k, topk=cfg.num_selected, kernel_size=cfg.kernel_size,
        kernel_stride=cfg.kernel_stride, block_size=cfg.block_size, init_blocks=cfg.init_blocks,
        local_blocks=cfg.local_blocks, approx_lse=cfg.approx_lse, norm_kernel_size=cfg.norm_kernel_size,
        norm_kernel_stride=cfg.norm_kernel_stride, softmax_scale=softmax_scale, punct_mask=punct_mask,
        phsa_lambda=cfg.phsa_lambda, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )
    # the selection's rows are ascending with -1 last, as the kernels read them
    return _stage2(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, softmax_scale,
                   cfg.block_size, return_lse, rows_sorted=True)


def attention_padded(q, k, v, config=None, softmax_scale=None, punct_mask=None, return_lse=False):
    """``attention`` for equal-length sequences in the padded layout.

    ``q (B, Sq, Hq, D)``, ``k, v (B, Sk, Hk, D)``, queries bottom-right aligned (``Sq <= Sk``;
    ``Sq = 1`` is one-token decode against ``Sk`` cached keys), ``punct_mask`` bool ``(B, Sk)``.
    Returns ``out (B, Sq, Hq, D)`` (and ``lse fp32 (B, Hq, Sq)`` with ``return_lse``). A
    reshape over ``attention``: no copy beyond making the inputs contiguous.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (batch, seqlen, heads, head_dim), "
                             f"got {getattr(t, 'shape', type(t).__name__)}")
    B, Sq, Hq, D = q.shape
    if k.shape[0] != B or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be (batch={B}, seqlen_k, heads_k, head_dim)")
    Sk = k.shape[1]
    if punct_mask is not None:
        if not isinstance(punct_mask, torch.Tensor) or punct_mask.shape != (B, Sk):
            raise ValueError(f"punct_mask must be a bool tensor of shape (batch={B}, seqlen_k={Sk})")
        punct_mask = punct_mask.reshape(B * Sk)
    cu_q, cu_k = _equal_cu_seqlens(B, Sq, q.device), _equal_cu_seqlens(B, Sk, q.device)
    res = attention(
        q.reshape(B * Sq, Hq, D).contiguous(), k.reshape(B * Sk, *k.shape[2:]).contiguous(),
        v.reshape(B * Sk, *v.shape[2:]).contiguous(), cu_q, cu_k, Sq, Sk, config, softmax_scale, punct_mask,
        return_lse=True,
    )
    out = res[0].reshape(B, Sq, Hq, D)
    if not return_lse:
        return out
    return out, res[1].reshape(Hq, B, Sq).transpose(0, 1)


def attention_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, ck_cache, nk_cache=None, new_keys=None,
                      block_table=None, config=None, softmax_scale=None, max_seqlen_q=None, max_seqlen_k=None,
                      return_lse=False, punct_cache=None):
    """``attention`` for new tokens against a KV cache (decoding, speculative decoding, chunked
    prefill), forward only, with the compressed keys kept across calls.

    The new tokens' keys and values are in ``k_cache``/``v_cache`` already (``(num_pages,
    page_size, Hk, D)``, padded or paged by ``block_table`` as ``sparse_decode_kvcache`` reads
    them), ``cache_seqlens`` counting them; ``q (total_q, Hq, D)``, packed by ``cu_seqlens_q``, holds
    each sequence's last tokens. ``ck_cache (batch, capacity_c, Hk, D)`` and, with
    ``config.approx_lse``, ``nk_cache`` are the sequences' fine and normaliser compressed caches
    (``ops.compressed_capacity`` sizes them; zeros or anything to start with): the call first
    brings them up to date for the last ``new_keys`` keys (default ``max_seqlen_q``, the new
    tokens), as ``compress_keys_kvcache`` does, so that a step compresses only the keys it added,
    not the whole cache (SPEC.md, Decode). Then, as ``attention``: dense attention
    (``dense_decode_kvcache``, any ``dense_len``) when ``max_seqlen_k`` (the longest sequence;
    read from ``cache_seqlens`` on the host when not given) is below ``config.dense_len``, else
    ``select_decode_kvcache`` and ``sparse_decode_kvcache``. Returns ``out`` (and ``lse (Hq, total_q)`` with ``return_lse``).

    On CUDA the step is one call of the C library's ``infllmv2_attention_kvcache`` (both compressed
    caches in one launch; the library's split counts), with no host synchronisation when
    ``max_seqlen_q`` and ``max_seqlen_k`` are given; CPU runs ``reference.attention_kvcache``.

    ``punct_cache`` (bool ``(num_pages, page_size)``, each cached key's punctuation flag laid out
    as ``k_cache``): both compressed caches are updated with PHSA (``config.phsa_lambda``), as
    ``attention`` with a ``punct_mask`` compresses (in the same C call on CUDA).
    """
    cfg = _config(config)
    _check_tensor3(q, "q")
    _check_offsets((("cu_seqlens_q", cu_seqlens_q),), q.device)
    _check_kv_cache(q, k_cache, v_cache)
    batch = cu_seqlens_q.numel() - 1
    cache_seqlens = _index_vector(cache_seqlens, "cache_seqlens", batch, q.device)
    block_table = _check_block_table(block_table, k_cache, batch)
    capacity = _cache_capacity(k_cache, block_table)
    if cfg.approx_lse and nk_cache is None:
        raise ValueError("nk_cache (the normaliser keys' compressed cache) is needed with config.approx_lse; pass "
                         "one, or a config with approx_lse=False")
    nk_cache = nk_cache if cfg.approx_lse else None
    _check_compressed_caches(q, ck_cache, nk_cache, batch, capacity, cfg.kernel_size, cfg.kernel_stride,
                             cfg.norm_kernel_size, cfg.norm_kernel_stride)
    for name, t in (("ck_cache", ck_cache), ("nk_cache", nk_cache)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (it is written in place)")
    max_seqlen_q = _max_seqlen(cu_seqlens_q, max_seqlen_q, "max_seqlen_q", q.shape[0])
    new_keys = max_seqlen_q if new_keys is None else new_keys
    _check_int(new_keys, "new_keys", 0)
    if max_seqlen_k is None:
        max_seqlen_k = int(cache_seqlens.max().item()) if batch else 0
    _check_int(max_seqlen_k, "max_seqlen_k", 0)
    if _needs_grad(q, k_cache, v_cache):
        raise ValueError("attention_kvcache is forward only, but q or the cache requires grad: call it under "
                         "torch.no_grad()")
    lam = cfg.phsa_lambda if punct_cache is None else _check_punct_cache(punct_cache, k_cache, cfg.phsa_lambda)
    if not q.is_cuda:
        out, lse, ck, nk = reference.attention_kvcache(
            q, k_cache, v_cache, cache_seqlens.clamp(0, capacity), cu_seqlens_q, ck_cache, nk_cache, new_keys,
            block_table, cfg.dense_len, softmax_scale, cfg.num_selected, cfg.kernel_size, cfg.kernel_stride,
            cfg.block_size, cfg.init_blocks, cfg.local_blocks, cfg.approx_lse, cfg.norm_kernel_size,
            cfg.norm_kernel_stride, punct_cache, lam)
        ck_cache.copy_(ck)
        if nk_cache is not None:
            nk_cache.copy_(nk)
    else:
        _check_kernel_attention(q, (("k_cache", k_cache), ("v_cache", v_cache)), k_cache.shape[2])
        _check_kernel_pages(block_table, k_cache)
        fields = [int(getattr(cfg, name)) for name, _ in _lib.SparseConfigC._fields_]
        out, lse = _attention_kvcache_op(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, ck_cache, nk_cache,
                                         block_table, new_keys, max_seqlen_q, max_seqlen_k, fields,
                                         _scale_or_zero(softmax_scale), punct_cache, float(lam))
    return (out, lse) if return_lse else out
