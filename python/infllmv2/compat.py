"""The original InfLLM-V2 package's calls (``infllm_v2``), same names, signatures and meaning,
over this library's ops: a model written against the original switches by changing one import
(``from infllmv2.compat import ...``). See ../shared/ORIGINAL_API.md for the meaning.

What differs, and why:
- Any group size G = Hq / Hk and head dim 64 or 128, bf16 or fp16 (the original: G = 16, D = 128,
  bf16). Compression is 32/16 (coarse 128/64) and blocks are 64 tokens, as in the original.
- Arguments the original accepts but MiniCPM4.1 leaves at their defaults (dropout, window,
  softcap, ALiBi, paged ``block_table``, the probabilities of ``return_attn_probs``) must stay
  at their defaults here; anything else is a ``ValueError`` naming the argument.
- ``max_pooling_1d(_varlen)`` gives -inf (not 0) to blocks after the query's own block, so that
  ``torch.topk`` never prefers them to a past block; selections made the MiniCPM way (top-K,
  then indices beyond the query's block set to -1) are the same or better.
- No host synchronisation, except ``max_pooling_1d_varlen``'s output width, which reads
  ``max(cache_lens)`` once, as its definition needs.
- ``infllmv2_attn_with_kvcache`` is not offered yet.

Positions. ``infllmv2_attn_stage1`` sees only compressed keys. With ``causal=True`` its queries
are a prefill: query i of a sequence sits at position ``cache_lens[b] + i`` (``cache_lens``, a
keyword this module adds, defaults to 0, the original's behaviour), and the compressed keys
must come from that sequence's ``cache_lens[b] + Lq`` keys. With ``causal=False`` (MiniCPM4.1's
one-token decode) every compressed key is visible. ``max_pooling_1d_varlen`` places query i at
``cache_lens[b] + i``, as in the original.
"""

from __future__ import annotations

import torch

from . import ops

_FINE = (32, 16)  # the original's compression: window 32, stride 16
_COARSE = (128, 64)  # and its normaliser keys


def _check_default(name, value, default):
    if value != default:
        raise ValueError(f"{name}={value!r} is not supported by infllmv2.compat (only the default {default!r})")


def _lengths(cu):
    return cu[1:] - cu[:-1]


def _offsets_from(lengths):
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)


def _cache_lens(cache_lens, batch, device, name="cache_lens"):
    if cache_lens is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    if not isinstance(cache_lens, torch.Tensor) or cache_lens.dim() != 1 or cache_lens.numel() != batch:
        raise ValueError(f"{name} must be a 1-D integer tensor of {batch} entries (one per sequence)")
    if cache_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {cache_lens.dtype}")
    return cache_lens.to(device=device, dtype=torch.int32)


def infllmv2_attn_stage1(q, k, v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_v, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                         softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         deterministic=False, return_attn_probs=True, block_table=None, *, cache_lens=None):
    """Stage-1 scores ``(Hk, total_q, max_seqlen_k)`` in q's dtype.

    ``k``: fine compressed keys (32/16) with offsets ``cu_seqlens_k``; ``v``: the coarse keys
    (128/64) with ``cu_seqlens_v``, used only as the softmax normaliser (``v is k`` with the same
    offsets: the exact normaliser). Entry ``[g, row, j]`` is the sum over the G heads of group g
    of ``exp(scale * q . k_j - LSE)`` for visible j, else 0. No gradient.
    """
    for name, value, default in (("dropout_p", dropout_p, 0.0), ("window_size", tuple(window_size), (-1, -1)),
                                 ("softcap", softcap, 0.0), ("alibi_slopes", alibi_slopes, None),
                                 ("block_table", block_table, None)):
        _check_default(name, value, default)
    batch = cu_seqlens_q.numel() - 1
    lq, nc = _lengths(cu_seqlens_q), _lengths(cu_seqlens_k)
    w, s = _FINE
    if causal:
        lk = _cache_lens(cache_lens, batch, q.device) + lq
    else:
        if int(max_seqlen_q) > 1:
            raise ValueError("causal=False needs one query per sequence (max_seqlen_q <= 1, decode); "
                             f"got max_seqlen_q={max_seqlen_q}")
        # the shortest key length with exactly these windows: its last window ends at the query
        lk = torch.clamp(torch.where(nc > 0, (nc - 1) * s + w, 0), min=1)
    exact = v is k and (cu_seqlens_v is cu_seqlens_k or torch.equal(cu_seqlens_v, cu_seqlens_k))
    with torch.no_grad():
        S = ops.group_scores(
            q.detach(), k.detach(), cu_seqlens_q, _offsets_from(lk), cu_seqlens_k, w, s, softmax_scale,
            None if exact else v.detach(), None if exact else cu_seqlens_v, *_COARSE,
            width=max(int(max_seqlen_k), 1), max_seqlen_q=int(max_seqlen_q),
        )
    return torch.nan_to_num(S[:, :, : int(max_seqlen_k)], nan=0.0).to(q.dtype)


def max_pooling_1d_varlen(input, cu_seqlens_q, cu_seqlens_k, cache_lens, max_seqlen_q, max_seqlen_k, local_blocks,
                          init_blocks, block_size=64, stride=16):
    """Block scores ``(Hk, total_q, ceil((max_seqlen_q + max(cache_lens)) / block_size))`` fp32.

    ``input``: stage-1 scores ``(Hk, total_q, width)``; ``cu_seqlens_k``: the compressed keys'
    offsets; query i of sequence b sits at ``cache_lens[b] + i``. +inf for init and local
    blocks, the max over the 5 compressed scores of the block otherwise (-inf if none)."""
    if not isinstance(input, torch.Tensor) or input.dim() != 3:
        raise ValueError("input must be a 3-D tensor (heads_k, total_q, width) of stage-1 scores")
    batch = cu_seqlens_q.numel() - 1
    cache = _cache_lens(cache_lens, batch, input.device)
    lk = cache + _lengths(cu_seqlens_q)
    n_blocks = -(-(int(max_seqlen_q) + int(cache.max().item() if batch else 0)) // block_size)
    return ops.max_pool_blocks(input, cu_seqlens_q, _offsets_from(lk), cu_seqlens_k, 2 * stride, stride, block_size,
                               init_blocks, local_blocks, n_blocks=max(n_blocks, 1), max_seqlen_q=int(max_seqlen_q))


def max_pooling_1d(input, cache_len, local_blocks, init_blocks, block_size=64, stride=16):
    """``max_pooling_1d_varlen`` for one sequence: ``input (Hk, q_len, k_len)``, scalar ``cache_len``."""
    if not isinstance(input, torch.Tensor) or input.dim() != 3:
        raise ValueError("input must be a 3-D tensor (heads_k, q_len, k_len) of stage-1 scores")
    q_len, k_len = input.shape[1], input.shape[2]
    dev = input.device
    cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    cu_c = torch.tensor([0, k_len], dtype=torch.int32, device=dev)
    cache = torch.tensor([int(cache_len)], dtype=torch.int32, device=dev)
    return max_pooling_1d_varlen(input, cu_q, cu_c, cache, q_len, k_len, local_blocks, init_blocks, block_size, stride)


def infllmv2_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, block_table=None, topk_idx=None):
    """Stage 2 with autograd (``topk_idx`` int32 ``(Hk, total_q, K)``), or dense attention when
    ``topk_idx`` is None. Returns ``out``, or ``(out, softmax_lse, None)`` with
    ``return_attn_probs``. The backward is always deterministic."""
    for name, value, default in (("dropout_p", dropout_p, 0.0), ("window_size", tuple(window_size), (-1, -1)),
                                 ("softcap", softcap, 0.0), ("alibi_slopes", alibi_slopes, None),
                                 ("block_table", block_table, None)):
        _check_default(name, value, default)
    if topk_idx is None:
        out, lse = ops.dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                         softmax_scale, causal=bool(causal), return_lse=True)
    else:
        if not causal and int(max_seqlen_q) > 1:
            # the sparse kernels mask at token granularity, bottom-right: for one query per
            # sequence that is no mask at all, which is how MiniCPM4.1 calls it (causal=False)
            raise ValueError("causal=False with topk_idx needs max_seqlen_q <= 1 (decode); the sparse path is causal")
        out, lse = ops.sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, int(max_seqlen_q),
                                          int(max_seqlen_k), softmax_scale, return_lse=True)
    return (out, lse, None) if return_attn_probs else out
