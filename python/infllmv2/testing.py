"""Workloads and error rules shared by the tests, the benchmarks and `python -m infllmv2 check`.

The oracle is ``infllmv2.reference``; this module only builds inputs and states how a kernel
result is judged against it: the kernel's error against an fp32 reference must be at most
``factor`` (2) times the error of the same PyTorch computation done in the input dtype.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def cu_seqlens(lengths, device="cpu") -> torch.Tensor:
    """int32 offsets (B+1) of sequences of the given lengths."""
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + int(n))
    return torch.tensor(offs, dtype=torch.int32, device=device)


def max_seqlen(cu: torch.Tensor) -> int:
    """The longest sequence of int32 offsets cu (B+1)."""
    return int((cu[1:] - cu[:-1]).max())


def library_identity() -> dict:
    """What the benchmarks' JSON records of the kernel library they timed: its build info (version,
    ABI, archs, TileLang) and the SHA-256 of the loaded file, so that a figure can be traced to the
    exact binary (the build info carries no source revision)."""
    import hashlib

    from . import _lib

    info = _lib.build_info()
    info.pop("kernels", None)
    path = _lib.library_path()
    with open(path, "rb") as f:
        info["sha256"] = hashlib.sha256(f.read()).hexdigest()
    info["path"] = path
    return info


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


def within_error_rule(out, lowp, ref32, factor=2.0, floor=None) -> tuple[bool, float, float]:
    """The library's error rule: ``err(out) <= factor * err(lowp)`` against the fp32 oracle.

    ``lowp`` is the same computation in PyTorch in the input dtype. ``floor`` (default: a few
    fp32 ulps of the output's magnitude) covers results where PyTorch happens to be exact;
    gradients pass one sized to the terms that cancel in them (see GRAD_FLOOR).
    Returns ``(ok, err, lowp_err)``; NaN anywhere in ``out`` fails.
    """
    if out.numel() == 0:
        return True, 0.0, 0.0
    err, base = error_ratio(out, lowp, ref32)
    if floor is None:
        floor = 4 * torch.finfo(torch.float32).eps * max(ref32.float().abs().max().item(), 1.0)
    ok = not torch.isnan(out).any().item() and err <= factor * base + floor
    return ok, err, base


# Attention gradients are differences of O(1) terms (dS = P * (dP - Delta)): where they cancel
# exactly in PyTorch (one visible key: P = 1, dP = Delta), fp32 accumulation order alone
# leaves ~1e-6 in a kernel. 1e-5 is far below any bf16/fp16 error of these tests (~1e-3).
GRAD_FLOOR = 1e-5


def assert_close_to_reference(out, lowp, ref32, factor=2.0, what="output", floor=None):
    assert out.shape == ref32.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref32.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (unwritten or poisoned rows?)"
    ok, err, base = within_error_rule(out, lowp, ref32, factor, floor)
    assert ok, f"{what}: error {err:.3g} > {factor} x PyTorch {out.dtype} error {base:.3g}"


# ---------------------------------------------------------------------------- stage-2 workloads


def assert_sparse_forward_close(out, lse, q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx, what):
    """A stage-2 forward's ``out`` and ``lse`` against ``reference.sparse_attn_varlen`` by the error
    rule; rows with no visible key must have lse -inf exactly where the fp32 reference does."""
    from . import reference

    ref32 = reference.sparse_attn_varlen(q.float(), k.float(), v.float(), cu_seqlens_q, cu_seqlens_k, topk_idx)
    lowp = reference.sparse_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, topk_idx)
    fin = torch.isfinite(ref32[1])
    assert torch.equal(torch.isfinite(lse), fin), f"{what}: lse -inf rows differ"
    assert_close_to_reference(out, lowp[0], ref32[0], what=f"{what} out")
    assert_close_to_reference(lse[fin], lowp[1][fin], ref32[1][fin], what=f"{what} lse")


def _ranks(score):
    """Each entry's place in its row, best score first (0), ties in column order."""
    order = score.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(score.shape[1], device=score.device).expand_as(order))
    return rank


def every_block_selection(heads_k, rows, capacity, device):
    """Every block of a cache of ``capacity`` keys for each of ``rows`` rows, ``(heads_k, rows,
    n_blocks)`` int32 and contiguous (the kernels read the rows through its data pointer): dense
    attention as a selection, for checks against ``sparse_decode_kvcache``."""
    from .ops import _KERNEL_BLOCK, _KERNEL_MAX_TOPK

    n_blocks = -(-capacity // _KERNEL_BLOCK)
    if n_blocks > _KERNEL_MAX_TOPK:
        raise ValueError(f"dense attention over a cache (every block selected) needs a cache of at most "
                         f"{_KERNEL_BLOCK * _KERNEL_MAX_TOPK} keys a sequence here, got a capacity of {capacity}: pass "
                         f"a selection (topk_idx)")
    return torch.arange(n_blocks, dtype=torch.int32, device=device).expand(heads_k, rows, n_blocks).contiguous()


def realistic_topk(lengths_q, lengths_k, heads_k, topk, block=64, init_blocks=1, local_blocks=32, shared_extra=4,
                   correlated=True, device="cpu", seed=0, chunk=8192):
    """Selections shaped like InfLLM-V2's: int32 (heads_k, total_q, topk), rows ascending, -1 padded.

    Every token keeps the init blocks and its local window (``local_blocks`` blocks plus its own)
    and fills the rest of its ``topk`` with past blocks. ``correlated``: the tokens of one
    64-token query block draw their past blocks from one shared random candidate list of
    ``rest + shared_extra`` blocks, each token dropping ``shared_extra`` of them at random, so
    adjacent tokens share most of their picks (as in a model, where neighbouring queries score
    the same compressed keys alike). Otherwise every token draws its past blocks independently:
    the worst case for kernels that share K/V tiles across tokens.
    """
    g = torch.Generator(device=device).manual_seed(seed)
    dev = torch.device(device)
    parts = []
    for lq, lk in zip(lengths_q, lengths_k):
        nb = (lk + block - 1) // block
        out = torch.full((heads_k, lq, topk), -1, dtype=torch.int32, device=dev)
        ar = torch.arange(nb, device=dev)
        n_qb = (lk - 1) // block + 1 if lk else 0
        for h in range(heads_k):
            base = torch.rand((max(n_qb, 1), nb), generator=g, device=dev)
            for c0 in range(0, lq, chunk):
                c1 = min(lq, c0 + chunk)
                pos = torch.arange(lk - lq + c0, lk - lq + c1, device=dev)
                qblk = pos // block
                lo = torch.clamp(qblk - local_blocks, min=0)
                forced = (ar[None, :] >= lo[:, None]) & (ar[None, :] <= qblk[:, None])
                forced |= (ar[None, :] < init_blocks) & (ar[None, :] <= qblk[:, None])
                rest = torch.clamp(topk - forced.sum(1), min=0)
                past = (ar[None, :] >= init_blocks) & (ar[None, :] < lo[:, None])
                if correlated:
                    # the query block's shared ranking; keep its best rest + extra past blocks,
                    # then each token keeps a random `rest` of those
                    in_list = past & (_ranks(torch.where(past, base[qblk], -1.0)) < (rest + shared_extra)[:, None])
                    score = torch.where(in_list, torch.rand((c1 - c0, nb), generator=g, device=dev), -1.0)
                else:
                    score = torch.where(past, torch.rand((c1 - c0, nb), generator=g, device=dev), -1.0)
                # each row's `rest` best scores, by rank: a threshold on the score would take
                # every block tied with the rest-th best, and the row's cut to topk would then
                # drop its newest picks, the local window's
                picked = (_ranks(score) < rest[:, None]) & (score >= 0)
                sel = forced | picked
                idx = torch.where(sel, ar[None, :], nb + 1).sort(dim=1).values[:, :topk]
                idx = torch.where(idx > nb, -1, idx).to(torch.int32)
                out[h, c0:c1, : idx.shape[1]] = idx
        parts.append(out)
    return torch.cat(parts, dim=1)


def visible_pairs(topk_idx, lengths_q, lengths_k, block=64) -> int:
    """Query-key pairs a stage-2 call must compute, per KV group row (multiply by G for heads)."""
    total = 0
    off = 0
    for lq, lk in zip(lengths_q, lengths_k):
        idx = topk_idx[:, off : off + lq].long()
        pos = torch.arange(lk - lq, lk, device=idx.device)[None, :, None]
        vis = torch.clamp(pos - idx * block + 1, min=0, max=block)
        total += int(torch.where(idx >= 0, vis, 0).sum())
        off += lq
    return total


def tile_union_blocks(topk_idx, lengths_q, lengths_k, tile_tokens, block=64) -> int:
    """Blocks that stage 2's tiled kernels (forward, dQ) walk, summed over KV heads and tiles:
    a tile of ``tile_tokens`` consecutive queries of one sequence walks the union of its tokens'
    selections (entries >= 0 and not past the token's own block). With G = 16 a tile is 4 tokens,
    so ``tile_tokens * tile_union_blocks / (selected blocks)`` is how many GEMM rows a tile
    computes for each one that a selection asks for (1 when the 4 tokens picked the same blocks)."""
    total = 0
    off = 0
    for lq, lk in zip(lengths_q, lengths_k):
        idx = topk_idx[:, off : off + lq].long()
        own = (torch.arange(lk - lq, lk, device=idx.device) // block)[None, :, None]
        idx = torch.where((idx >= 0) & (idx <= own), idx, -1)
        idx = torch.nn.functional.pad(idx, (0, 0, 0, (-lq) % tile_tokens), value=-1)
        tiles = idx.reshape(idx.shape[0], -1, tile_tokens * idx.shape[2]).sort(dim=-1).values
        total += int((tiles[..., :1] >= 0).sum() + ((tiles[..., 1:] != tiles[..., :-1]) & (tiles[..., 1:] >= 0)).sum())
        off += lq
    return total


# ---------------------------------------------------------------------------- stage-1 judgement

# The stage-1 kernels compute in fp32 from the bf16/fp16 inputs, as the fp32 reference on the
# same inputs does: their scores must agree to fp32 rounding of sums of exponentials.
SCORE_RTOL = 2e-3
SCORE_ATOL = 1e-4


def scores_mismatch(got, want):
    """None if fp32 scores ``got`` match ``want`` within (SCORE_ATOL, SCORE_RTOL), else why not."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if torch.isnan(got).any():
        return "NaN (unwritten element?)"
    excess = (got.float() - want.float()).abs() - (SCORE_ATOL + SCORE_RTOL * want.float().abs())
    if excess.numel() and excess.max().item() > 0:
        return f"max excess error {excess.max().item():.3g} over the fp32 tolerance"
    return None


def selection_mismatch(idx, block_scores, topk):
    """None if ``idx`` is a valid top-``topk`` selection of ``block_scores``, else why not.

    ``idx`` int (Hk, total_q, K): picks ascending, -1 after them; ``block_scores`` fp32
    (Hk, total_q, nb), -inf for blocks that are not candidates. Tie-aware: the number of picks
    must be min(K, candidates), every pick a candidate, and a pick may differ from the exact
    top-K only where its score equals the K-th best within the score tolerance.
    """
    hk, tq, nb = block_scores.shape
    if tuple(idx.shape) != (hk, tq, topk):
        return f"shape {tuple(idx.shape)} != {(hk, tq, topk)}"
    if not ((idx >= -1) & (idx < max(nb, 1))).all():
        return "index out of range"
    valid = idx >= 0
    n_valid = valid.sum(-1)
    pos = torch.arange(topk, device=idx.device)
    if not torch.equal(valid, pos[None, None, :] < n_valid[..., None]):
        return "-1 before a valid entry"
    if not ((idx[..., 1:] > idx[..., :-1]) | ~valid[..., 1:]).all():
        return "picks not strictly ascending"
    picked = torch.zeros((hk, tq, nb + 1), dtype=torch.bool, device=idx.device)
    picked.scatter_(2, torch.where(valid, idx, nb).long(), True)
    picked = picked[..., :nb]
    cand = block_scores > float("-inf")
    if (picked & ~cand).any():
        return "a pick that is not a candidate (future block or no score)"
    if not torch.equal(n_valid, torch.clamp(cand.sum(-1), max=topk)):
        return "pick counts differ from min(K, candidates)"
    if nb == 0:
        return None
    kth = block_scores.topk(min(topk, nb), dim=-1).values[..., -1:]
    tol = SCORE_ATOL + SCORE_RTOL * kth.abs().nan_to_num(posinf=0.0, neginf=0.0)
    full = (cand.sum(-1) > topk)[..., None]
    if (picked & (block_scores < kth - tol) & full).any():
        return "a pick scores below the K-th best beyond tolerance"
    if (~picked & cand & (block_scores > kth + tol) & full).any():
        return "a block scoring above the K-th best was not picked"
    return None


def oracle_block_scores(q, k, cu_seqlens_q, cu_seqlens_k, init_blocks=1, local_blocks=32, approx_lse=True):
    """fp32 block scores (Hk, total_q, nb) to judge a CUDA selection by (``selection_mismatch``):
    the keys compressed by the library in the input dtype, as the selection kernel sees them,
    then the reference scores and pooling in fp32 on the CPU (compression 32/16 and 128/64)."""
    from . import ops, reference

    ck, cu_c = ops.compress_keys(k.detach(), cu_seqlens_k, 32, 16)
    nk, cu_n = ops.compress_keys(k.detach(), cu_seqlens_k, 128, 64) if approx_lse else (None, None)
    cu_q, cu_k, cu_c = (t.cpu() for t in (cu_seqlens_q, cu_seqlens_k, cu_c))
    S = reference.group_scores(q.detach().float().cpu(), ck.float().cpu(), cu_q, cu_k, cu_c, 32, 16, None,
                               None if nk is None else nk.float().cpu(), None if cu_n is None else cu_n.cpu(), 128, 64)
    return reference.max_pool_blocks(S, cu_q, cu_k, cu_c, 32, 16, 64, init_blocks, local_blocks)


# ---------------------------------------------------------------------------- norm-based rule


def norm_error_ratio(out: torch.Tensor, lowp: torch.Tensor, ref32: torch.Tensor) -> tuple[float, float]:
    """(||out - ref32|| / ||ref32||, ||lowp - ref32|| / ||ref32||): relative Frobenius errors, in fp64."""
    ref = ref32.double()
    scale = max(torch.linalg.vector_norm(ref).item(), torch.finfo(torch.float64).tiny)
    return (torch.linalg.vector_norm(out.double() - ref).item() / scale,
            torch.linalg.vector_norm(lowp.double() - ref).item() / scale)


def within_norm_error_rule(out, lowp, ref32, factor=2.0, floor=0.0) -> tuple[bool, float, float]:
    """``within_error_rule`` on relative Frobenius errors instead of the worst element.

    For results where a few elements may legitimately differ by more than rounding, e.g. a
    whole model step in which a top-k block selection can flip on a near-tie in any run: the
    norm measures the precision of the whole tensor. ``floor`` is a relative error below which
    the result passes whatever ``lowp`` did. Returns ``(ok, err, lowp_err)``; a NaN or inf
    anywhere in ``out`` fails.
    """
    if out.numel() == 0:
        return True, 0.0, 0.0
    err, base = norm_error_ratio(out, lowp, ref32)
    ok = bool(torch.isfinite(out).all().item()) and err <= factor * base + floor
    return ok, err, base


def assert_norm_close_to_reference(out, lowp, ref32, factor=2.0, what="output", floor=0.0):
    assert out.shape == ref32.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref32.shape)}"
    ok, err, base = within_norm_error_rule(out, lowp, ref32, factor, floor)
    assert ok, (f"{what}: relative error {err:.3g} > {factor} x PyTorch {lowp.dtype} relative error {base:.3g}"
                f" + floor {floor:.3g}")


def kv_cache_of(k, v, lengths_k, layout, seed=0, spare=37):
    """k, v (packed by lengths_k) stored in a KV cache: (k_cache, v_cache, block_table or None).

    Layouts: "padded" (a page of max(lengths_k) + spare rows a sequence, in batch order);
    "batch_idx" (padded, 3 more pages than sequences, sequence b in page block_table[b, 0] of a
    random permutation: FlashAttention's cache_batch_idx); "paged<P>" (pages of P keys, one more a
    sequence than it needs, shuffled). Rows holding no key of the batch are NaN, which no result
    may see."""
    batch, (heads_k, D) = len(lengths_k), k.shape[1:]
    g = torch.Generator().manual_seed(seed)
    if layout in ("padded", "batch_idx"):
        page = max(lengths_k) + spare
        pages = batch + (3 if layout == "batch_idx" else 0)
        table = torch.randperm(pages, generator=g)[:batch].view(batch, 1) if layout == "batch_idx" else None
    else:
        page = int(layout[5:])
        per_seq = -(-max(lengths_k) // page) + 1
        pages = batch * per_seq + 3
        table = torch.randperm(pages, generator=g)[: batch * per_seq].view(batch, per_seq)
    kc = torch.full((pages, page, heads_k, D), float("nan"), dtype=k.dtype)
    vc = kc.clone()
    start = 0
    for b, n in enumerate(lengths_k):
        for j in range(0, n, page):
            m = min(page, n - j)
            p = int(table[b, j // page]) if table is not None else b
            kc[p, :m] = k[start + j : start + j + m].cpu()
            vc[p, :m] = v[start + j : start + j + m].cpu()
        start += n
    dev = k.device
    return kc.to(dev), vc.to(dev), None if table is None else table.to(device=dev, dtype=torch.int32)


def punct_cache_of(punct_mask, lengths_k, layout, seed=0, spare=37):
    """A packed bool punctuation mask (total_k,) laid out as ``kv_cache_of`` lays out keys of the
    same lengths, layout and seed: ``(punct_cache (num_pages, page_size) bool, block_table)``, on
    the mask's device, False on rows that hold no key."""
    f = punct_mask.double().view(-1, 1, 1)
    fc, _, table = kv_cache_of(f, f, lengths_k, layout, seed, spare)
    return fc.view(fc.shape[:2]) == 1, table


@contextlib.contextmanager
def no_host_sync():
    """Raises if the body synchronises the host with the GPU (torch's sync debug mode), as a
    CUDA-graph capture or a decoding loop needs; waits for earlier work first."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@functools.cache
def _hf_cache_name() -> str:
    # read once: the benchmarks call hf_cache_kwargs in their timed decoding steps
    import inspect

    import transformers

    return "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters \
        else "past_key_values"


def hf_cache_kwargs(cache) -> dict:
    """``{name: cache}`` for a transformers model's forward or generate, by the name the installed
    transformers takes: ``cache`` (``past_key_values`` is deprecated, to go in 5.40) or, in older
    5.x releases, ``past_key_values``."""
    return {_hf_cache_name(): cache}
