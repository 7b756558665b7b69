"""Pure-PyTorch reference ("oracle") for InfLLM-V2 sparse attention.

Every kernel of the library is checked against these functions, and they double as the
PyTorch baseline on the GPU. They follow ``SPEC.md``:

* Packed varlen layout: ``q (total_q, Hq, D)``, ``k, v (total_k, Hk, D)``, ``cu_seqlens_*``
  int32 ``(B+1)``. ``G = Hq // Hk``; query head ``h`` uses KV head ``h // G``.
* Bottom-right causal alignment: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys
  sits at position ``p = Lk - Lq + i`` and may see key positions ``<= p``.
* All index outputs are per sequence (relative to the sequence's own start).

Precision: each function computes in the dtype of its inputs (matmuls, softmax, exp), so that
the same call on ``bf16`` inputs and on their ``.float()`` copies measures the error that a
plain PyTorch computation makes in ``bf16``. The stated exceptions are the fp32 accumulation of
the key compression and the fp32 outputs (scores, LSE).

Implementation: a Python loop over the sequences of the batch, vectorised inside a sequence,
with the query rows of a sequence processed ``chunk`` rows at a time so that the per-head
score matrices of a long sequence never exist all at once.

Stage 0 and stage 1 carry no gradient (they run under ``torch.no_grad``); stage 2 and the
dense attention are built from differentiable torch ops.
"""

import math

import torch
import torch.utils.checkpoint

__all__ = [
    "compress_keys",
    "group_scores",
    "max_pool_blocks",
    "topk_blocks",
    "select_blocks",
    "sparse_attn_varlen",
    "dense_attn_varlen",
    "attention",
]

_DEFAULT_CHUNK = 4096
_NEG_INF = float("-inf")
_POS_INF = float("inf")


# --------------------------------------------------------------------------------------------
# argument checking
# --------------------------------------------------------------------------------------------


def _check_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_tensor3(x, name):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must have 3 dimensions (tokens, heads, head_dim), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _check_same(a, name_a, b, name_b):
    if a.dtype != b.dtype:
        raise ValueError(f"{name_b} dtype {b.dtype} differs from {name_a} dtype {a.dtype}")
    if a.device != b.device:
        raise ValueError(f"{name_b} is on {b.device} but {name_a} is on {a.device}")


def _offsets(cu, name, total=None):
    """Checks a cu_seqlens tensor and returns its values as a Python list."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D with B+1 >= 1 entries, got shape {tuple(cu.shape)}")
    offs = cu.tolist()
    if offs[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offs[0]}")
    if any(b < a for a, b in zip(offs, offs[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {offs}")
    if total is not None and offs[-1] != total:
        raise ValueError(f"{name} ends at {offs[-1]} but the packed tensor holds {total} tokens")
    return offs


def _check_batches(offs_a, name_a, offs_b, name_b):
    if len(offs_a) != len(offs_b):
        raise ValueError(
            f"{name_b} describes {len(offs_b) - 1} sequences but {name_a} describes {len(offs_a) - 1}"
        )


def _check_causal_lengths(offs_q, offs_k):
    for b in range(len(offs_q) - 1):
        lq = offs_q[b + 1] - offs_q[b]
        lk = offs_k[b + 1] - offs_k[b]
        if lq > lk:
            raise ValueError(
                f"sequence {b} has {lq} queries (cu_seqlens_q) but only {lk} keys (cu_seqlens_k); "
                "bottom-right causal alignment needs Lq <= Lk"
            )


def _num_windows(length, kernel_size, kernel_stride):
    return (length - kernel_size) // kernel_stride + 1 if length >= kernel_size else 0


def _compressed_offsets(offs_k, kernel_size, kernel_stride):
    """(windows per sequence, their offsets) for key offsets offs_k."""
    counts = [_num_windows(b - a, kernel_size, kernel_stride) for a, b in zip(offs_k, offs_k[1:])]
    offs_c = [0]
    for n in counts:
        offs_c.append(offs_c[-1] + n)
    return counts, offs_c


def _check_compressed_offsets(offs_c, name_c, offs_k, kernel_size, kernel_stride, names):
    for b in range(len(offs_k) - 1):
        lk = offs_k[b + 1] - offs_k[b]
        want = _num_windows(lk, kernel_size, kernel_stride)
        got = offs_c[b + 1] - offs_c[b]
        if got != want:
            raise ValueError(
                f"{name_c}: sequence {b} has {got} compressed keys, but {lk} keys with "
                f"{names[0]}={kernel_size} and {names[1]}={kernel_stride} give {want}"
            )


def _check_punct_cache(punct_cache, k_cache):
    """A bool punctuation flag a key, laid out as k_cache's keys: (num_pages, page_size)."""
    if not isinstance(punct_cache, torch.Tensor) or punct_cache.dtype != torch.bool \
            or tuple(punct_cache.shape) != tuple(k_cache.shape[:2]):
        raise ValueError(f"punct_cache must be a bool tensor of shape (num_pages, page_size) = "
                         f"{tuple(k_cache.shape[:2])}, each key's punctuation flag laid out as k_cache, got "
                         + (f"{punct_cache.dtype} {tuple(punct_cache.shape)}" if isinstance(punct_cache, torch.Tensor)
                            else type(punct_cache).__name__))
    if punct_cache.device != k_cache.device:
        raise ValueError(f"punct_cache is on {punct_cache.device} but k_cache is on {k_cache.device}")


def _check_punct_mask(punct_mask, k):
    if not isinstance(punct_mask, torch.Tensor) or punct_mask.dtype != torch.bool:
        raise ValueError("punct_mask must be a bool tensor of shape (total_k,)")
    if punct_mask.shape != (k.shape[0],):
        raise ValueError(f"punct_mask must have shape ({k.shape[0]},), got {tuple(punct_mask.shape)}")
    if punct_mask.device != k.device:
        raise ValueError(f"punct_mask is on {punct_mask.device} but k is on {k.device}")


def _check_chunk(chunk):
    return _check_int(chunk, "chunk", 1)


def _scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    scale = float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    return scale


def _check_qkv(q, k, v):
    _check_tensor3(q, "q")
    _check_tensor3(k, "k")
    _check_tensor3(v, "v")
    _check_same(q, "q", k, "k")
    _check_same(q, "q", v, "v")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k head_dim {k.shape[2]} differs from q head_dim {q.shape[2]}")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v shape {tuple(v.shape)} does not match k shape {tuple(k.shape)} in (tokens, heads)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of k heads ({k.shape[1]})")


# --------------------------------------------------------------------------------------------
# stage 0: key compression
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def compress_keys(k, cu_seqlens_k, kernel_size=32, kernel_stride=16, punct_mask=None, phsa_lambda=0.5):
    """Mean-pools the keys of each sequence over overlapping windows (stage 0).

    Per sequence of length ``L`` and per KV head, with ``w = kernel_size``, ``s = kernel_stride``::

        n     = (L - w) // s + 1   if L >= w else 0
        ck[j] = (1/w) * sum_{t = j*s}^{j*s + w - 1} k[t]            j = 0 .. n-1

    PHSA (punctuation-aware representation): with ``punct_mask`` (bool ``(total_k,)``) and
    ``lam = phsa_lambda``, for a window holding ``P >= 1`` punctuation tokens::

        ck[j] = lam * mean(k[window]) + (1 - lam) * (1/P) * sum_{t in window, punct[t]} k[t]

    and the plain mean where the window holds none.

    Sums are accumulated in fp32 (in fp64 when ``k`` is fp64, so that an fp64 oracle stays
    exact) and the result is cast to ``k.dtype``.

    Returns ``(ck (total_c, Hk, D) in k.dtype, cu_seqlens_c int32 (B+1) on k.device)``.
    """
    _check_tensor3(k, "k")
    _check_int(kernel_size, "kernel_size", 1)
    _check_int(kernel_stride, "kernel_stride", 1)
    offs = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if punct_mask is not None:
        _check_punct_mask(punct_mask, k)
        lam = float(phsa_lambda)
        if not math.isfinite(lam):
            raise ValueError(f"phsa_lambda must be finite, got {phsa_lambda}")

    acc = torch.promote_types(k.dtype, torch.float32)
    counts, offs_c = _compressed_offsets(offs, kernel_size, kernel_stride)
    cu_c = torch.tensor(offs_c, dtype=torch.int32, device=k.device)
    ck = k.new_empty((offs_c[-1], k.shape[1], k.shape[2]))

    for b, n in enumerate(counts):
        if n == 0:
            continue
        k0, k1 = offs[b], offs[b + 1]
        keys = k[k0:k1].to(acc)
        # unfold gives (n, Hk, D, w) views of the windows without copying them
        mean = keys.unfold(0, kernel_size, kernel_stride).mean(-1)
        if punct_mask is not None:
            punct = punct_mask[k0:k1].to(acc)
            n_punct = punct.unfold(0, kernel_size, kernel_stride).sum(-1)[:, None, None]
            punct_sum = (keys * punct[:, None, None]).unfold(0, kernel_size, kernel_stride).sum(-1)
            mixed = lam * mean + (1.0 - lam) * (punct_sum / n_punct.clamp_min(1.0))
            mean = torch.where(n_punct > 0, mixed, mean)
        ck[offs_c[b] : offs_c[b + 1]] = mean.to(k.dtype)
    return ck, cu_c


# --------------------------------------------------------------------------------------------
# stage 1: scores, pooling, top-k
# --------------------------------------------------------------------------------------------


def _masked_logsumexp(logits, visible):
    """logsumexp over the visible columns; -inf for a row with none visible."""
    return torch.logsumexp(logits.masked_fill(~visible, _NEG_INF), dim=-1)


@torch.no_grad()
def group_scores(
    q,
    ck,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_c,
    kernel_size=32,
    kernel_stride=16,
    softmax_scale=None,
    norm_keys=None,
    cu_seqlens_norm=None,
    norm_kernel_size=128,
    norm_kernel_stride=64,
    chunk=_DEFAULT_CHUNK,
):
    """Group-summed attention probabilities of the queries on the compressed keys (stage 1, steps 1-3).

    For the query at position ``p = Lk - Lq + i`` (``Lk`` = ORIGINAL key length of the sequence,
    bottom-right aligned) and compressed key ``j`` of window ``[j*s, j*s + w)``::

        visible(p, j) = j*s + w - 1 <= p
        P_h(p, j)     = exp(scale * q_h(p) . ck[j] - LSE_h(p))                for visible j
        LSE_h(p)      = log sum_{visible j'} exp(scale * q_h(p) . ck[j'])     (exact, norm_keys=None)
                      = log sum_{visible j2} exp(scale * q_h(p) . norm_keys[j2])   (approximation)
        S(p, j)       = sum_{h in group} P_h(p, j)

    where a coarse key ``j2`` is visible iff ``j2*norm_kernel_stride + norm_kernel_size - 1 <= p``.
    Decided here: when ``norm_keys`` is given but no coarse key is visible to a row while fine
    keys are, that row falls back to the exact fine LSE (the coarse sum would be empty and the
    probabilities infinite). With the approximation ``sum_j P_h`` need not be 1.

    Invisible and nonexistent columns are 0. The dot products, the LSE and the exp are computed
    in ``q.dtype`` (``q``, ``ck`` and ``norm_keys`` share it); the result is cast to fp32 at the end.
    ``scale`` defaults to ``1/sqrt(D)``.

    Returns ``S`` fp32 ``(Hk, total_q, max_nc)``, ``max_nc`` = the largest compressed length in
    the batch.
    """
    _check_tensor3(q, "q")
    _check_tensor3(ck, "ck")
    _check_same(q, "q", ck, "ck")
    total_q, hq, d = q.shape
    hk = ck.shape[1]
    if ck.shape[2] != d:
        raise ValueError(f"ck head_dim {ck.shape[2]} differs from q head_dim {d}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of ck heads ({hk})")
    g = hq // hk
    _check_int(kernel_size, "kernel_size", 1)
    _check_int(kernel_stride, "kernel_stride", 1)
    _check_chunk(chunk)
    offs_q = _offsets(cu_seqlens_q, "cu_seqlens_q", total_q)
    offs_k = _offsets(cu_seqlens_k, "cu_seqlens_k")
    offs_c = _offsets(cu_seqlens_c, "cu_seqlens_c", ck.shape[0])
    _check_batches(offs_q, "cu_seqlens_q", offs_k, "cu_seqlens_k")
    _check_batches(offs_q, "cu_seqlens_q", offs_c, "cu_seqlens_c")
    _check_causal_lengths(offs_q, offs_k)
    _check_compressed_offsets(offs_c, "cu_seqlens_c", offs_k, kernel_size, kernel_stride,
                              ("kernel_size", "kernel_stride"))
    if norm_keys is not None:
        _check_tensor3(norm_keys, "norm_keys")
        _check_same(q, "q", norm_keys, "norm_keys")
        if norm_keys.shape[1:] != ck.shape[1:]:
            raise ValueError(f"norm_keys shape {tuple(norm_keys.shape)} does not match ck shape {tuple(ck.shape)}")
        if cu_seqlens_norm is None:
            raise ValueError("cu_seqlens_norm is required when norm_keys is given")
        _check_int(norm_kernel_size, "norm_kernel_size", 1)
        _check_int(norm_kernel_stride, "norm_kernel_stride", 1)
        offs_n = _offsets(cu_seqlens_norm, "cu_seqlens_norm", norm_keys.shape[0])
        _check_batches(offs_q, "cu_seqlens_q", offs_n, "cu_seqlens_norm")
        _check_compressed_offsets(offs_n, "cu_seqlens_norm", offs_k, norm_kernel_size, norm_kernel_stride,
                                  ("norm_kernel_size", "norm_kernel_stride"))
    elif cu_seqlens_norm is not None:
        raise ValueError("cu_seqlens_norm given without norm_keys")
    scale = _scale(softmax_scale, d)

    n_seq = len(offs_q) - 1
    counts = [offs_c[b + 1] - offs_c[b] for b in range(n_seq)]
    max_nc = max(counts, default=0)
    out = torch.zeros((hk, total_q, max_nc), dtype=torch.float32, device=q.device)

    for b in range(n_seq):
        q0 = offs_q[b]
        lq = offs_q[b + 1] - q0
        lk = offs_k[b + 1] - offs_k[b]
        n = counts[b]
        if lq == 0 or n == 0:
            continue
        keys = ck[offs_c[b] : offs_c[b + 1]].transpose(0, 1).unsqueeze(1)  # (Hk, 1, n, D)
        last_tok = torch.arange(n, device=q.device) * kernel_stride + (kernel_size - 1)
        if norm_keys is not None:
            n2 = offs_n[b + 1] - offs_n[b]
            keys2 = norm_keys[offs_n[b] : offs_n[b + 1]].transpose(0, 1).unsqueeze(1)
            last_tok2 = torch.arange(n2, device=q.device) * norm_kernel_stride + (norm_kernel_size - 1)
        for r0 in range(0, lq, chunk):
            r1 = min(lq, r0 + chunk)
            rows = r1 - r0
            pos = torch.arange(lk - lq + r0, lk - lq + r1, device=q.device)
            qh = q[q0 + r0 : q0 + r1].reshape(rows, hk, g, d).permute(1, 2, 0, 3)  # (Hk, G, rows, D)
            logits = torch.matmul(qh, keys.transpose(-1, -2)) * scale  # (Hk, G, rows, n)
            visible = last_tok[None, :] <= pos[:, None]  # (rows, n)
            lse = _masked_logsumexp(logits, visible)
            if norm_keys is not None and n2 > 0:
                logits2 = torch.matmul(qh, keys2.transpose(-1, -2)) * scale
                visible2 = last_tok2[None, :] <= pos[:, None]
                lse2 = _masked_logsumexp(logits2, visible2)
                lse = torch.where(visible2.any(-1), lse2, lse)
            # rows that see nothing have lse = -inf; a finite stand-in keeps exp() from making inf
            # in columns that are zeroed anyway
            lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            probs = torch.exp(logits - lse.unsqueeze(-1))
            probs = torch.where(visible, probs, torch.zeros_like(probs))
            out[:, q0 + r0 : q0 + r1, :n] = probs.sum(1).float()
    return out


@torch.no_grad()
def max_pool_blocks(
    S,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_c,
    kernel_size=32,
    kernel_stride=16,
    block_size=64,
    init_blocks=1,
    local_blocks=32,
):
    """Pools compressed-key scores into block scores and forces init/local blocks (stage 1, steps 4-5).

    With ``m = block_size // kernel_stride``, ``n`` the sequence's compressed length,
    ``q_blk = p // block_size`` and ``nb = ceil(Lk / block_size)``::

        score(p, b) = max { S(p, j) : b*m - 1 <= j <= b*m + m - 1, 0 <= j < n, j*s + w - 1 <= p }
                      (-inf when the set is empty; pool window m+1, stride m, padding 1)
        score(p, b) = +inf   if b < init_blocks or q_blk - local_blocks <= b <= q_blk
        score(p, b) = -inf   if b > q_blk or b >= nb   (overrides the forcing above)

    Columns of ``S`` that are invisible to the row are ignored whatever they hold.
    Computed in fp32. Returns fp32 ``(Hk, total_q, max_nb)``, ``max_nb = ceil(max Lk / block_size)``;
    the columns past a sequence's own ``nb`` are -inf.
    """
    if not isinstance(S, torch.Tensor) or S.dim() != 3 or not S.is_floating_point():
        raise ValueError("S must be a floating-point tensor of shape (Hk, total_q, max_nc)")
    _check_int(kernel_size, "kernel_size", 1)
    _check_int(kernel_stride, "kernel_stride", 1)
    _check_int(block_size, "block_size", 1)
    _check_int(init_blocks, "init_blocks", 0)
    _check_int(local_blocks, "local_blocks", 0)
    if block_size % kernel_stride != 0:
        raise ValueError(f"block_size ({block_size}) must be a multiple of kernel_stride ({kernel_stride})")
    hk, total_q, width = S.shape
    offs_q = _offsets(cu_seqlens_q, "cu_seqlens_q", total_q)
    offs_k = _offsets(cu_seqlens_k, "cu_seqlens_k")
    offs_c = _offsets(cu_seqlens_c, "cu_seqlens_c")
    _check_batches(offs_q, "cu_seqlens_q", offs_k, "cu_seqlens_k")
    _check_batches(offs_q, "cu_seqlens_q", offs_c, "cu_seqlens_c")
    _check_causal_lengths(offs_q, offs_k)
    _check_compressed_offsets(offs_c, "cu_seqlens_c", offs_k, kernel_size, kernel_stride,
                              ("kernel_size", "kernel_stride"))
    n_seq = len(offs_q) - 1
    counts = [offs_c[b + 1] - offs_c[b] for b in range(n_seq)]
    if max(counts, default=0) > width:
        raise ValueError(f"S has {width} columns but a sequence has {max(counts)} compressed keys")

    m = block_size // kernel_stride
    max_lk = max((offs_k[b + 1] - offs_k[b] for b in range(n_seq)), default=0)
    max_nb = -(-max_lk // block_size)
    out = torch.full((hk, total_q, max_nb), _NEG_INF, dtype=torch.float32, device=S.device)

    for b in range(n_seq):
        q0 = offs_q[b]
        lq = offs_q[b + 1] - q0
        lk = offs_k[b + 1] - offs_k[b]
        if lq == 0:
            continue
        nb = -(-lk // block_size)
        # every existing j satisfies j < nb*m, so this slice only guards odd window shapes
        n = min(counts[b], nb * m)
        last_tok = torch.arange(n, device=S.device) * kernel_stride + (kernel_size - 1)
        blocks = torch.arange(nb, device=S.device)
        for r0 in range(0, lq, _DEFAULT_CHUNK):
            r1 = min(lq, r0 + _DEFAULT_CHUNK)
            pos = torch.arange(lk - lq + r0, lk - lq + r1, device=S.device)
            scores = S[:, q0 + r0 : q0 + r1, :n].float()
            scores = scores.masked_fill(last_tok[None, None, :] > pos[None, :, None], _NEG_INF)
            # padded[1 + j] = score of j, so the window of block b is padded[b*m : b*m + m + 1]
            padded = torch.full((hk, r1 - r0, nb * m + 1), _NEG_INF, dtype=torch.float32, device=S.device)
            padded[:, :, 1 : 1 + n] = scores
            pooled = padded.unfold(-1, m + 1, m).amax(-1)  # (Hk, rows, nb)
            q_blk = (pos // block_size)[:, None]
            forced = (blocks[None, :] < init_blocks) | (
                (blocks[None, :] >= q_blk - local_blocks) & (blocks[None, :] <= q_blk)
            )
            pooled = torch.where(forced, _POS_INF, pooled)
            pooled = torch.where(blocks[None, :] > q_blk, _NEG_INF, pooled)
            out[:, q0 + r0 : q0 + r1, :nb] = pooled
    return out


@torch.no_grad()
def topk_blocks(block_scores, cu_seqlens_q, cu_seqlens_k, topk, block_size=64):
    """Picks the ``topk`` best blocks per (KV head, query) (stage 1, step 6).

    Candidates are the blocks ``b`` with ``score(p, b) > -inf``, ``b <= p // block_size`` and
    ``b < ceil(Lk / block_size)`` (the last two are already -inf in ``max_pool_blocks``' output;
    they are enforced again here so that scores from elsewhere cannot select future blocks).
    NaN scores count as -inf. The ``min(topk, #candidates)`` highest-scoring candidates are
    written in ascending block order, followed by -1 in the unused slots. Ties resolve either way.

    Returns int32 ``(Hk, total_q, topk)`` on the device of ``block_scores``.
    """
    if not isinstance(block_scores, torch.Tensor) or block_scores.dim() != 3 or not block_scores.is_floating_point():
        raise ValueError("block_scores must be a floating-point tensor of shape (Hk, total_q, max_nb)")
    _check_int(topk, "topk", 1)
    _check_int(block_size, "block_size", 1)
    hk, total_q, width = block_scores.shape
    offs_q = _offsets(cu_seqlens_q, "cu_seqlens_q", total_q)
    offs_k = _offsets(cu_seqlens_k, "cu_seqlens_k")
    _check_batches(offs_q, "cu_seqlens_q", offs_k, "cu_seqlens_k")
    _check_causal_lengths(offs_q, offs_k)
    device = block_scores.device
    out = torch.full((hk, total_q, topk), -1, dtype=torch.int32, device=device)

    for b in range(len(offs_q) - 1):
        q0 = offs_q[b]
        lq = offs_q[b + 1] - q0
        lk = offs_k[b + 1] - offs_k[b]
        nb = min(width, -(-lk // block_size))
        if lq == 0 or nb == 0:
            continue
        kk = min(topk, nb)
        blocks = torch.arange(nb, device=device)
        for r0 in range(0, lq, _DEFAULT_CHUNK):
            r1 = min(lq, r0 + _DEFAULT_CHUNK)
            pos = torch.arange(lk - lq + r0, lk - lq + r1, device=device)
            scores = block_scores[:, q0 + r0 : q0 + r1, :nb].float()
            future = blocks[None, :] > (pos // block_size)[:, None]
            scores = torch.where(future | torch.isnan(scores), _NEG_INF, scores)
            values, idx = scores.topk(kk, dim=-1)
            # -inf picks are not blocks; the sentinel nb sorts them behind the real ones
            idx = torch.where(values == _NEG_INF, nb, idx).sort(dim=-1).values
            idx = torch.where(idx == nb, -1, idx)
            out[:, q0 + r0 : q0 + r1, :kk] = idx.to(torch.int32)
    return out


def select_blocks(
    q,
    k,
    cu_seqlens_q,
    cu_seqlens_k,
    topk=96,
    kernel_size=32,
    kernel_stride=16,
    block_size=64,
    init_blocks=1,
    local_blocks=32,
    approx_lse=True,
    norm_kernel_size=128,
    norm_kernel_stride=64,
    softmax_scale=None,
    punct_mask=None,
    phsa_lambda=0.5,
    return_scores=False,
):
    """Block selection, stages 0 and 1 end to end.

    ``ck = compress_keys(k, w=kernel_size, s=kernel_stride)``; when ``approx_lse`` also the
    coarse keys ``compress_keys(k, norm_kernel_size, norm_kernel_stride)`` as the softmax
    normaliser (both with the same PHSA ``punct_mask``, so that the normaliser approximates the
    keys it normalises); then ``group_scores`` -> ``max_pool_blocks`` -> ``topk_blocks``.
    Runs under ``torch.no_grad`` on detached ``q`` and ``k``.

    Returns ``topk_idx`` int32 ``(Hk, total_q, topk)``, or ``(topk_idx, block_scores)`` with
    ``block_scores`` fp32 ``(Hk, total_q, max_nb)`` when ``return_scores``.
    """
    _check_tensor3(q, "q")
    _check_tensor3(k, "k")
    _check_same(q, "q", k, "k")
    _check_int(kernel_stride, "kernel_stride", 1)
    _check_int(block_size, "block_size", 1)
    if block_size % kernel_stride != 0:
        raise ValueError(f"block_size ({block_size}) must be a multiple of kernel_stride ({kernel_stride})")
    with torch.no_grad():
        q = q.detach()
        k = k.detach()
        ck, cu_c = compress_keys(k, cu_seqlens_k, kernel_size, kernel_stride, punct_mask, phsa_lambda)
        norm_keys = cu_norm = None
        if approx_lse:
            norm_keys, cu_norm = compress_keys(
                k, cu_seqlens_k, norm_kernel_size, norm_kernel_stride, punct_mask, phsa_lambda
            )
        scores = group_scores(
            q, ck, cu_seqlens_q, cu_seqlens_k, cu_c, kernel_size, kernel_stride, softmax_scale,
            norm_keys, cu_norm, norm_kernel_size, norm_kernel_stride,
        )
        blocks = max_pool_blocks(
            scores, cu_seqlens_q, cu_seqlens_k, cu_c, kernel_size, kernel_stride, block_size,
            init_blocks, local_blocks,
        )
        del scores
        idx = topk_blocks(blocks, cu_seqlens_q, cu_seqlens_k, topk, block_size)
    return (idx, blocks) if return_scores else idx


# --------------------------------------------------------------------------------------------
# stage 2 and dense attention
# --------------------------------------------------------------------------------------------


def _masked_attention(q_rows, keys, values, mask, scale):
    """Softmax attention of a chunk of query rows over one sequence's keys.

    q_rows (rows, Hq, D); keys (Hk, L, D); values (Hk, L, Dv); mask None (all visible) or bool
    (Hk or 1, rows, L). Returns out (rows, Hq, Dv) in q's dtype and lse fp32 (Hq, rows), detached.
    """
    rows, hq, d = q_rows.shape
    hk = keys.shape[0]
    g = hq // hk
    qh = q_rows.reshape(rows, hk, g, d).permute(1, 2, 0, 3)  # (Hk, G, rows, D)
    logits = torch.matmul(qh, keys.unsqueeze(1).transpose(-1, -2)) * scale  # (Hk, G, rows, L)
    row_ok = None
    if mask is not None:
        mask = mask.unsqueeze(1)
        row_ok = mask.any(-1, keepdim=True)
        logits = torch.where(mask, logits, _NEG_INF)
        # a row with nothing selected would be all -inf: its softmax is NaN in the forward and
        # poisons every gradient in the backward, so it gets finite dummy logits, zeroed below
        logits = torch.where(row_ok, logits, 0.0)
    probs = torch.softmax(logits, dim=-1)
    with torch.no_grad():
        # sum of exp(x - max) in (at least) fp32: the max is exact in any dtype, and the sum keeps
        # LSE from being rounded to q's dtype as a whole
        acc = torch.promote_types(logits.dtype, torch.float32)
        row_max = logits.amax(-1, keepdim=True)
        lse = row_max.squeeze(-1).to(acc) + torch.log(torch.exp(logits - row_max).sum(-1, dtype=acc))
        lse = lse.float()
    if row_ok is not None and not bool(row_ok.all()):
        probs = torch.where(row_ok, probs, 0.0)
        lse = torch.where(row_ok.squeeze(-1), lse, _NEG_INF)
    out = torch.matmul(probs, values.unsqueeze(1))  # (Hk, G, rows, Dv)
    out = out.permute(2, 0, 1, 3).reshape(rows, hq, values.shape[-1])
    lse = lse.reshape(hq, rows)
    return out, lse


def _attention_varlen(q, k, v, offs_q, offs_k, scale, chunk, causal, topk_idx, block_size):
    hq = q.shape[1]
    hk = k.shape[1]
    dv = v.shape[2]
    device = q.device
    # one chunk's probabilities stay alive at a time in the backward only if the chunks are
    # recomputed there; without that a 32K-token sequence would keep all of them
    recording = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs, lses = [], []
    for b in range(len(offs_q) - 1):
        q0 = offs_q[b]
        lq = offs_q[b + 1] - q0
        k0 = offs_k[b]
        lk = offs_k[b + 1] - k0
        if lq == 0:
            continue
        keys_all = k[k0 : k0 + lk].transpose(0, 1)
        values_all = v[k0 : k0 + lk].transpose(0, 1)
        checkpointed = recording and lq > chunk
        for r0 in range(0, lq, chunk):
            r1 = min(lq, r0 + chunk)
            rows = r1 - r0
            # keys after the chunk's last query position are invisible to all of its rows
            kv_len = min(lk, lk - lq + r1) if causal else lk
            if kv_len == 0:
                outs.append(q.new_zeros((rows, hq, dv)))
                lses.append(torch.full((hq, rows), _NEG_INF, dtype=torch.float32, device=device))
                continue
            pos = torch.arange(lk - lq + r0, lk - lq + r1, device=device)
            tok = torch.arange(kv_len, device=device)
            mask = (tok[None, :] <= pos[:, None]).unsqueeze(0) if causal else None
            if topk_idx is not None:
                nb = -(-kv_len // block_size)
                sel = topk_idx[:, q0 + r0 : q0 + r1].long()
                # -1 and blocks past the keys land in a spare column that is dropped
                sel = torch.where((sel >= 0) & (sel < nb), sel, nb)
                chosen = torch.zeros((hk, rows, nb + 1), dtype=torch.bool, device=device)
                chosen.scatter_(-1, sel, True)
                mask = chosen[:, :, tok // block_size] & mask
            args = (q[q0 + r0 : q0 + r1], keys_all[:, :kv_len], values_all[:, :kv_len], mask, scale)
            if checkpointed:
                out, lse = torch.utils.checkpoint.checkpoint(
                    _masked_attention, *args, use_reentrant=False, preserve_rng_state=False
                )
            else:
                out, lse = _masked_attention(*args)
            outs.append(out)
            lses.append(lse)
    if not outs:
        return q.new_zeros((0, hq, dv)), torch.zeros((hq, 0), dtype=torch.float32, device=device)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def kvcache_to_varlen(k_cache, v_cache, cache_seqlens, block_table=None):
    """The keys and values a KV cache holds, packed: ``(k, v, cu_seqlens_k)``.

    ``k_cache, v_cache (num_pages, page_size, Hk, D)``; sequence ``b`` has ``cache_seqlens[b]``
    keys, its key ``j`` at row ``j % page_size`` of page ``block_table[b, j // page_size]``
    (of page ``b`` when ``block_table`` is None: a padded cache). Reads the lengths and the table
    on the host.
    """
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("k_cache must be a tensor of shape (num_pages, page_size, Hk, D)")
    if not isinstance(v_cache, torch.Tensor) or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"v_cache must have shape (num_pages, page_size, Hk, Dv) matching k_cache {tuple(k_cache.shape)}")
    lens = [int(n) for n in cache_seqlens.tolist()]
    pages, page_size = k_cache.shape[:2]
    if block_table is None:
        if len(lens) > pages:
            raise ValueError(f"a padded cache needs a page a sequence: k_cache has {pages} for {len(lens)} sequences")
        capacity = page_size
    else:
        if block_table.dim() != 2 or block_table.shape[0] != len(lens):
            raise ValueError(f"block_table must have shape (batch={len(lens)}, pages_per_seq), got {tuple(block_table.shape)}")
        capacity = page_size * block_table.shape[1]
        table = block_table.long().cpu()
        if table.numel() and (table.min() < 0 or table.max() >= pages):
            raise ValueError(f"block_table holds pages outside [0, {pages})")
    if any(n < 0 or n > capacity for n in lens):
        raise ValueError(f"cache_seqlens must be in [0, {capacity}] (the capacity of a sequence), got {lens}")
    rows = []
    for b, n in enumerate(lens):
        j = torch.arange(n)
        page = table[b][j // page_size] if block_table is not None else torch.full_like(j, b)
        rows.append(page * page_size + j % page_size)
    index = torch.cat(rows).to(k_cache.device) if rows else torch.zeros(0, dtype=torch.long, device=k_cache.device)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(k_cache.device)
    return k_cache.flatten(0, 1)[index], v_cache.flatten(0, 1)[index], cu


def sparse_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, topk_idx, block_table=None,
                          softmax_scale=None, block_size=64):
    """``sparse_attn_varlen`` over the keys and values of a KV cache (``kvcache_to_varlen``)."""
    k, v, cu_k = kvcache_to_varlen(k_cache, v_cache, cache_seqlens, block_table)
    return sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_k, topk_idx, softmax_scale, block_size)


def dense_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, block_table=None, softmax_scale=None):
    """``dense_attn_varlen`` (causal, bottom-right) over the keys and values of a KV cache
    (``kvcache_to_varlen``)."""
    k, v, cu_k = kvcache_to_varlen(k_cache, v_cache, cache_seqlens, block_table)
    return dense_attn_varlen(q, k, v, cu_seqlens_q, cu_k, softmax_scale, causal=True)


def compress_keys_kvcache(k_cache, cache_seqlens, ck_cache, new_keys, block_table=None, kernel_size=32,
                          kernel_stride=16, punct_cache=None, phsa_lambda=0.5):
    """The compressed cache ``ck_cache (batch, capacity_c, Hk, D)`` brought up to date after each
    sequence gained (at most) ``new_keys`` keys: a copy in which entries ``[n(L - new_keys),
    n(L))`` of sequence ``b`` (``L = cache_seqlens[b]``, ``n`` the count of ``compress_keys``) are
    ``compress_keys`` of its keys (``kvcache_to_varlen``) and every other entry is unchanged.
    ``punct_cache`` (bool ``(num_pages, page_size)``, laid out as the keys): PHSA with the keys'
    punctuation flags and ``phsa_lambda``."""
    _check_int(new_keys, "new_keys", 0)
    k, _, cu_k = kvcache_to_varlen(k_cache, k_cache, cache_seqlens, block_table)
    punct_mask = None
    if punct_cache is not None:
        _check_punct_cache(punct_cache, k_cache)
        flags = punct_cache.view(*punct_cache.shape, 1, 1)
        punct_mask = kvcache_to_varlen(flags, flags, cache_seqlens, block_table)[0].view(-1)
    ck, cu_c = compress_keys(k, cu_k, kernel_size, kernel_stride, punct_mask, phsa_lambda)
    if ck_cache.dim() != 4 or ck_cache.shape[0] != cu_k.numel() - 1 or ck_cache.shape[2:] != k_cache.shape[2:]:
        raise ValueError(f"ck_cache must have shape (batch={cu_k.numel() - 1}, capacity_c, Hk, D) matching k_cache "
                         f"{tuple(k_cache.shape)}, got {tuple(ck_cache.shape)}")
    out = ck_cache.clone()
    lens = (cu_k[1:] - cu_k[:-1]).tolist()
    for b, (n_k, c0) in enumerate(zip(lens, cu_c[:-1].tolist())):
        lo, hi = _num_windows(max(n_k - new_keys, 0), kernel_size, kernel_stride), _num_windows(n_k, kernel_size,
                                                                                                kernel_stride)
        if hi > out.shape[1]:
            raise ValueError(f"ck_cache holds {out.shape[1]} entries a sequence, sequence {b} needs {hi}")
        out[b, lo:hi] = ck[c0 + lo:c0 + hi].to(out.dtype)
    return out


def select_decode_kvcache(q, ck_cache, nk_cache, cache_seqlens, cu_seqlens_q, topk=96, kernel_size=32,
                          kernel_stride=16, block_size=64, init_blocks=1, local_blocks=32, norm_kernel_size=128,
                          norm_kernel_stride=64, softmax_scale=None, return_scores=False):
    """``select_blocks`` from compressed caches: sequence ``b`` has ``L = cache_seqlens[b]`` keys
    (its queries, packed by ``cu_seqlens_q``, are the last ones) and its compressed keys are rows
    ``0 .. n(L)`` of ``ck_cache[b]`` (and of ``nk_cache[b]``, the normaliser keys; None: the
    exact normaliser over the fine keys). Rows past them are never read."""
    lens = [int(n) for n in cache_seqlens.tolist()]
    cu_k = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    def packed(cache, w, s):
        n = [_num_windows(x, w, s) for x in lens]
        if any(x > cache.shape[1] for x in n):
            raise ValueError(f"a compressed cache of {cache.shape[1]} rows a sequence holds fewer than the {max(n)} "
                             f"keys (window {w}, stride {s}) of {max(lens)} keys")
        rows = [cache[b, :x] for b, x in enumerate(n)]
        return torch.cat(rows), torch.tensor([0] + n, dtype=torch.int32).cumsum(0, dtype=torch.int32)

    with torch.no_grad():
        q = q.detach()
        ck, cu_c = packed(ck_cache, kernel_size, kernel_stride)
        nk, cu_n = packed(nk_cache, norm_kernel_size, norm_kernel_stride) if nk_cache is not None else (None, None)
        cu_q = cu_seqlens_q.cpu()
        scores = group_scores(q.cpu(), ck.cpu(), cu_q, cu_k, cu_c, kernel_size, kernel_stride, softmax_scale,
                              None if nk is None else nk.cpu(), cu_n, norm_kernel_size, norm_kernel_stride)
        blocks = max_pool_blocks(scores, cu_q, cu_k, cu_c, kernel_size, kernel_stride, block_size, init_blocks,
                                 local_blocks)
        idx = topk_blocks(blocks, cu_q, cu_k, topk, block_size).to(q.device)
    return (idx, blocks) if return_scores else idx


def attention_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, ck_cache, nk_cache, new_keys, block_table=None,
                      dense_len=8192, softmax_scale=None, topk=96, kernel_size=32, kernel_stride=16, block_size=64,
                      init_blocks=1, local_blocks=32, approx_lse=True, norm_kernel_size=128, norm_kernel_stride=64,
                      punct_cache=None, phsa_lambda=0.5):
    """A step of ``attention`` for new tokens against a KV cache (their keys in it already, counted
    by ``cache_seqlens``): returns ``(out, lse, ck_cache', nk_cache')``, the compressed caches
    brought up to date for the last ``new_keys`` keys (``compress_keys_kvcache``; ``nk_cache`` only
    with ``approx_lse``, else returned as given), then every block (dense attention) when the
    longest sequence is shorter than ``dense_len``, else ``select_decode_kvcache`` over the updated
    caches, then ``sparse_decode_kvcache``. With ``punct_cache`` both levels compress with PHSA, as
    ``attention`` with a ``punct_mask`` does."""
    ck_cache = compress_keys_kvcache(k_cache, cache_seqlens, ck_cache, new_keys, block_table, kernel_size,
                                     kernel_stride, punct_cache, phsa_lambda)
    if approx_lse:
        nk_cache = compress_keys_kvcache(k_cache, cache_seqlens, nk_cache, new_keys, block_table, norm_kernel_size,
                                         norm_kernel_stride, punct_cache, phsa_lambda)
    longest = max([int(n) for n in cache_seqlens.tolist()] + [1])
    if longest < dense_len:
        n = -(-longest // block_size)
        topk_idx = torch.arange(n, dtype=torch.int32, device=q.device).expand(k_cache.shape[2], q.shape[0], n)
    else:
        topk_idx = select_decode_kvcache(q, ck_cache, nk_cache if approx_lse else None, cache_seqlens, cu_seqlens_q,
                                         topk, kernel_size, kernel_stride, block_size, init_blocks, local_blocks,
                                         norm_kernel_size, norm_kernel_stride, softmax_scale)
    out, lse = sparse_decode_kvcache(q, k_cache, v_cache, cache_seqlens, cu_seqlens_q, topk_idx, block_table,
                                     softmax_scale, block_size)
    return out, lse, ck_cache, nk_cache


def sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale=None, block_size=64,
                       chunk=_DEFAULT_CHUNK):
    """Block-sparse attention over the selected blocks (stage 2).

    For the query at position ``p`` of head ``h`` (KV head ``h // G``), the key set is::

        T(p, h) = { t : t // block_size in topk_idx[h // G, row], t <= p }     (per-sequence t)

    (entries -1 are ignored, duplicates count once, blocks past the sequence select nothing)::

        out[row, h] = sum_{t in T} softmax_t(scale * q_h . k_t) v_t
        lse[h, row] = log sum_{t in T} exp(scale * q_h . k_t)          (natural log)

    ``scale`` defaults to ``1/sqrt(D)``. An empty ``T`` gives ``out = 0`` and ``lse = -inf``,
    with zero gradients and no NaN. Matmuls and softmax run in ``q.dtype``; ``lse`` is fp32 and
    returned detached (as FlashAttention ignores its gradient). ``out`` is differentiable
    w.r.t. ``q``, ``k``, ``v`` through plain autograd (the selection is a constant); when
    autograd records and a sequence spans several chunks, each chunk is recomputed in the
    backward (``torch.utils.checkpoint``) so that memory stays at one chunk's probabilities.

    Returns ``(out (total_q, Hq, Dv) in q.dtype, lse fp32 (Hq, total_q))``.
    """
    _check_qkv(q, k, v)
    _check_int(block_size, "block_size", 1)
    _check_chunk(chunk)
    offs_q = _offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    offs_k = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    _check_batches(offs_q, "cu_seqlens_q", offs_k, "cu_seqlens_k")
    _check_causal_lengths(offs_q, offs_k)
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 3:
        raise ValueError("topk_idx must be an integer tensor of shape (Hk, total_q, K)")
    if topk_idx.is_floating_point() or topk_idx.is_complex() or topk_idx.dtype == torch.bool:
        raise ValueError(f"topk_idx must be an integer tensor, got {topk_idx.dtype}")
    if topk_idx.shape[:2] != (k.shape[1], q.shape[0]):
        raise ValueError(
            f"topk_idx shape {tuple(topk_idx.shape)} must be (Hk={k.shape[1]}, total_q={q.shape[0]}, K)"
        )
    if topk_idx.device != q.device:
        raise ValueError(f"topk_idx is on {topk_idx.device} but q is on {q.device}")
    if topk_idx.numel() and bool((topk_idx < -1).any()):
        raise ValueError("topk_idx holds entries below -1; use -1 for unused slots")
    scale = _scale(softmax_scale, q.shape[2])
    return _attention_varlen(q, k, v, offs_q, offs_k, scale, chunk, True, topk_idx.detach(), block_size)


def dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=True, chunk=_DEFAULT_CHUNK):
    """Dense GQA attention over each sequence's keys.

    ``out[row, h] = sum_t softmax_t(scale * q_h . k_t) v_t`` over the keys of KV head ``h // G``
    with ``t <= p`` when ``causal`` (bottom-right aligned, needs ``Lq <= Lk``), all ``t``
    otherwise; ``lse`` as in ``sparse_attn_varlen``. A row with no key (only possible when
    not causal and ``Lk = 0``) gives ``out = 0``, ``lse = -inf``.

    Returns ``(out (total_q, Hq, Dv) in q.dtype, lse fp32 (Hq, total_q))``; ``out`` differentiable.
    """
    _check_qkv(q, k, v)
    _check_chunk(chunk)
    offs_q = _offsets(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    offs_k = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    _check_batches(offs_q, "cu_seqlens_q", offs_k, "cu_seqlens_k")
    if causal:
        _check_causal_lengths(offs_q, offs_k)
    scale = _scale(softmax_scale, q.shape[2])
    return _attention_varlen(q, k, v, offs_q, offs_k, scale, chunk, bool(causal), None, 1)


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, dense_len=8192, softmax_scale=None, **select_kwargs):
    """InfLLM-V2 attention with the dense-sparse switch.

    When the longest key sequence of the batch is shorter than ``dense_len`` this is
    ``dense_attn_varlen(causal=True)``; otherwise ``topk_idx = select_blocks(q, k, ...,
    **select_kwargs)`` (no gradient, detached inputs) followed by ``sparse_attn_varlen`` with
    the same ``block_size``. ``softmax_scale`` applies to both stages.

    Returns ``(out, lse)`` as ``sparse_attn_varlen``.
    """
    _check_qkv(q, k, v)
    _check_int(dense_len, "dense_len", 0)
    if "return_scores" in select_kwargs:
        raise ValueError("return_scores is not accepted by attention(); call select_blocks directly")
    offs_k = _offsets(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    max_lk = max((offs_k[b + 1] - offs_k[b] for b in range(len(offs_k) - 1)), default=0)
    if max_lk < dense_len:
        return dense_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, causal=True)
    topk_idx = select_blocks(q, k, cu_seqlens_q, cu_seqlens_k, softmax_scale=softmax_scale, **select_kwargs)
    block_size = select_kwargs.get("block_size", 64)
    return sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, softmax_scale=softmax_scale,
                              block_size=block_size)
