"""The original InfLLM-V2 package's calls (``infllm_v2``) over this library's ops.

Same names, signatures and meaning (the project's ORIGINAL_API.md), so that a model written
against the original switches by changing one import::

    from infllmv2.compat import infllmv2_attn_stage1, max_pooling_1d_varlen, infllmv2_attn_varlen_func
    from infllmv2.compat import infllmv2_attn_with_kvcache

Mapping:

- ``infllmv2_attn_stage1`` -> ``ops.group_scores`` (fine keys 32/16 in ``k``, the normaliser
  keys in ``v``), cast to q's dtype as the original returns it.
- ``max_pooling_1d_varlen`` / ``max_pooling_1d`` -> ``ops.max_pool_blocks`` (window
  ``block_size/stride + 1``, padding 1, compression window ``2*stride``), in the input's dtype.
- ``infllmv2_attn_varlen_func`` -> ``ops.sparse_attn_varlen`` with ``topk_idx`` (autograd),
  ``ops.dense_attn_varlen`` without.
- ``infllmv2_attn_with_kvcache`` -> ``ops.sparse_decode_kvcache`` (padded or paged cache,
  in-place append of new keys and values, FlashAttention's rotary embedding; forward only).

Accepted only at their defaults (anything else is a ``ValueError`` naming the argument):
``dropout_p=0``, ``window_size=(-1, -1)``, ``softcap=0``, ``alibi_slopes=None``,
``block_table=None`` (paged KV). ``deterministic`` and stage 1's ``return_attn_probs`` are
accepted and ignored: the backward is always deterministic, and stage 1 always returns its
scores (as the original does). The original returns no probabilities from the varlen call
either when ``dropout_p == 0``, so ``return_attn_probs=True`` gives ``(out, lse, None)``.

Beyond the original: any group size G = Hq / Hk (the original: 16), head dim 64 or 128 (the
original: 128), fp16 as well as bf16, CPU tensors (through the reference), and no host
synchronisation in stage 1 or stage 2 (the original reads offsets back in its backward and
pooling). ``max_pooling_1d_varlen`` keeps one host read, ``max(cache_lens)``, which its output
width is defined by (none when ``cache_lens`` is a CPU tensor).

Where the results differ from the original's, on purpose:

- Stage 1 places queries by one consistent rule (see ``infllmv2_attn_stage1``), which is the
  original's own alignment wherever that is self-consistent; the original drops one
  compressed key at some lengths (``Lq % 16 == 15``, causal chunks of fewer than 16 queries)
  through an integer-rounding slip, and places the coarse normaliser keys on their own 64-token
  grid (up to 63 positions off the fine keys' in a cached chunk).
- Pooling gives -inf (the original: 0, +inf to init blocks) to blocks after the query's own
  block, so that ``torch.topk`` never prefers a future block to a past one; selections made the
  MiniCPM way (top-K, then indices beyond the query's block set to -1) are the same or better.
- The varlen call's sparse kernels handle ``K <= 128`` blocks per row on CUDA (MiniCPM4.1: 96).
- New: the keyword-only ``cache_lens`` of ``infllmv2_attn_stage1`` (exact positions).
"""

from __future__ import annotations

import operator

import torch

from . import ops
from .ops import _check_offsets, _equal_cu_seqlens, _lengths, _offsets_of

_FINE = (32, 16)  # the original's compression: window 32, stride 16 (MiniCPM4.1 sparse_config)
_COARSE = (128, 64)  # its normaliser keys
_DEFAULT_ONLY = (("dropout_p", 0.0), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                 ("block_table", None))


def _check_defaults(*values):
    """The original's flash-attention knobs that MiniCPM never sets, in _DEFAULT_ONLY order."""
    for (name, default), value in zip(_DEFAULT_ONLY, values):
        if default is None:
            ok = value is None
        elif isinstance(default, tuple):
            ok = isinstance(value, (tuple, list)) and tuple(value) == default
        else:
            ok = not isinstance(value, torch.Tensor) and value == default
        if not ok:
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(f"{name} must be {default!r} in infllmv2.compat (the only value supported), got {shown}")


def _as_int(value, name, minimum=0):
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _cache_lens(cache_lens, batch, device):
    if not isinstance(cache_lens, torch.Tensor) or cache_lens.dim() != 1 or cache_lens.numel() != batch:
        raise ValueError(f"cache_lens must be a 1-D integer tensor of {batch} entries (one per sequence), got "
                         f"{tuple(cache_lens.shape) if isinstance(cache_lens, torch.Tensor) else type(cache_lens).__name__}")
    if cache_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cache_lens must be int32 or int64, got {cache_lens.dtype}")
    return cache_lens.to(device=device, dtype=torch.int32, non_blocking=True)


def infllmv2_attn_stage1(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                         softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         deterministic=False, return_attn_probs=True, block_table=None, *, cache_lens=None):
    """Stage-1 scores ``(Hk, total_q, max_seqlen_k)`` in q's dtype; no gradient.

    ``q (total_q, Hq, D)``; ``k (total_k1, Hk, D)`` the fine compressed keys (window 32, stride
    16) with offsets ``cu_seqlens_k``; ``v`` the normaliser keys with ``cu_seqlens_v``: the coarse
    keys (window 128, stride 64) for the LSE approximation, or keys with as many rows as ``k``
    (``v is k``: the exact normaliser) normalised with the fine keys' visibility, as the original
    does when the two lengths agree. Entry ``[g, row, j]`` = sum over the G heads of group g of
    ``exp(scale * q . k_j - LSE)`` for the visible compressed keys j of the row's sequence, 0 for
    the others and past the sequence's keys (NaN never appears; it would be 0 as in the original).

    Positions. The original receives no full key lengths; its causal mask aligns each sequence's
    queries bottom-right in compressed space, which is the window-visibility rule
    ``j*16 + 31 <= p``, ``p = Lk - Lq + i``, for the key length ``Lk`` that has exactly the
    sequence's ``n`` compressed keys and ``Lk = Lq (mod 16)`` (its kernel computes
    ``Lk - Lq = 16 * (n - trunc((Lq - 15) / 16))``). That is the true length in prefill and in
    chunks whose cache length is a multiple of 16, and the rule used here with ``causal=True``.
    ``cache_lens`` (int ``(B,)``, keyword, not in the original) gives exact positions instead:
    ``p = cache_lens[b] + i``, the compressed keys coming from ``cache_lens[b] + Lq`` keys.
    ``causal=False`` (MiniCPM4.1's decode) shows every compressed key to every query, which needs
    one query per sequence (``max_seqlen_q <= 1``): the last token sees every complete window.
    The coarse keys use the same positions. All of this runs on the device, without host reads.
    """
    _check_defaults(dropout_p, window_size, softcap, alibi_slopes, block_table)
    max_seqlen_q = _as_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _as_int(max_seqlen_k, "max_seqlen_k")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (tokens, heads, head_dim)")
    _check_offsets((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("cu_seqlens_v", cu_seqlens_v)),
                   q.device)
    if not causal and max_seqlen_q > 1:
        # the library's scoring is causal by construction; without a mask only a sequence's last
        # token is placed right, so several queries per sequence cannot be honoured
        raise ValueError(f"causal=False needs one query per sequence (max_seqlen_q <= 1, decode), got "
                         f"max_seqlen_q={max_seqlen_q}; use causal=True for prefill")
    w, s = _FINE
    lq = _lengths(cu_seqlens_q)
    if cache_lens is not None:
        lk = _cache_lens(cache_lens, lq.numel(), q.device) + lq
    else:
        n = _lengths(cu_seqlens_k)
        shortest = (n - 1) * s + w  # the shortest key length with n windows; n+1 starts s later
        lk = torch.where(n > 0, shortest + torch.remainder(lq - shortest, s), lq)
    if v is k:
        norm, cu_norm, norm_w, norm_s = None, None, w, s
    elif v.shape[0] == k.shape[0]:
        # as many normaliser keys as fine keys: the original's "no compressed LSE" case
        norm, cu_norm, (norm_w, norm_s) = v.detach(), cu_seqlens_v, _FINE
    else:
        norm, cu_norm, (norm_w, norm_s) = v.detach(), cu_seqlens_v, _COARSE
    S = ops.group_scores(q.detach(), k.detach(), cu_seqlens_q, _offsets_of(lk), cu_seqlens_k, w, s, softmax_scale,
                         norm, cu_norm, norm_w, norm_s, width=max(max_seqlen_k, 1), max_seqlen_q=max_seqlen_q)
    S = S[:, :, :max_seqlen_k]
    return S.masked_fill_(torch.isnan(S), 0.0).to(q.dtype)


def _pool(input, cu_seqlens_q, cu_seqlens_c, lk, n_blocks, max_seqlen_q, local_blocks, init_blocks, block_size, stride):
    if not isinstance(input, torch.Tensor) or input.dim() != 3 or not input.is_floating_point():
        raise ValueError("input must be a floating-point 3-D tensor (heads_k, total_q, width) of stage-1 scores")
    if input.shape[1] == 0:
        return input.new_empty((input.shape[0], 0, n_blocks))
    # a batch too short for any compressed key has 0 columns; one ignored column keeps the kernel's shape rule
    scores = torch.nn.functional.pad(input, (0, 1)) if input.shape[2] == 0 else input
    out = ops.max_pool_blocks(scores, cu_seqlens_q, _offsets_of(lk), cu_seqlens_c, 2 * stride, stride, block_size,
                              init_blocks, local_blocks, n_blocks=max(n_blocks, 1), max_seqlen_q=max_seqlen_q)
    # pooled in fp32: a max of fp32/bf16/fp16 inputs (or +-inf) is exact in the input's dtype,
    # which the original returns
    return out[:, :, :n_blocks].to(input.dtype)


def max_pooling_1d_varlen(input, cu_seqlens_q, cu_seqlens_k, cache_lens, max_seqlen_q, max_seqlen_k, local_blocks,
                          init_blocks, block_size=64, stride=16):
    """Block scores ``(Hk, total_q, ceil((max_seqlen_q + max(cache_lens)) / block_size))``.

    ``input`` the stage-1 scores ``(Hk, total_q, width)``, ``cu_seqlens_k`` the compressed keys'
    offsets (window ``2*stride``, stride ``stride``), ``cache_lens`` int ``(B,)`` the tokens
    cached before each sequence's first query: query i of sequence b sits at
    ``p = cache_lens[b] + i`` among ``cache_lens[b] + Lq`` keys. ``+inf`` for blocks
    ``b < init_blocks`` and ``p//block_size - local_blocks <= b <= p//block_size``; otherwise the
    max of the visible compressed scores ``m*b - 1 .. m*b + m - 1`` (``m = block_size/stride``),
    -inf if none and for blocks after the query's own. In the input's dtype.

    ``max_seqlen_k`` is accepted for the original's signature; the input's width is used.
    The positions are computed on the device; the output width needs one host read of
    ``max(cache_lens)`` (a GPU synchronisation when ``cache_lens`` is a CUDA tensor).
    """
    max_seqlen_q = _as_int(max_seqlen_q, "max_seqlen_q")
    _as_int(max_seqlen_k, "max_seqlen_k")
    block_size = _as_int(block_size, "block_size", 1)
    if not isinstance(input, torch.Tensor):
        raise ValueError(f"input must be a torch.Tensor, got {type(input).__name__}")
    _check_offsets((("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)), input.device)
    batch = cu_seqlens_q.numel() - 1
    cache = _cache_lens(cache_lens, batch, input.device)
    max_cache = int(cache_lens.max()) if batch else 0  # the one host read, on cache_lens' own device
    n_blocks = -(-(max_seqlen_q + max_cache) // block_size)
    return _pool(input, cu_seqlens_q, cu_seqlens_k, cache + _lengths(cu_seqlens_q), n_blocks, max_seqlen_q,
                 local_blocks, init_blocks, block_size, stride)


def max_pooling_1d(input, cache_len, local_blocks, init_blocks, block_size=64, stride=16):
    """``max_pooling_1d_varlen`` for one sequence: ``input (Hk, q_len, k_len)``, an int ``cache_len``.

    Output ``(Hk, q_len, ceil((q_len + cache_len) / block_size))``; no host synchronisation.
    """
    if not isinstance(input, torch.Tensor) or input.dim() != 3:
        raise ValueError("input must be a 3-D tensor (heads_k, q_len, k_len) of stage-1 scores")
    cache_len = _as_int(cache_len, "cache_len")
    block_size = _as_int(block_size, "block_size", 1)
    stride = _as_int(stride, "stride", 1)
    q_len = input.shape[1]
    lk = cache_len + q_len
    n_c = (lk - 2 * stride) // stride + 1 if lk >= 2 * stride else 0
    cu = torch.tensor([0, q_len, 0, n_c, lk], dtype=torch.int32).to(input.device, non_blocking=True)
    return _pool(input, cu[:2], cu[2:4], cu[4:], -(-lk // block_size), q_len, local_blocks, init_blocks, block_size,
                 stride)


def infllmv2_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, block_table=None, topk_idx=None):
    """Varlen attention with autograd: block-sparse over ``topk_idx``, dense when it is None.

    ``q (total_q, Hq, D)``, ``k, v (total_k, Hk, D)``; ``topk_idx`` int ``(Hk, total_q, K)`` of
    per-sequence 64-token block indices (-1 unused, any order). With ``topk_idx`` the attention
    is causal at token granularity, bottom-right aligned, which is what ``causal=True`` means in
    the original and, for one query per sequence, ``causal=False`` too (a decode token sees its
    whole cache): MiniCPM4.1's ``causal = max_seqlen_q != 1``; ``causal=False`` with several
    queries per sequence is rejected. Without ``topk_idx``, ``causal`` is honoured either way.

    Returns ``out``, or with ``return_attn_probs`` ``(out, softmax_lse, None)``: ``softmax_lse``
    fp32 ``(Hq, total_q)`` for dense attention, and in the original's sparse layout
    ``(Hk, total_q * G)`` (entry ``[g, t*G + h]`` for query head ``g*G + h``) with ``topk_idx``.
    The backward is deterministic. Calls that need no gradient run ``ops.sparse_decode``.
    """
    _check_defaults(dropout_p, window_size, softcap, alibi_slopes, block_table)
    max_seqlen_q = _as_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = _as_int(max_seqlen_k, "max_seqlen_k")
    if topk_idx is None:
        out, lse = ops.dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                         softmax_scale, causal=bool(causal), return_lse=True)
        return (out, lse, None) if return_attn_probs else out
    if not causal and max_seqlen_q > 1:
        raise ValueError(f"causal=False with topk_idx needs one query per sequence (max_seqlen_q <= 1, decode), got "
                         f"max_seqlen_q={max_seqlen_q}: the sparse kernels mask at token granularity")
    out, lse = ops._stage2(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, max_seqlen_q, max_seqlen_k, softmax_scale,
                           block_size=64, return_lse=True, rows_sorted=False)
    if not return_attn_probs:
        return out
    hk = k.shape[1]
    # the original runs the sparse kernel on q viewed as (total_q * G, Hk, D), rows t*G + h
    lse = lse.view(hk, q.shape[1] // hk, q.shape[0]).transpose(1, 2).reshape(hk, -1)
    return out, lse, None


_KVCACHE_UNSUPPORTED = ("cache_leftpad", "alibi_slopes")


def _check_rotary(rotary_cos, rotary_sin, q, k, capacity):
    """The rotary tables of infllmv2_attn_with_kvcache, as FlashAttention takes them: both or
    neither, ``(seqlen_ro, rotary_dim / 2)`` floating point on q's device, ``rotary_dim`` even and
    at most the head dim, a row for every position of the cache, and new keys to rotate."""
    if rotary_cos is None and rotary_sin is None:
        return False
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together, or neither")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor of shape (seqlen_ro, rotary_dim / 2), got "
                             + (f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor)
                                else type(t).__name__))
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if rotary_sin.shape != rotary_cos.shape:
        raise ValueError(f"rotary_sin must have rotary_cos's shape {tuple(rotary_cos.shape)}, got "
                         f"{tuple(rotary_sin.shape)}")
    seqlen_ro, half = rotary_cos.shape
    if half < 1 or 2 * half > q.shape[3]:
        raise ValueError(f"rotary_cos/rotary_sin must have rotary_dim / 2 columns with 2 <= rotary_dim <= head_dim="
                         f"{q.shape[3]}, got {half}")
    if seqlen_ro < capacity:
        raise ValueError(f"rotary_cos/rotary_sin must have a row for every position of the cache, at least "
                         f"{capacity}, got {seqlen_ro}")
    if k is None:
        raise ValueError("rotary_cos/rotary_sin need the new tokens' k and v: the queries are rotated at the "
                         "positions after cache_seqlens, where the new keys go")
    return True


def _rotate(x, cos, sin, pos, interleaved):
    """x (B, S, H, D) with its first rotary_dim features rotated by the rows ``pos (B, S)`` of the
    tables: pairs (2i, 2i + 1) if interleaved, else (i, i + rotary_dim / 2) (GPT-NeoX), computed
    in fp32 (or x's wider dtype) and rounded once to x's dtype."""
    half = cos.shape[1]
    wide = torch.promote_types(x.dtype, torch.float32)
    c = cos.to(wide)[pos].unsqueeze(2)
    s = sin.to(wide)[pos].unsqueeze(2)
    xr = x[..., :2 * half].to(wide)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def infllmv2_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                               cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                               topk_idx=None):
    """FlashAttention's ``flash_attn_with_kvcache`` with a block selection, forward only.

    ``q (B, Sq, Hq, D)``. The cache: ``k_cache, v_cache (B_cache, S, Hk, D)`` padded (row ``b`` of
    the batch is cache entry ``cache_batch_idx[b]``, or ``b``), or paged ``(num_pages, page_size,
    Hk, D)`` with ``block_table`` int32 ``(B, pages_per_seq)`` (``page_size`` a multiple of 64).
    ``cache_seqlens`` (int, or int ``(B,)``; None: the whole capacity) counts the keys already
    cached. ``k, v (B, Sn, Hk, D)``, if given, are written into the cache in place at positions
    ``cache_seqlens[b] ..`` (on the device, no host read), and attention then covers
    ``cache_seqlens[b] + Sn`` keys. The queries are each sequence's last ``Sq`` tokens.
    ``topk_idx`` int ``(Hk, B * Sq, K)`` of 64-token block indices (-1 unused, any order) runs
    ``ops.sparse_decode_kvcache``; None runs dense attention (``ops.dense_decode_kvcache``, any
    capacity). Returns ``out (B, Sq, Hq, D)``, and with ``return_softmax_lse`` also ``softmax_lse``
    fp32 ``(B, Hq, Sq)``, FlashAttention's layout.

    ``rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2)``, with ``k`` and ``v``, rotate, as
    FlashAttention does, the first ``rotary_dim`` features of the new keys (before they are
    written) at positions ``cache_seqlens[b] + i`` and of the queries at the same positions with
    ``causal`` (else all at ``cache_seqlens[b]``), pairing features ``(2i, 2i + 1)`` with
    ``rotary_interleaved`` and ``(i, i + rotary_dim / 2)`` without; in fp32, rounded once to the
    inputs' dtype. ``seqlen_ro`` must cover the cache's capacity.

    Not supported (a ``ValueError`` naming the argument): ``cache_leftpad``, ``alibi_slopes``,
    ``window_size`` other than ``(-1, -1)``,
    ``softcap``, and ``causal=False`` with ``Sq > 1`` (the kernels mask causally at token
    granularity; one query a sequence sees its whole cache either way). ``cache_seqlens`` plus
    ``Sn`` beyond the capacity is the caller's error, as in FlashAttention: such keys are
    written to the last row of the capacity and the lengths clamped to it (no access outside
    the cache). ``num_splits`` 0 lets the library pick, else at most 64 (128 without ``topk_idx``).
    """
    for name, value in zip(_KVCACHE_UNSUPPORTED, (cache_leftpad, alibi_slopes)):
        if value is not None:
            raise ValueError(f"{name} must be None in infllmv2.compat.infllmv2_attn_with_kvcache (not supported)")
    _check_defaults(0.0, window_size, softcap, None, None)
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a tensor of shape (batch, seqlen_q, heads, head_dim)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a tensor of shape (batch_cache or num_pages, seqlen or page_size, "
                             f"heads_k, head_dim)")
    batch, seqlen_q, heads, head_dim = q.shape
    pages, page_size, heads_k = k_cache.shape[:3]
    if not causal and seqlen_q > 1:
        raise ValueError(f"causal=False needs one query a sequence (seqlen_q = 1), got seqlen_q={seqlen_q}: the sparse "
                         "kernels mask causally at token granularity")
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError("cache_batch_idx must be None with a block_table (a paged cache)")
    if cache_batch_idx is not None:
        # a padded cache read by batch entry is a paged one with one page a sequence
        table = ops._index_vector(cache_batch_idx, "cache_batch_idx", batch, q.device).view(batch, 1)
    else:
        table = block_table
    capacity = page_size * (table.shape[1] if isinstance(table, torch.Tensor) and table.dim() == 2 else 1)
    if cache_seqlens is None:
        lens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        lens = torch.full((batch,), _as_int(cache_seqlens, "cache_seqlens"), dtype=torch.int32, device=q.device)
    else:
        lens = ops._index_vector(cache_seqlens, "cache_seqlens", batch, q.device)
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new tokens' keys and values), or neither")
    rotary = _check_rotary(rotary_cos, rotary_sin, q, k, capacity)
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != k_cache.shape[2:]:
                raise ValueError(f"{name} must have shape (batch={batch}, seqlen_new, heads_k={heads_k}, "
                                 f"head_dim={k_cache.shape[3]}), got "
                                 + (f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__))
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"k and v must hold as many new tokens, got {k.shape[1]} and {v.shape[1]}")
        if isinstance(table, torch.Tensor) and (table.dim() != 2 or table.shape[0] != batch):
            raise ValueError(f"block_table must have shape (batch={batch}, pages_per_seq), got {tuple(table.shape)}")
        pos = (lens.view(batch, 1) + torch.arange(k.shape[1], device=q.device, dtype=torch.int32)).clamp_(max=capacity - 1)
        if rotary:
            # positions as FlashAttention's: the new keys' own, and the queries' the same with
            # causal (they are the sequences' last tokens), else all at cache_seqlens
            q_pos = (lens.view(batch, 1) + torch.arange(seqlen_q, device=q.device, dtype=torch.int32) * int(causal))
            q = _rotate(q, rotary_cos, rotary_sin, q_pos.clamp_(0, capacity - 1).long(), rotary_interleaved)
            k = _rotate(k, rotary_cos, rotary_sin, pos.clamp(min=0).long(), rotary_interleaved)
        if isinstance(table, torch.Tensor):
            page = table.to(device=q.device, dtype=torch.long).gather(1, (pos // page_size).long())
        else:
            page = torch.arange(batch, device=q.device).view(batch, 1).expand_as(pos)
        row = (pos % page_size).long()
        k_cache[page, row] = k.to(k_cache.dtype)
        v_cache[page, row] = v.to(v_cache.dtype)
        lens = lens + k.shape[1]
    cu_q = _equal_cu_seqlens(batch, seqlen_q, q.device)
    q_rows = q.reshape(batch * seqlen_q, heads, head_dim)
    if topk_idx is None:
        out, lse = ops.dense_decode_kvcache(q_rows, k_cache, v_cache, lens, cu_q, table, max_seqlen_q=seqlen_q,
                                            softmax_scale=softmax_scale, num_splits=_as_int(num_splits, "num_splits"),
                                            return_lse=True)
    else:
        out, lse = ops.sparse_decode_kvcache(q_rows, k_cache, v_cache, lens, cu_q, topk_idx, table,
                                             max_seqlen_q=seqlen_q, softmax_scale=softmax_scale,
                                             num_splits=_as_int(num_splits, "num_splits"), return_lse=True)
    out = out.view(batch, seqlen_q, heads, head_dim)
    if not return_softmax_lse:
        return out
    return out, lse.view(heads, batch, seqlen_q).permute(1, 0, 2)
