"""select_decode (stage 1 split over the compressed keys): kernels against the reference.

The oracle is test_select_blocks': the reference scores and pooling in fp32 on the compressed
keys the kernels see, selections compared tie-aware (a pick may differ from the reference only
where its score equals the K-th best within the fp32 score tolerance).
"""

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.ops import _KERNEL_DTYPES, select_decode_splits
from infllmv2.testing import cu_seqlens, no_host_sync, random_tokens, selection_mismatch

POISON_IDX = -7  # no valid output is -7: an unwritten slot cannot pass

# (query lengths, key lengths, topk, local_blocks): one decoding token a sequence against caches
# of 1, 63, 64, 65 keys and mixes; a few tokens a sequence (speculative decoding); long caches
# whose compressed keys span many 64-key chunks (MiniCPM4's K and window); a chunked-prefill mix
CASES = {
    "decode1": ([1], [1], 12, 2),
    "decode63": ([1], [63], 12, 2),
    "decode64": ([1], [64], 12, 2),
    "decode65": ([1], [65], 12, 2),
    "decode_mix": ([1, 1, 1, 1, 1], [3000, 63, 64, 65, 777], 12, 2),
    "spec": ([3, 5, 1, 2], [2000, 65, 130, 4001], 12, 2),
    "long": ([1, 1, 3], [20000, 5000, 9001], 96, 32),
    "chunked": ([1, 17, 64, 100, 1, 1], [300, 64, 130, 700, 1000, 2100], 7, 1),
}


def _inputs(lengths_q, lengths_k, G, D, dtype, heads_k=2, seed=0):
    q = random_tokens(lengths_q, G * heads_k, D, dtype, "cuda", seed=seed, scale=2.0)
    k = random_tokens(lengths_k, heads_k, D, dtype, "cuda", seed=seed + 1)
    return q, k, cu_seqlens(lengths_q, "cuda"), cu_seqlens(lengths_k, "cuda")


def _oracle_blocks(q, k, cu_q, cu_k, approx, init_blocks, local_blocks, punct=None, lam=0.5, scale=None):
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16, punct, lam)
    nk, cu_n = infllmv2.compress_keys(k, cu_k, 128, 64, punct, lam) if approx else (None, None)
    S = reference.group_scores(q.float(), ck.float(), cu_q, cu_k, cu_c, 32, 16, scale,
                               None if nk is None else nk.float(), cu_n, 128, 64)
    return reference.max_pool_blocks(S, cu_q, cu_k, cu_c, 32, 16, 64, init_blocks, local_blocks)


def _select_poisoned(q, k, cu_q, cu_k, topk, splits, approx=True, init_blocks=1, local_blocks=32, punct=None,
                     lam=0.5, scale=0.0):
    """The C call into a poisoned selection and a NaN-filled workspace, so that nothing unwritten can pass."""
    lib = _lib.lib()
    batch, lq, lk = cu_q.numel() - 1, cu_q.diff().max().item(), cu_k.diff().max().item()
    size = lib.infllmv2_select_decode_workspace_size(batch, q.shape[0], k.shape[0], lq, lk, q.shape[1], k.shape[1],
                                                     q.shape[2], int(approx), 64, splits)
    assert size > 0
    ws = torch.full((size,), 0xFF, dtype=torch.uint8, device="cuda")  # fp32 NaN everywhere
    out = torch.full((k.shape[1], q.shape[0], topk), POISON_IDX, dtype=torch.int32, device="cuda")
    st = lib.infllmv2_select_decode(
        q.data_ptr(), k.data_ptr(), cu_q.data_ptr(), cu_k.data_ptr(), 0 if punct is None else punct.data_ptr(), lam,
        out.data_ptr(), ws.data_ptr(), size, batch, q.shape[0], k.shape[0], lq, lk, q.shape[1], k.shape[1],
        q.shape[2], topk, init_blocks, local_blocks, int(approx), 128, 64, _KERNEL_DTYPES[q.dtype], scale, splits,
        torch.cuda.current_stream().cuda_stream)
    _lib.check(st)
    return out


def _assert_selection(idx, blocks, topk, what):
    assert not (idx == POISON_IDX).any(), f"{what}: unwritten slots"
    msg = selection_mismatch(idx, blocks, topk)
    assert msg is None, f"{what}: {msg}"


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("approx", [True, False], ids=["approx", "exact"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_reference(dtype, D, G, case, approx):
    lq, lk, topk, local = CASES[case]
    q, k, cu_q, cu_k = _inputs(lq, lk, G, D, dtype, heads_k=1 if G == 32 else 2, seed=G + D)
    blocks = _oracle_blocks(q, k, cu_q, cu_k, approx, 1, local)
    # 3 ranges a tile, and more ranges than chunks (empty ones)
    for splits in (3, 40):
        idx = _select_poisoned(q, k, cu_q, cu_k, topk, splits, approx, 1, local)
        torch.cuda.synchronize()
        _assert_selection(idx, blocks, topk, f"{dtype} D{D} G{G} {case} approx={approx} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [3, 64])
def test_odd_and_largest_groups(G):
    # G = 3 leaves rows of every tile idle (21 tokens x 3 heads); G = 64 is one token a tile
    for case in ("decode_mix", "spec", "long"):
        lq, lk, topk, local = CASES[case]
        q, k, cu_q, cu_k = _inputs(lq, lk, G, 128, torch.bfloat16, heads_k=1, seed=G)
        idx = _select_poisoned(q, k, cu_q, cu_k, topk, 6, True, 1, local)
        torch.cuda.synchronize()
        _assert_selection(idx, _oracle_blocks(q, k, cu_q, cu_k, True, 1, local), topk, f"G{G} {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("init_blocks,local_blocks", [(0, 0), (3, 2), (1, 32)])
@pytest.mark.parametrize("topk", [1, 64, 300])
def test_selection_long_many_candidates(topk, init_blocks, local_blocks):
    """Tens of thousands of keys: many more candidates than K, so the radix select decides."""
    lq, lk = [1, 2], [60000, 33000]
    q, k, cu_q, cu_k = _inputs(lq, lk, 16, 128, torch.bfloat16, seed=7)
    blocks = _oracle_blocks(q, k, cu_q, cu_k, True, init_blocks, local_blocks)
    idx = _select_poisoned(q, k, cu_q, cu_k, topk, 17, True, init_blocks, local_blocks)
    torch.cuda.synchronize()
    _assert_selection(idx, blocks, topk, f"K={topk} init={init_blocks} local={local_blocks}")


@pytest.mark.gpu
@pytest.mark.parametrize("G", [4, 16])
def test_auto_splits_one_long_sequence(G):
    # one token against 100K keys: the tiles alone are Hk = 2 thread blocks, so the library splits
    lq, lk = [1], [100_000]
    q, k, cu_q, cu_k = _inputs(lq, lk, G, 128, torch.bfloat16, seed=G)
    splits = select_decode_splits(q, k, cu_q, 1, 100_000)
    assert 1 < splits <= 64, splits
    got = infllmv2.select_decode(q, k, cu_q, cu_k, topk=96, max_seqlen_q=1, max_seqlen_k=100_000)
    assert torch.equal(got, _select_poisoned(q, k, cu_q, cu_k, 96, splits))
    torch.cuda.synchronize()
    _assert_selection(got, _oracle_blocks(q, k, cu_q, cu_k, True, 1, 32), 96, f"auto G{G}")


@pytest.mark.gpu
def test_auto_splits_nothing_where_the_tiles_fill_the_gpu():
    # 8 x 2000 queries at G = 16: a thousand tiles. The library runs select_blocks, bitwise.
    lq = lk = [2000] * 8
    q, k, cu_q, cu_k = _inputs(lq, lk, 16, 128, torch.bfloat16)
    assert select_decode_splits(q, k, cu_q, 2000, 2000) == 1
    got = infllmv2.select_decode(q, k, cu_q, cu_k, topk=16, local_blocks=2)
    assert torch.equal(got, infllmv2.select_blocks(q, k, cu_q, cu_k, topk=16, local_blocks=2))


@pytest.mark.gpu
def test_bitwise_deterministic_and_phsa_and_scale():
    lq, lk = [1, 2, 1], [9000, 4000, 100]
    q, k, cu_q, cu_k = _inputs(lq, lk, 16, 128, torch.bfloat16, seed=3)
    punct = torch.rand(sum(lk), device="cuda") < 0.1
    first = _select_poisoned(q, k, cu_q, cu_k, 20, 7, True, 0, 1, punct, 0.3, 0.2)
    for _ in range(3):
        assert torch.equal(first, _select_poisoned(q, k, cu_q, cu_k, 20, 7, True, 0, 1, punct, 0.3, 0.2))
    torch.cuda.synchronize()
    _assert_selection(first, _oracle_blocks(q, k, cu_q, cu_k, True, 0, 1, punct, 0.3, 0.2), 20, "phsa, scale 0.2")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
@pytest.mark.parametrize("G", [1, 4, 16])
def test_portable_arch_variants_through_ptx(arch, G, arch_override):
    if arch not in infllmv2.build_info()["archs"]:
        pytest.skip(f"{arch} not compiled into this build")
    arch_override(arch)
    for dtype, D in ((torch.bfloat16, 128), (torch.float16, 64)):
        for case in ("decode_mix", "spec", "long"):
            lq, lk, topk, local = CASES[case]
            q, k, cu_q, cu_k = _inputs(lq, lk, G, D, dtype, seed=G)
            idx = _select_poisoned(q, k, cu_q, cu_k, topk, 5, True, 1, local)
            torch.cuda.synchronize()
            _assert_selection(idx, _oracle_blocks(q, k, cu_q, cu_k, True, 1, local), topk, f"{arch} G{G} {case}")


@pytest.mark.gpu
def test_attention_decodes_through_the_split_selection():
    # infllmv2.attention in a decoding step (one token a sequence against 20K keys, sparse path)
    # selects through select_decode, with no host synchronisation
    cfg = infllmv2.SparseConfig()
    lq, lk = [1, 1], [20000, 9000]
    q, k, cu_q, cu_k = _inputs(lq, lk, 16, 128, torch.bfloat16, seed=4)
    v = random_tokens(lk, 2, 128, torch.bfloat16, "cuda", seed=9)
    assert select_decode_splits(q, k, cu_q, 1, 20000) > 1
    with torch.no_grad():
        with no_host_sync():
            out = infllmv2.attention(q, k, v, cu_q, cu_k, 1, 20000, config=cfg)
            idx = infllmv2.select_decode(q, k, cu_q, cu_k, topk=cfg.num_selected, local_blocks=cfg.local_blocks,
                                         max_seqlen_q=1, max_seqlen_k=20000)
        assert torch.equal(out, infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx))
    _assert_selection(idx, _oracle_blocks(q, k, cu_q, cu_k, True, 1, cfg.local_blocks), cfg.num_selected,
                      "attention's selection")


@pytest.mark.gpu
def test_torch_compile_fullgraph():
    lq, lk = [1, 1], [3000, 7000]
    q, k, cu_q, cu_k = _inputs(lq, lk, 16, 128, torch.bfloat16)

    def f(q, k):
        return infllmv2.select_decode(q, k, cu_q, cu_k, topk=16, max_seqlen_q=1, max_seqlen_k=7000, num_splits=4)

    assert torch.equal(torch.compile(f, fullgraph=True)(q, k), f(q, k))


@pytest.mark.gpu
def test_cuda_bad_inputs():
    q, k, cu_q, cu_k = _inputs([1], [6400], 4, 128, torch.bfloat16)
    call = infllmv2.select_decode
    with pytest.raises(ValueError, match="num_splits must be at most 64"):
        call(q, k, cu_q, cu_k, num_splits=65)
    with pytest.raises(ValueError, match="block_size must be 64 on CUDA"):
        call(q, k, cu_q, cu_k, block_size=32, num_splits=3)
    with pytest.raises(ValueError, match="q must be contiguous"):
        call(torch.cat([q, q], dim=2)[:, :, :128], k, cu_q, cu_k, num_splits=3)


@pytest.mark.gpu
def test_c_abi_errors():
    lib = _lib.lib()
    q, k, cu_q, cu_k = _inputs([1], [6400], 16, 128, torch.bfloat16)
    size = lib.infllmv2_select_decode_workspace_size(1, 1, 6400, 1, 6400, 32, 2, 128, 1, 64, 4)
    assert size > lib.infllmv2_select_decode_workspace_size(1, 1, 6400, 1, 6400, 32, 2, 128, 1, 64, 1)
    assert lib.infllmv2_select_decode_workspace_size(1, 1, 6400, 1, 6400, 32, 2, 128, 1, 64, 1) == \
        lib.infllmv2_select_blocks_from_keys_workspace_size(1, 6400, 2, 128, 1, 64)
    assert lib.infllmv2_select_decode_workspace_size(1, 1, 6400, 1, 6400, 30, 4, 128, 1, 64, 4) == 0  # 30 % 4
    assert lib.infllmv2_select_decode_splits(1, 1, 6400, 32, 2, -1) == 0
    ws = torch.empty(size, dtype=torch.uint8, device="cuda")
    out = torch.empty((2, 1, 8), dtype=torch.int32, device="cuda")

    def call(ws_ptr=ws.data_ptr(), ws_size=size, splits=4, heads=32, topk=8, max_k=6400, q_ptr=q.data_ptr()):
        st = lib.infllmv2_select_decode(q_ptr, k.data_ptr(), cu_q.data_ptr(), cu_k.data_ptr(), None, 0.5,
                                        out.data_ptr(), ws_ptr, ws_size, 1, 1, 6400, 1, max_k, heads, 2, 128, topk, 1,
                                        2, 1, 128, 64, 0, 0.0, splits, None)
        return st, lib.infllmv2_last_error().decode()

    assert call()[0] == _lib.OK
    st, text = call(splits=0)
    assert st == _lib.ERR_INVALID_ARGUMENT and "splits must be in [1, 64]" in text and "got 0" in text
    st, text = call(splits=65)
    assert st == _lib.ERR_INVALID_ARGUMENT and "got 65" in text
    st, text = call(ws_size=size - 1)
    assert st == _lib.ERR_INVALID_ARGUMENT and f"workspace_size is {size - 1} bytes" in text and f"asks for {size}" in text
    st, text = call(ws_ptr=ws.data_ptr() + 4)
    assert st == _lib.ERR_INVALID_ARGUMENT and "workspace must be 16-byte aligned" in text
    st, text = call(ws_ptr=torch.empty(size // 4).data_ptr())
    assert st == _lib.ERR_INVALID_ARGUMENT and "workspace must be device memory" in text
    st, text = call(topk=9000)
    assert st == _lib.ERR_UNSUPPORTED and "topk must be in [1, 8192], got 9000" in text
    st, text = call(heads=7)
    assert st == _lib.ERR_INVALID_ARGUMENT and "heads (7) must be a multiple of heads_k (2)" in text
    st, text = call(q_ptr=q.data_ptr() + 2)
    assert st == _lib.ERR_INVALID_ARGUMENT and "q must be 16-byte aligned" in text
    st, text = call(max_k=0)
    assert st == _lib.ERR_INVALID_ARGUMENT and "max_seqlen_k must be >= max_seqlen_q" in text
    big = lib.infllmv2_select_decode_workspace_size(1, 1, 6400, 1, 1 << 20, 32, 2, 128, 1, 64, 4)
    st, text = call(max_k=1 << 20, ws_size=big)
    assert st == _lib.ERR_UNSUPPORTED and "this build selects over at most" in text
    # one range: the fused selection, with its own (smaller) workspace
    assert call(ws_size=lib.infllmv2_select_blocks_from_keys_workspace_size(1, 6400, 2, 128, 1, 64), splits=1)[0] == _lib.OK


# ---------------------------------------------------------------------------------- CPU tier


def test_cpu_path_is_the_reference():
    lq, lk = [1, 2], [1300, 3000]
    q = random_tokens(lq, 4, 16, torch.float32, seed=1)
    k = random_tokens(lk, 2, 16, torch.float32, seed=2)
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    got = infllmv2.select_decode(q, k, cu_q, cu_k, topk=7, local_blocks=2, num_splits=3)
    want = reference.select_blocks(q, k, cu_q, cu_k, 7, 32, 16, 64, 1, 2, True, 128, 64, None, None, 0.5)
    assert torch.equal(got, want)


def test_cpu_bad_inputs_name_the_argument():
    q = random_tokens([1], 4, 16, torch.float32, seed=1)
    k = random_tokens([130], 2, 16, torch.float32, seed=2)
    cu_q, cu_k = cu_seqlens([1]), cu_seqlens([130])
    with pytest.raises(ValueError, match="num_splits must be >= 0, got -1"):
        infllmv2.select_decode(q, k, cu_q, cu_k, num_splits=-1)
    with pytest.raises(ValueError, match="num_splits must be at most 64"):
        infllmv2.select_decode(q, k, cu_q, cu_k, num_splits=100)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        infllmv2.select_decode(q, k, cu_q, cu_k, topk=0)
