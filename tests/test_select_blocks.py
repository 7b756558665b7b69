"""select_blocks (stage 1): the fused selection kernel, the scores path and pooling, every layer.

The oracle is the reference run in fp32 on the same compressed keys the kernels see (the keys
are bf16/fp16 values, so their fp32 copies are exact): the kernels accumulate in fp32, and
the scores must match within fp32 tolerance. Selections are compared tie-aware: a pick may
differ from the reference only where its score equals the K-th best within that tolerance.
"""

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.ops import group_scores_launch, max_pool_blocks_launch, select_blocks_launch
from infllmv2.testing import (cu_seqlens, max_seqlen, no_host_sync, random_tokens, scores_mismatch,
                              selection_mismatch)

HQ_FOR_G = {1: 2, 2: 4, 4: 8, 8: 8, 16: 16, 32: 32}
LENGTH_MIXES = {
    "short": ([1, 5, 31, 32, 33], [1, 5, 31, 32, 33]),  # at and below one compression window
    "63": ([63], [63]),
    "64": ([64], [64]),
    "65": ([65], [65]),
    "mix": ([1, 63, 64, 65, 200, 257, 3, 700, 1500], [1, 63, 64, 65, 200, 257, 3, 700, 1500]),
    # Lq < Lk: chunked prefill and one-token decode rows against a longer cache
    "chunked": ([1, 17, 64, 100, 1, 1], [300, 64, 130, 700, 1000, 2100]),
}
POISON_IDX = -7  # no valid output is -7: an unwritten slot cannot pass



def _inputs(lengths_q, lengths_k, G, D, dtype, heads_k=2, seed=0, approx=True, qscale=1.0):
    q = random_tokens(lengths_q, G * heads_k, D, dtype, "cuda", seed=seed, scale=qscale)
    k = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 1)
    cu_q, cu_k = cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda")
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
    nk, cu_n = infllmv2.compress_keys(k, cu_k, 128, 64) if approx else (None, None)
    return q, k, cu_q, cu_k, ck, cu_c, nk, cu_n


def _oracle_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n):
    return reference.group_scores(q.float(), ck.float(), cu_q, cu_k, cu_c, 32, 16, None,
                                  None if nk is None else nk.float(), cu_n, 128, 64)


def _kernel_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n, width):
    out = torch.full((ck.shape[1], q.shape[0], width), float("nan"), device=q.device)
    group_scores_launch(q, ck, nk, cu_q, cu_k, cu_c, cu_n, out, 128, 64, 0.0, max_seqlen(cu_q))
    return out


def _kernel_select(q, ck, cu_q, cu_k, cu_c, nk, cu_n, topk, init_blocks=1, local_blocks=32):
    out = torch.full((ck.shape[1], q.shape[0], topk), POISON_IDX, dtype=torch.int32, device=q.device)
    select_blocks_launch(q, ck, nk, cu_q, cu_k, cu_c, cu_n, out, init_blocks, local_blocks, 128, 64, 0.0,
                         max_seqlen(cu_q), max_seqlen(cu_k))
    return out


def assert_scores_close(got, want, what):
    msg = scores_mismatch(got, want)
    assert msg is None, f"{what}: {msg}"


def assert_selection_tie_aware(idx, block_scores, topk, what):
    assert not (idx == POISON_IDX).any(), f"{what}: unwritten slots"
    msg = selection_mismatch(idx, block_scores, topk)
    assert msg is None, f"{what}: {msg}"


def _oracle_blocks(S, cu_q, cu_k, cu_c, init_blocks=1, local_blocks=32):
    return reference.max_pool_blocks(S, cu_q, cu_k, cu_c, 32, 16, 64, init_blocks, local_blocks)


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("lengths", list(LENGTH_MIXES), ids=list(LENGTH_MIXES))
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_scores_pooling_and_selection(dtype, D, G, lengths, approx):
    lq, lk = LENGTH_MIXES[lengths]
    q, k, cu_q, cu_k, ck, cu_c, nk, cu_n = _inputs(lq, lk, G, D, dtype, heads_k=HQ_FOR_G[G] // G, approx=approx)
    want_S = _oracle_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n)
    width = max(want_S.shape[2], 1)
    got_S = _kernel_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n, width)
    torch.cuda.synchronize()
    assert_scores_close(got_S[:, :, : want_S.shape[2]], want_S, f"group_scores {lengths}")
    assert (got_S[:, :, want_S.shape[2]:] == 0).all()

    want_B = _oracle_blocks(want_S, cu_q, cu_k, cu_c)
    got_B = torch.full_like(want_B, float("nan"))
    max_pool_blocks_launch(got_S, cu_q, cu_k, cu_c, got_B, 1, 32, max_seqlen(cu_q))
    want_B_from_got = _oracle_blocks(got_S[:, :, : want_S.shape[2]], cu_q, cu_k, cu_c)
    torch.cuda.synchronize()
    assert torch.equal(got_B, want_B_from_got), "max_pool_blocks differs from the reference pooling of the same S"

    for topk in (1, 4, 7, 96):
        idx = _kernel_select(q, ck, cu_q, cu_k, cu_c, nk, cu_n, topk)
        torch.cuda.synchronize()
        assert_selection_tie_aware(idx, want_B, topk, f"select_blocks {lengths} K={topk}")


@pytest.mark.gpu
@pytest.mark.parametrize("approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("init_blocks,local_blocks", [(1, 32), (0, 0), (3, 2), (1, 5)])
@pytest.mark.parametrize("topk", [1, 16, 64, 96, 128, 300])
def test_selection_long(topk, init_blocks, local_blocks, approx):
    """Sequences of thousands of tokens: many more candidates than K, so the radix select decides."""
    lq, lk = [4000, 2500, 1], [4000, 3000, 5000]
    q, k, cu_q, cu_k, ck, cu_c, nk, cu_n = _inputs(lq, lk, 16, 128, torch.bfloat16, approx=approx, qscale=3.0)
    S = _oracle_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n)
    want_B = _oracle_blocks(S, cu_q, cu_k, cu_c, init_blocks, local_blocks)
    idx = _kernel_select(q, ck, cu_q, cu_k, cu_c, nk, cu_n, topk, init_blocks, local_blocks)
    torch.cuda.synchronize()
    assert_selection_tie_aware(idx, want_B, topk, f"K={topk} init={init_blocks} local={local_blocks}")


@pytest.mark.gpu
def test_selection_ties_go_to_lower_blocks():
    """Equal scores everywhere (q = 0): every candidate ties, the lowest blocks must win."""
    lq = lk = [3000]
    q, k, cu_q, cu_k, ck, cu_c, nk, cu_n = _inputs(lq, lk, 4, 64, torch.float16)
    q = torch.zeros_like(q)
    idx = _kernel_select(q, ck, cu_q, cu_k, cu_c, nk, cu_n, 8, init_blocks=0, local_blocks=0)
    torch.cuda.synchronize()
    pos = torch.arange(3000, device="cuda")
    qb = pos // 64
    for slot in range(8):
        # the forced current block plus the 7 lowest (tied) blocks; all candidates when fewer
        want = torch.where(qb < 8, torch.where(qb >= slot, slot, -1), qb if slot == 7 else torch.full_like(qb, slot))
        assert torch.equal(idx[0, :, slot].long(), want.long()), f"slot {slot}"


@pytest.mark.gpu
def test_select_blocks_end_to_end_and_deterministic():
    """infllmv2.select_blocks from raw keys against the reference on the kernel's compressed keys."""
    lq, lk = [700, 1, 2000], [900, 4096, 2000]
    G, D = 16, 128
    q = random_tokens(lq, 2 * G, D, torch.bfloat16, "cuda", seed=3)
    k = random_tokens(lk, 2, D, torch.bfloat16, "cuda", seed=4)
    cu_q, cu_k = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    for approx in (True, False):
        idx = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=96, approx_lse=approx)
        again = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=96, approx_lse=approx)
        ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
        nk, cu_n = infllmv2.compress_keys(k, cu_k, 128, 64) if approx else (None, None)
        want_B = _oracle_blocks(_oracle_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n), cu_q, cu_k, cu_c)
        torch.cuda.synchronize()
        assert torch.equal(idx, again), "selection is not deterministic"
        assert_selection_tie_aware(idx, want_B, 96, f"select_blocks approx={approx}")
    # the scores path through the public functions
    S = infllmv2.group_scores(q, ck, cu_q, cu_k, cu_c)
    B = infllmv2.max_pool_blocks(S, cu_q, cu_k, cu_c)
    assert B.shape == (2, sum(lq), (max(lk) + 63) // 64)
    assert torch.equal(B, _oracle_blocks(S, cu_q, cu_k, cu_c))


@pytest.mark.gpu
@pytest.mark.parametrize("phsa", [False, True], ids=["plain", "phsa"])
def test_select_blocks_without_host_reads(phsa):
    """With max_seqlen_q/k given, select_blocks sizes the compressed keys by a bound and computes
    their offsets on the GPU: no host synchronisation, and the same picks as the checked path."""
    lq, lk = [1, 63, 700, 65, 64, 3000], [1, 64, 900, 65, 4096, 3000]
    q = random_tokens(lq, 32, 128, torch.bfloat16, "cuda", seed=5)
    k = random_tokens(lk, 2, 128, torch.bfloat16, "cuda", seed=6)
    cu_q, cu_k = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    mask = (torch.rand(sum(lk), device="cuda") < 0.2) if phsa else None
    for approx in (True, False):
        want = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=40, approx_lse=approx, punct_mask=mask)
        with no_host_sync():
            got = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=40, approx_lse=approx, punct_mask=mask,
                                         max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        assert torch.equal(got, want), f"approx={approx}: the host-free path picks differently"
    # an upper bound beyond every sequence (and beyond the keys there are) is fine too
    got = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=40, punct_mask=mask, max_seqlen_q=max(lq),
                                 max_seqlen_k=4 * sum(lk))
    assert torch.equal(got, infllmv2.select_blocks(q, k, cu_q, cu_k, topk=40, punct_mask=mask,
                                                   max_seqlen_k=4 * sum(lk)))


@pytest.mark.gpu
def test_select_blocks_phsa_and_scale():
    lq = lk = [1500]
    q = random_tokens(lq, 8, 64, torch.float16, "cuda", seed=5)
    k = random_tokens(lk, 2, 64, torch.float16, "cuda", seed=6)
    cu = cu_seqlens(lq, "cuda")
    punct = torch.rand(1500, device="cuda") < 0.1
    idx = infllmv2.select_blocks(q, k, cu, cu, topk=12, init_blocks=0, local_blocks=1, punct_mask=punct,
                                 phsa_lambda=0.3, softmax_scale=0.2)
    ck, cu_c = infllmv2.compress_keys(k, cu, 32, 16, punct, 0.3)
    nk, cu_n = infllmv2.compress_keys(k, cu, 128, 64, punct, 0.3)
    S = reference.group_scores(q.float(), ck.float(), cu, cu, cu_c, 32, 16, 0.2, nk.float(), cu_n, 128, 64)
    torch.cuda.synchronize()
    assert_selection_tie_aware(idx, _oracle_blocks(S, cu, cu, cu_c, 0, 1), 12, "phsa, scale 0.2")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])  # every register group-sum path (GROUP_SUM_CUDA)
def test_forced_arch_through_ptx(arch_override, arch, G):
    if arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} is not in this build")
    arch_override(arch)
    lq, lk = [1, 63, 65, 700, 1], [1, 63, 65, 900, 2000]
    q, k, cu_q, cu_k, ck, cu_c, nk, cu_n = _inputs(lq, lk, G, 128, torch.bfloat16, heads_k=HQ_FOR_G[G] // G)
    want_S = _oracle_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n)
    got_S = _kernel_scores(q, ck, cu_q, cu_k, cu_c, nk, cu_n, want_S.shape[2])
    idx = _kernel_select(q, ck, cu_q, cu_k, cu_c, nk, cu_n, 16, 1, 4)
    torch.cuda.synchronize()
    assert infllmv2.selected_arch() == arch
    assert_scores_close(got_S, want_S, f"{arch} group_scores")
    assert_selection_tie_aware(idx, _oracle_blocks(want_S, cu_q, cu_k, cu_c, 1, 4), 16, f"{arch} select_blocks")


@pytest.mark.gpu
def test_select_blocks_errors():
    q = random_tokens([100], 4, 128, torch.bfloat16, "cuda")
    k = random_tokens([100], 2, 128, torch.bfloat16, "cuda")
    cu = cu_seqlens([100], "cuda")
    with pytest.raises(ValueError, match="kernel_size/kernel_stride"):
        infllmv2.select_blocks(q, k, cu, cu, kernel_size=64, kernel_stride=32)
    with pytest.raises(ValueError, match="block_size"):
        infllmv2.select_blocks(q, k, cu, cu, block_size=128)
    with pytest.raises(ValueError, match="topk"):
        infllmv2.select_blocks(q, k, cu, cu, topk=0)
    with pytest.raises(ValueError, match="k must match q"):
        infllmv2.select_blocks(q, k.half(), cu, cu)
    with pytest.raises(ValueError, match="softmax_scale"):
        infllmv2.select_blocks(q, k, cu, cu, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        infllmv2.select_blocks(q, k, cu.long(), cu)
    ck, cu_c = infllmv2.compress_keys(k, cu, 32, 16)
    out = torch.empty((2, 100, 8), dtype=torch.int32, device="cuda")
    # sequences longer than the block-score buffer: a clear error, not a fault
    with pytest.raises(infllmv2.Infllmv2UnsupportedError, match="max_seqlen_k"):
        select_blocks_launch(q, ck, None, cu, cu, cu_c, None, out, 1, 32, 128, 64, 0.0, 100, 1 << 20)
    with pytest.raises(infllmv2.Infllmv2ArgumentError, match="max_seqlen_k"):
        select_blocks_launch(q, ck, None, cu, cu, cu_c, None, out, 1, 32, 128, 64, 0.0, 100, 50)
    with pytest.raises(infllmv2.Infllmv2ArgumentError, match="init_blocks"):
        select_blocks_launch(q, ck, None, cu, cu, cu_c, None, out, -1, 32, 128, 64, 0.0, 100, 100)
    host = torch.empty((2, 100, 8), dtype=torch.int32)
    with pytest.raises(infllmv2.Infllmv2ArgumentError, match="topk_idx"):
        select_blocks_launch(q, ck, None, cu, cu, cu_c, None, host, 1, 32, 128, 64, 0.0, 100, 100)


# ---------------------------------------------------------------------------------- CPU tier


def test_cpu_path_is_the_reference():
    lq, lk = [5, 70], [40, 200]
    q = random_tokens(lq, 4, 16, torch.float32, seed=1)
    k = random_tokens(lk, 2, 16, torch.float32, seed=2)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    got = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=3, local_blocks=0)
    want = reference.select_blocks(q, k, cu_q, cu_k, topk=3, local_blocks=0)
    assert torch.equal(got, want)
    ck, cu_c = reference.compress_keys(k, cu_k)
    S = infllmv2.group_scores(q, ck, cu_q, cu_k, cu_c, width=20)
    assert S.shape == (2, 75, 20) and (S[:, :, 11:] == 0).all()
    B = infllmv2.max_pool_blocks(S, cu_q, cu_k, cu_c, n_blocks=6)
    assert B.shape == (2, 75, 6) and (B[:, :, 4:] == float("-inf")).all()


def test_selection_checker_rejects_wrong_picks():
    """The tie-aware checker itself: it must fail a wrong selection and pass a tied swap."""
    scores = torch.tensor([[[0.5, 0.9, 0.1, 0.9, float("-inf")]]])
    assert_selection_tie_aware(torch.tensor([[[1, 3]]], dtype=torch.int32), scores, 2, "exact")
    with pytest.raises(AssertionError):
        assert_selection_tie_aware(torch.tensor([[[0, 1]]], dtype=torch.int32), scores, 2, "wrong")
    with pytest.raises(AssertionError):
        assert_selection_tie_aware(torch.tensor([[[3, 1]]], dtype=torch.int32), scores, 2, "unsorted")
    with pytest.raises(AssertionError):
        assert_selection_tie_aware(torch.tensor([[[1, 4]]], dtype=torch.int32), scores, 2, "non-candidate")
    tied = torch.tensor([[[0.5, 0.9, 0.9, 0.9, 0.0]]])
    assert_selection_tie_aware(torch.tensor([[[1, 2]]], dtype=torch.int32), tied, 2, "tie")
    assert_selection_tie_aware(torch.tensor([[[2, 3]]], dtype=torch.int32), tied, 2, "tie")


@pytest.mark.gpu
def test_inconsistent_cu_seqlens_cannot_fault():
    """Offsets that point past the tensors (and a too small max_seqlen_k) give garbage picks,
    never an illegal access."""
    q = random_tokens([100], 32, 128, torch.bfloat16, "cuda")
    ck = random_tokens([6], 2, 128, torch.bfloat16, "cuda")
    cu_q = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 1_000_000], dtype=torch.int32, device="cuda")
    cu_c = torch.tensor([0, 60_000], dtype=torch.int32, device="cuda")
    out = torch.empty((2, 100, 96), dtype=torch.int32, device="cuda")
    select_blocks_launch(q, ck, None, cu_q, cu_k, cu_c, None, out, 1, 32, 128, 64, 0.0, 100, 5000)
    S = torch.empty((2, 100, 64), dtype=torch.float32, device="cuda")
    group_scores_launch(q, ck, ck, cu_q, cu_k, cu_c, cu_c, S, 128, 64, 0.0, 100)
    B = torch.empty((2, 100, 8), dtype=torch.float32, device="cuda")
    max_pool_blocks_launch(S, cu_q, cu_k, cu_c, B, 1, 32, 100)
    torch.cuda.synchronize()  # an illegal address would surface here


# C ABI argument checks run before any device access: the CPU tier checks them too.

def _select_status(**kw):
    args = dict(q=1, ck=1, nk=None, cu_q=1, cu_k=1, cu_c=1, cu_n=None, out=1, batch=1, total_q=10, total_c=2,
                total_n=0, max_q=10, max_k=40, heads=32, heads_k=2, head_dim=128, topk=8, init=1, local=2, nks=128,
                nkst=64, dtype=_lib.DTYPE_BF16, scale=0.0)
    args.update(kw)
    lib = _lib.lib()
    status = lib.infllmv2_select_blocks(*args.values(), None)
    return status, lib.infllmv2_last_error().decode()


@pytest.mark.parametrize(
    "kwargs, status, message",
    [
        (dict(head_dim=96), _lib.ERR_UNSUPPORTED, "head_dim must be 64 or 128, got 96"),
        (dict(dtype=_lib.DTYPE_FP16 + 1), _lib.ERR_INVALID_ARGUMENT, "dtype must be INFLLMV2_DTYPE_BF16"),
        (dict(heads=31), _lib.ERR_INVALID_ARGUMENT, "heads \\(31\\) must be a multiple of heads_k \\(2\\)"),
        (dict(heads=256), _lib.ERR_UNSUPPORTED, "group size heads/heads_k = 128 exceeds 64"),
        (dict(topk=0), _lib.ERR_UNSUPPORTED, "topk must be in \\[1, 8192\\], got 0"),
        (dict(init=-1), _lib.ERR_INVALID_ARGUMENT, "init_blocks and local_blocks must be >= 0"),
        (dict(max_k=5), _lib.ERR_INVALID_ARGUMENT, "max_seqlen_k must be >= max_seqlen_q \\(10\\)"),
        (dict(max_q=11), _lib.ERR_INVALID_ARGUMENT, "max_seqlen_q must be in \\[0, total_q=10\\], got 11"),
        (dict(nk=1, nks=0), _lib.ERR_INVALID_ARGUMENT, "norm_kernel_size and norm_kernel_stride must be >= 1"),
        (dict(scale=-1.0), _lib.ERR_INVALID_ARGUMENT, "softmax_scale must be finite and >= 0"),
    ],
)
def test_select_blocks_c_abi_names_bad_arguments(kwargs, status, message):
    import re

    got, text = _select_status(**kwargs)
    assert got == status, text
    assert text.startswith("infllmv2_select_blocks: ") and re.search(message, text), text


def test_group_scores_and_max_pool_c_abi_name_bad_arguments():
    lib = _lib.lib()
    st = lib.infllmv2_group_scores(1, 1, None, 1, 1, 1, None, 1, 1, 10, 2, 0, 10, 0, 32, 2, 128, 128, 64,
                                   _lib.DTYPE_BF16, 0.0, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "width must be >= 1, got 0" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_max_pool_blocks(1, 1, 1, 1, 1, 1, 10, 4, 0, 10, 2, 1, 32, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "width and n_blocks must be >= 1" in lib.infllmv2_last_error().decode()
    st = lib.infllmv2_max_pool_blocks(1, 1, 1, 1, 1, 1, 10, 4, 2, 10, 2, -1, 32, None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "init_blocks and local_blocks" in lib.infllmv2_last_error().decode()
