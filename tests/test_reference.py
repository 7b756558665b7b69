"""Checks the PyTorch reference (infllmv2.reference) against naive per-token loops in fp64.

The naive side below is written independently of the reference: scalar Python loops over
sequences, tokens, heads and keys, with the rules of SPEC.md spelled out one condition at a
time. Stage-2 gradients come from autograd through per-(token, head) fp64 computations over
explicitly gathered key lists.
"""

import itertools
import math

import pytest
import torch

from infllmv2 import reference as ref

F64 = torch.float64
NEG_INF = float("-inf")
POS_INF = float("inf")

# Small geometry: many blocks in short sequences. Default geometry: SPEC.md's.
SMALL = dict(kernel_size=8, kernel_stride=4, block_size=16, norm_kernel_size=16, norm_kernel_stride=8)
DEFAULT = dict(kernel_size=32, kernel_stride=16, block_size=64, norm_kernel_size=128, norm_kernel_stride=64)

MIXED_LENS = [1, 63, 64, 65, 200, 257]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def cu_of(lens):
    return torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)


def make_inputs(lens_q, lens_k, hk, g, d, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), hk * g, d, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=gen, dtype=F64).to(dtype)
    return q, k, v, cu_of(lens_q), cu_of(lens_k)


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def log_sum_exp(values):
    top = max(values)
    return top + math.log(math.fsum(math.exp(x - top) for x in values))


def sequences(lens_q, lens_k):
    """Yields (batch index, row of the packed query, query position, key offset, Lk)."""
    q_off = k_off = 0
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        for i in range(lq):
            yield b, q_off + i, lk - lq + i, k_off, lk
        q_off += lq
        k_off += lk


# --------------------------------------------------------------------------------------------
# naive fp64 oracle
# --------------------------------------------------------------------------------------------


def naive_compress(k, lens, w, s, punct=None, lam=0.5):
    """List (per sequence) of lists (per window) of per-head vectors (Python floats)."""
    k = k.to(F64).tolist()
    punct = None if punct is None else punct.tolist()
    hk, d = len(k[0]), len(k[0][0])
    result, off = [], 0
    for length in lens:
        windows = []
        j = 0
        while j * s + w <= length:
            total = [[0.0] * d for _ in range(hk)]
            ptotal = [[0.0] * d for _ in range(hk)]
            pcount = 0
            for t in range(j * s, j * s + w):
                is_punct = punct is not None and punct[off + t]
                pcount += is_punct
                for h in range(hk):
                    for x in range(d):
                        total[h][x] += k[off + t][h][x]
                        if is_punct:
                            ptotal[h][x] += k[off + t][h][x]
            vec = [[total[h][x] / w for x in range(d)] for h in range(hk)]
            if pcount:
                vec = [[lam * vec[h][x] + (1 - lam) * ptotal[h][x] / pcount for x in range(d)] for h in range(hk)]
            windows.append(vec)
            j += 1
        result.append(windows)
        off += length
    return result


def naive_group_scores(q, fine, lens_q, lens_k, w, s, g, scale, coarse=None, w2=None, s2=None):
    """S[hk][row] = dict j -> score, from explicit visibility and LSE loops."""
    q = q.to(F64).tolist()
    hq = len(q[0])
    out = [[dict() for _ in range(len(q))] for _ in range(hq // g)]
    for b, row, p, _, _ in sequences(lens_q, lens_k):
        vis = [j for j in range(len(fine[b])) if j * s + w - 1 <= p]
        vis2 = [] if coarse is None else [j for j in range(len(coarse[b])) if j * s2 + w2 - 1 <= p]
        for h in range(hq):
            hk = h // g
            logits = {j: scale * dot(q[row][h], fine[b][j][hk]) for j in vis}
            if not logits:
                continue
            if vis2:
                lse = log_sum_exp([scale * dot(q[row][h], coarse[b][j][hk]) for j in vis2])
            else:
                lse = log_sum_exp(list(logits.values()))
            for j, x in logits.items():
                out[hk][row][j] = out[hk][row].get(j, 0.0) + math.exp(x - lse)
    return out


def naive_block_scores(S, lens_q, lens_k, w, s, bs, init_blocks, local_blocks, n_fine, hk):
    """Block scores (Hk, total_q, max_nb) fp64; S is S[hk][row][j] (dict or sequence)."""
    m = bs // s
    max_nb = max(-(-lk // bs) for lk in lens_k)
    out = torch.full((hk, sum(lens_q), max_nb), NEG_INF, dtype=F64)
    for b, row, p, _, lk in sequences(lens_q, lens_k):
        nb = -(-lk // bs)
        q_blk = p // bs
        for h in range(hk):
            for blk in range(max_nb):
                if blk >= nb or blk > q_blk:
                    value = NEG_INF
                elif blk < init_blocks or q_blk - local_blocks <= blk <= q_blk:
                    value = POS_INF
                else:
                    value = NEG_INF
                    for j in range(blk * m - 1, blk * m + m):
                        if 0 <= j < n_fine[b] and j * s + w - 1 <= p:
                            value = max(value, S[h][row].get(j, 0.0) if isinstance(S[h][row], dict) else S[h][row][j])
                out[h, row, blk] = value
    return out


def naive_attention(q, k, v, lens_q, lens_k, g, scale, bs=None, topk_idx=None, causal=True):
    """(out, lse) by explicit key lists per (token, head); differentiable through autograd."""
    hq = q.shape[1]
    rows_out, rows_lse = [], []
    sel = None if topk_idx is None else topk_idx.tolist()
    q_off = k_off = 0
    for lq, lk in zip(lens_q, lens_k):
        for i in range(lq):
            row = q_off + i
            p = lk - lq + i
            heads_out, heads_lse = [], []
            for h in range(hq):
                hk = h // g
                keys = []
                for t in range(lk):
                    if causal and t > p:
                        continue
                    if sel is not None and (t // bs) not in sel[hk][row]:
                        continue
                    keys.append(k_off + t)
                if not keys:
                    heads_out.append(torch.zeros(v.shape[2], dtype=v.dtype))
                    heads_lse.append(torch.tensor(NEG_INF, dtype=F64))
                    continue
                index = torch.tensor(keys)
                logits = (k[index, hk] @ q[row, h]) * scale
                heads_out.append(torch.softmax(logits, 0) @ v[index, hk])
                heads_lse.append(torch.logsumexp(logits, 0).detach())
            rows_out.append(torch.stack(heads_out))
            rows_lse.append(torch.stack(heads_lse))
        q_off += lq
        k_off += lk
    return torch.stack(rows_out), torch.stack(rows_lse, 1)


def naive_pipeline(q, k, lens_q, lens_k, geo, topk, init_blocks, local_blocks, approx, punct=None, lam=0.5):
    """Naive stages 0-1: returns the fp64 block scores (Hk, total_q, max_nb)."""
    hk = k.shape[1]
    g = q.shape[1] // hk
    w, s, bs = geo["kernel_size"], geo["kernel_stride"], geo["block_size"]
    fine = naive_compress(k, lens_k, w, s, punct, lam)
    coarse = None
    if approx:
        coarse = naive_compress(k, lens_k, geo["norm_kernel_size"], geo["norm_kernel_stride"], punct, lam)
    S = naive_group_scores(q, fine, lens_q, lens_k, w, s, g, 1 / math.sqrt(q.shape[2]), coarse,
                           geo["norm_kernel_size"], geo["norm_kernel_stride"])
    return naive_block_scores(S, lens_q, lens_k, w, s, bs, init_blocks, local_blocks, [len(f) for f in fine], hk)


def assert_selection(idx, scores, topk):
    """Tie-aware check of topk_idx against fp64 block scores.

    Each row must hold min(topk, #finite-or-+inf blocks) distinct blocks ascending, then -1;
    where the picked set differs from the naive top-k, the differing blocks must score the
    naive k-th best.
    """
    assert idx.dtype == torch.int32
    assert idx.shape[2] == topk
    idx = idx.tolist()
    scores = scores.tolist()
    scored = 0
    for h in range(len(idx)):
        for row in range(len(idx[h])):
            got = idx[h][row]
            ranked = sorted(((sc, b) for b, sc in enumerate(scores[h][row]) if sc > NEG_INF), reverse=True)
            n_pick = min(topk, len(ranked))
            picked = got[:n_pick]
            assert all(b == -1 for b in got[n_pick:]), (h, row, got)
            assert picked == sorted(picked) and len(set(picked)) == n_pick, (h, row, got)
            if n_pick == 0:
                continue
            assert all(b >= 0 and scores[h][row][b] > NEG_INF for b in picked), (h, row, got)
            scored += any(scores[h][row][b] < POS_INF for b in picked)
            kth = ranked[n_pick - 1][0]
            want = {b for _, b in ranked[:n_pick]}
            for b in set(picked) ^ want:
                assert math.isclose(scores[h][row][b], kth, rel_tol=1e-6, abs_tol=1e-9), (h, row, b, got)
    return scored


def random_topk(lens_q, lens_k, hk, topk, bs, seed):
    """Random selections: -1 slots, duplicates, future blocks, blocks past the sequence."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _, _, _, _, lk in sequences(lens_q, lens_k):
        nb = -(-lk // bs)
        rows.append(torch.randint(-1, nb + 2, (hk, topk), generator=gen))
    return torch.stack(rows, 1).to(torch.int32)


# --------------------------------------------------------------------------------------------
# stage 0
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens,w,s", [(MIXED_LENS, 32, 16), ([1, 7, 8, 9, 31, 40], 8, 4), ([5, 3], 32, 16)])
def test_compress_keys_matches_naive(lens, w, s):
    _, k, _, _, cu = make_inputs(lens, lens, 2, 1, 16, seed=1)
    ck, cu_c = ref.compress_keys(k, cu, w, s)
    naive = naive_compress(k, lens, w, s)
    counts = [len(x) for x in naive]
    assert cu_c.dtype == torch.int32 and cu_c.tolist() == cu_of(counts).tolist()
    assert ck.dtype == F64 and ck.shape == (sum(counts), 2, 16)
    want = torch.tensor([vec for seq in naive for vec in seq], dtype=F64).reshape(ck.shape)
    torch.testing.assert_close(ck, want, rtol=1e-12, atol=1e-12)


def test_compress_keys_phsa():
    lens = [40, 7, 64]
    _, k, _, _, cu = make_inputs(lens, lens, 2, 1, 16, seed=2)
    punct = torch.zeros(sum(lens), dtype=torch.bool)
    punct[[3, 5, 18, 47 + 9, 47 + 60]] = True  # windows with none, one, and two punctuation tokens
    for lam in (0.5, 0.25):
        ck, _ = ref.compress_keys(k, cu, 8, 4, punct_mask=punct, phsa_lambda=lam)
        naive = naive_compress(k, lens, 8, 4, punct, lam)
        want = torch.tensor([vec for seq in naive for vec in seq], dtype=F64).reshape(ck.shape)
        torch.testing.assert_close(ck, want, rtol=1e-12, atol=1e-12)
    plain, _ = ref.compress_keys(k, cu, 8, 4)
    # window 0 of sequence 0 covers tokens 0..7 (punctuation at 3, 5); window 6 covers 24..31 (none)
    assert not torch.allclose(ck[0], plain[0])
    torch.testing.assert_close(ck[6], plain[6], rtol=0, atol=0)
    all_false, _ = ref.compress_keys(k, cu, 8, 4, punct_mask=torch.zeros_like(punct))
    torch.testing.assert_close(all_false, plain, rtol=0, atol=0)


def test_compress_keys_dtype_and_accumulation():
    lens = [100, 33]
    _, k, _, _, cu = make_inputs(lens, lens, 2, 1, 16, seed=3)
    kb = k.to(torch.bfloat16)
    ck, cu_c = ref.compress_keys(kb, cu)
    assert ck.dtype == torch.bfloat16 and cu_c.device == kb.device
    # fp32 accumulation: the result is the fp32 mean rounded once
    want, _ = ref.compress_keys(kb.float(), cu)
    torch.testing.assert_close(ck, want.to(torch.bfloat16), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# stage 1
# --------------------------------------------------------------------------------------------


def dense_from_naive(S, shape):
    out = torch.zeros(shape, dtype=F64)
    for h, rows in enumerate(S):
        for row, cols in enumerate(rows):
            for j, value in cols.items():
                out[h, row, j] = value
    return out


GROUP_CASES = [
    # lens_q, lens_k, hk, g, d, geometry, approx
    (MIXED_LENS, MIXED_LENS, 2, 2, 16, DEFAULT, False),
    (MIXED_LENS, MIXED_LENS, 1, 4, 16, DEFAULT, True),
    ([1, 7, 8, 9, 30, 65, 130], [1, 7, 8, 9, 30, 65, 130], 2, 1, 16, SMALL, True),
    ([1, 7, 8, 9, 30, 65, 130], [1, 7, 8, 9, 30, 65, 130], 2, 2, 16, SMALL, False),
    ([1, 37, 64, 1], [100, 257, 64, 300], 2, 2, 64, DEFAULT, True),  # chunked prefill and decode
    ([1, 5, 40], [90, 33, 40], 1, 2, 64, SMALL, True),
]


@pytest.mark.parametrize("lens_q,lens_k,hk,g,d,geo,approx", GROUP_CASES)
def test_group_scores_matches_naive(lens_q, lens_k, hk, g, d, geo, approx):
    q, k, _, cu_q, cu_k = make_inputs(lens_q, lens_k, hk, g, d, seed=4)
    w, s = geo["kernel_size"], geo["kernel_stride"]
    w2, s2 = geo["norm_kernel_size"], geo["norm_kernel_stride"]
    ck, cu_c = ref.compress_keys(k, cu_k, w, s)
    kwargs = {}
    coarse = None
    if approx:
        ck2, cu_c2 = ref.compress_keys(k, cu_k, w2, s2)
        kwargs = dict(norm_keys=ck2, cu_seqlens_norm=cu_c2, norm_kernel_size=w2, norm_kernel_stride=s2)
        coarse = naive_compress(k, lens_k, w2, s2)
    S = ref.group_scores(q, ck, cu_q, cu_k, cu_c, w, s, **kwargs)
    fine = naive_compress(k, lens_k, w, s)
    max_nc = max(len(f) for f in fine)
    assert S.dtype == torch.float32 and S.shape == (hk, sum(lens_q), max_nc)
    want = naive_group_scores(q, fine, lens_q, lens_k, w, s, g, 1 / math.sqrt(d), coarse, w2, s2)
    torch.testing.assert_close(S.double(), dense_from_naive(want, S.shape), rtol=1e-6, atol=1e-7)
    # chunking the query rows changes nothing
    torch.testing.assert_close(ref.group_scores(q, ck, cu_q, cu_k, cu_c, w, s, chunk=7, **kwargs), S, rtol=0, atol=0)
    if not approx:
        # exact normaliser: each head's probabilities over the visible keys sum to 1
        sums = S.double().sum(-1)
        for _, row, p, _, _ in sequences(lens_q, lens_k):
            expected = g if p >= w - 1 else 0
            assert torch.allclose(sums[:, row], torch.full((hk,), float(expected), dtype=F64), atol=1e-6)


def test_group_scores_coarse_fallback_and_scale():
    # positions 7..14 see fine keys (w=8) but no coarse key (w2=16): the exact LSE is used there
    lens = [40]
    q, k, _, cu, _ = make_inputs(lens, lens, 1, 2, 16, seed=5)
    ck, cu_c = ref.compress_keys(k, cu, 8, 4)
    ck2, cu_c2 = ref.compress_keys(k, cu, 16, 8)
    approx = ref.group_scores(q, ck, cu, cu, cu_c, 8, 4, softmax_scale=0.3, norm_keys=ck2, cu_seqlens_norm=cu_c2,
                              norm_kernel_size=16, norm_kernel_stride=8)
    exact = ref.group_scores(q, ck, cu, cu, cu_c, 8, 4, softmax_scale=0.3)
    torch.testing.assert_close(approx[:, :15], exact[:, :15], rtol=0, atol=0)
    assert not torch.allclose(approx[:, 15:], exact[:, 15:])
    assert torch.all(exact[:, :7] == 0)
    fine = naive_compress(k, lens, 8, 4)
    want = naive_group_scores(q, fine, lens, lens, 8, 4, 2, 0.3)
    torch.testing.assert_close(exact.double(), dense_from_naive(want, exact.shape), rtol=1e-6, atol=1e-7)


def test_group_scores_computes_in_input_dtype():
    lens = [300, 129]
    q, k, _, cu, _ = make_inputs(lens, lens, 2, 4, 64, seed=6, dtype=torch.bfloat16)
    ck, cu_c = ref.compress_keys(k, cu)
    S_bf16 = ref.group_scores(q, ck, cu, cu, cu_c)
    S_fp32 = ref.group_scores(q.float(), ck.float(), cu, cu, cu_c)
    assert S_bf16.dtype == torch.float32
    # same rounded inputs, different arithmetic: a silent upcast would make these identical
    assert not torch.equal(S_bf16, S_fp32)
    torch.testing.assert_close(S_bf16, S_fp32, rtol=0.05, atol=0.05)


POOL_CASES = [
    # lens_q, lens_k, geometry, init, local
    (MIXED_LENS, MIXED_LENS, DEFAULT, 1, 1),
    (MIXED_LENS, MIXED_LENS, DEFAULT, 1, 32),
    ([1, 7, 15, 16, 17, 63, 64, 65, 130], [1, 7, 15, 16, 17, 63, 64, 65, 130], SMALL, 1, 2),
    ([1, 7, 15, 16, 17, 63, 64, 65, 130], [1, 7, 15, 16, 17, 63, 64, 65, 130], SMALL, 3, 0),
    ([1, 20, 1], [130, 100, 9], SMALL, 0, 1),
]


@pytest.mark.parametrize("lens_q,lens_k,geo,init,local", POOL_CASES)
def test_max_pool_blocks_matches_naive(lens_q, lens_k, geo, init, local):
    w, s, bs = geo["kernel_size"], geo["kernel_stride"], geo["block_size"]
    n_fine = [(lk - w) // s + 1 if lk >= w else 0 for lk in lens_k]
    cu_c = cu_of(n_fine)
    hk = 2
    # random junk everywhere, invisible columns included: the pooling must ignore those
    S = torch.rand(hk, sum(lens_q), max(n_fine) + 3, generator=torch.Generator().manual_seed(7), dtype=F64)
    got = ref.max_pool_blocks(S.float(), cu_of(lens_q), cu_of(lens_k), cu_c, w, s, bs, init, local)
    want = naive_block_scores(S.float().double().tolist(), lens_q, lens_k, w, s, bs, init, local, n_fine, hk)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=0)
    # no block after the query's own is ever selectable, whatever forces it
    for _, row, p, _, _ in sequences(lens_q, lens_k):
        assert torch.all(got[:, row, p // bs + 1 :] == NEG_INF)


@pytest.mark.parametrize("topk", [1, 2, 3, 5, 40])
def test_topk_blocks_tie_aware(topk):
    lens_q, lens_k = [1, 30, 64, 100], [1, 50, 64, 200]
    bs = 16
    gen = torch.Generator().manual_seed(8)
    nb = -(-max(lens_k) // bs)
    # a coarse grid of values makes ties frequent; +inf and -inf entries as the pooling writes them
    scores = torch.randint(0, 4, (2, sum(lens_q), nb), generator=gen).double()
    scores[torch.rand(scores.shape, generator=gen) < 0.2] = NEG_INF
    scores[torch.rand(scores.shape, generator=gen) < 0.1] = POS_INF
    for _, row, p, _, _ in sequences(lens_q, lens_k):
        scores[:, row, p // bs + 1 :] = NEG_INF
    idx = ref.topk_blocks(scores.float(), cu_of(lens_q), cu_of(lens_k), topk, bs)
    assert_selection(idx, scores, topk)


def test_topk_blocks_ignores_future_and_nan():
    scores = torch.tensor([[[1.0, float("nan"), 5.0, 9.0]]])
    # position 20 with block 16: blocks 0, 1 exist for this query; 2, 3 lie in the future
    idx = ref.topk_blocks(scores, cu_of([1]), cu_of([21]), 3, 16)
    assert idx.tolist() == [[[0, -1, -1]]]


SELECT_CASES = [
    # lens_q, lens_k, hk, g, d, geometry, topk, init, local, approx; topk exceeds the number of
    # forced blocks so that scored picks happen
    (MIXED_LENS, MIXED_LENS, 2, 2, 16, DEFAULT, 4, 1, 1, True),
    (MIXED_LENS, MIXED_LENS, 2, 1, 16, DEFAULT, 3, 1, 0, False),
    (MIXED_LENS, MIXED_LENS, 1, 2, 16, DEFAULT, 96, 1, 32, True),  # K beyond the available blocks
    ([1, 7, 15, 16, 17, 64, 65, 150], [1, 7, 15, 16, 17, 64, 65, 150], 2, 4, 16, SMALL, 5, 1, 1, True),
    ([1, 7, 15, 16, 17, 64, 65, 150], [1, 7, 15, 16, 17, 64, 65, 150], 1, 2, 16, SMALL, 5, 2, 0, False),
    ([1, 1, 33, 70], [130, 64, 100, 70], 2, 2, 64, SMALL, 5, 1, 1, True),  # decode and chunked prefill
    ([1, 64, 200], [257, 300, 200], 2, 2, 64, DEFAULT, 3, 0, 1, False),
]


@pytest.mark.parametrize("lens_q,lens_k,hk,g,d,geo,topk,init,local,approx", SELECT_CASES)
def test_select_blocks_matches_naive(lens_q, lens_k, hk, g, d, geo, topk, init, local, approx):
    q, k, _, cu_q, cu_k = make_inputs(lens_q, lens_k, hk, g, d, seed=9)
    idx, scores = ref.select_blocks(q, k, cu_q, cu_k, topk=topk, init_blocks=init, local_blocks=local,
                                    approx_lse=approx, return_scores=True, **geo)
    want = naive_pipeline(q, k, lens_q, lens_k, geo, topk, init, local, approx)
    assert scores.dtype == torch.float32 and scores.shape == want.shape
    torch.testing.assert_close(scores.double(), want, rtol=1e-6, atol=1e-7)
    assert idx.shape == (hk, sum(lens_q), topk)
    scored = assert_selection(idx, want, topk)
    assert scored > 0 or topk == 96
    assert torch.equal(ref.select_blocks(q, k, cu_q, cu_k, topk=topk, init_blocks=init, local_blocks=local,
                                         approx_lse=approx, **geo), idx)


def test_select_blocks_forced_blocks_and_trailing_minus_one():
    lens = [257, 65]
    q, k, _, cu, _ = make_inputs(lens, lens, 2, 2, 16, seed=10)
    idx = ref.select_blocks(q, k, cu, cu, topk=96)  # defaults: every block is init or local here
    assert idx.shape == (2, sum(lens), 96)
    for _, row, p, _, _ in sequences(lens, lens):
        want = list(range(p // 64 + 1)) + [-1] * (96 - (p // 64 + 1))
        assert idx[0, row].tolist() == want and idx[1, row].tolist() == want


def test_select_blocks_phsa():
    lens = [1, 40, 150]
    q, k, _, cu, _ = make_inputs(lens, lens, 2, 2, 16, seed=11)
    punct = torch.rand(sum(lens), generator=torch.Generator().manual_seed(12)) < 0.15
    geo = SMALL
    idx, scores = ref.select_blocks(q, k, cu, cu, topk=5, local_blocks=1, punct_mask=punct, phsa_lambda=0.3,
                                    return_scores=True, **geo)
    want = naive_pipeline(q, k, lens, lens, geo, 5, 1, 1, True, punct, 0.3)
    torch.testing.assert_close(scores.double(), want, rtol=1e-6, atol=1e-7)
    assert assert_selection(idx, want, 5) > 0
    plain = ref.select_blocks(q, k, cu, cu, topk=5, local_blocks=1, return_scores=True, **geo)[1]
    assert not torch.allclose(plain, scores)


def test_select_blocks_has_no_gradient():
    lens = [100]
    q, k, _, cu, _ = make_inputs(lens, lens, 1, 2, 16, seed=13)
    q.requires_grad_(True)
    k.requires_grad_(True)
    idx, scores = ref.select_blocks(q, k, cu, cu, topk=2, return_scores=True, **SMALL)
    assert not idx.requires_grad and not scores.requires_grad


# --------------------------------------------------------------------------------------------
# stage 2 and dense
# --------------------------------------------------------------------------------------------


def grads_of(fn, tensors, seed):
    """Runs fn on leaf copies of tensors; returns (out, lse, grads) for a fixed random cotangent."""
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out, lse = fn(*leaves)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(out.dtype)
    (out * cot).sum().backward()
    return out.detach(), lse, [x.grad for x in leaves]


SPARSE_CASES = [
    # lens_q, lens_k, hk, g, d, block_size, topk
    (MIXED_LENS[:5], MIXED_LENS[:5], 2, 2, 16, 16, 3),
    ([1, 7, 63, 64, 65], [1, 7, 63, 64, 65], 1, 4, 16, 64, 2),
    ([1, 20, 40], [90, 20, 100], 2, 1, 64, 16, 4),
]


@pytest.mark.parametrize("lens_q,lens_k,hk,g,d,bs,topk", SPARSE_CASES)
def test_sparse_attn_matches_naive(lens_q, lens_k, hk, g, d, bs, topk):
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, hk, g, d, seed=14)
    idx = random_topk(lens_q, lens_k, hk, topk, bs, seed=15)
    idx[:, 0] = -1  # one row with an empty selection
    got = grads_of(lambda a, b, c: ref.sparse_attn_varlen(a, b, c, cu_q, cu_k, idx, block_size=bs), (q, k, v), 16)
    want = grads_of(lambda a, b, c: naive_attention(a, b, c, lens_q, lens_k, g, 1 / math.sqrt(d), bs, idx),
                    (q, k, v), 16)
    assert got[0].dtype == F64 and got[1].dtype == torch.float32 and got[1].shape == (hk * g, sum(lens_q))
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # query chunks (recomputed in the backward) give the same values and gradients
    chunked = grads_of(lambda a, b, c: ref.sparse_attn_varlen(a, b, c, cu_q, cu_k, idx, block_size=bs, chunk=5),
                       (q, k, v), 16)
    torch.testing.assert_close(chunked[0], got[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(chunked[1], got[1], rtol=1e-7, atol=0)
    for a, b in zip(chunked[2], got[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_sparse_attn_empty_selection():
    lens_q, lens_k = [1, 10, 40], [30, 10, 40]
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, 2, 2, 16, seed=17)
    for dtype in (F64, torch.float32, torch.bfloat16):
        idx = torch.full((2, sum(lens_q), 4), -1, dtype=torch.int32)
        for chunk in (4096, 3):
            out, lse, grads = grads_of(
                lambda a, b, c: ref.sparse_attn_varlen(a, b, c, cu_q, cu_k, idx, block_size=16, chunk=chunk),
                (q.to(dtype), k.to(dtype), v.to(dtype)), 18)
            assert out.dtype == dtype and torch.all(out == 0)
            assert torch.all(lse == NEG_INF)
            for grad in grads:
                assert not torch.isnan(grad).any() and torch.all(grad == 0)
    # selections that only name future blocks or blocks past the sequence are empty too
    idx = torch.full((2, sum(lens_q), 2), -1, dtype=torch.int32)
    idx[:, 0, 0] = 5  # row 0 (position 29) -> block 5 does not exist
    idx[:, 1, 0] = 1  # row 1 (position 0) -> block 1 is in the future
    out, lse, grads = grads_of(lambda a, b, c: ref.sparse_attn_varlen(a, b, c, cu_q, cu_k, idx, block_size=16),
                               (q, k, v), 19)
    assert torch.all(out[:2] == 0) and torch.all(lse[:, :2] == NEG_INF)
    assert all(not torch.isnan(grad).any() for grad in grads)


def test_sparse_attn_duplicates_count_once():
    lens = [70, 33]
    q, k, v, cu, _ = make_inputs(lens, lens, 2, 2, 16, seed=20)
    rng = torch.Generator().manual_seed(21)
    base = random_topk(lens, lens, 2, 3, 16, seed=22)
    dup = torch.cat([base, base, base[..., torch.randperm(3, generator=rng)]], -1)
    a = ref.sparse_attn_varlen(q, k, v, cu, cu, base, block_size=16)
    b = ref.sparse_attn_varlen(q, k, v, cu, cu, dup, block_size=16)
    torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


DENSE_CASES = [
    # lens_q, lens_k, hk, g, d, causal
    (MIXED_LENS[:5], MIXED_LENS[:5], 2, 2, 16, True),
    ([1, 1, 20], [64, 1, 90], 1, 4, 64, True),
    ([3, 20, 5], [10, 20, 0], 2, 1, 16, False),  # non-causal, including a sequence with no keys
]


@pytest.mark.parametrize("lens_q,lens_k,hk,g,d,causal", DENSE_CASES)
def test_dense_attn_matches_naive(lens_q, lens_k, hk, g, d, causal):
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, hk, g, d, seed=23)
    got = grads_of(lambda a, b, c: ref.dense_attn_varlen(a, b, c, cu_q, cu_k, softmax_scale=0.2, causal=causal,
                                                         chunk=7), (q, k, v), 24)
    want = grads_of(lambda a, b, c: naive_attention(a, b, c, lens_q, lens_k, g, 0.2, causal=causal), (q, k, v), 24)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_dense_equals_sparse_with_every_block():
    lens_q, lens_k = [1, 63, 64, 65, 130], [1, 63, 64, 100, 130]
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, 2, 2, 16, seed=25)
    nb = -(-max(lens_k) // 16)
    idx = torch.arange(nb, dtype=torch.int32).expand(2, sum(lens_q), nb).contiguous()
    dense = grads_of(lambda a, b, c: ref.dense_attn_varlen(a, b, c, cu_q, cu_k), (q, k, v), 26)
    sparse = grads_of(lambda a, b, c: ref.sparse_attn_varlen(a, b, c, cu_q, cu_k, idx, block_size=16), (q, k, v), 26)
    torch.testing.assert_close(sparse[0], dense[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse[1], dense[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(sparse[2], dense[2]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_attention_dtypes_and_low_precision():
    lens = [100, 37]
    q, k, v, cu, _ = make_inputs(lens, lens, 2, 2, 64, seed=27)
    idx = random_topk(lens, lens, 2, 3, 16, seed=28)
    exact = ref.sparse_attn_varlen(q, k, v, cu, cu, idx, block_size=16)
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    out, lse = ref.sparse_attn_varlen(*low, cu, cu, idx, block_size=16)
    out32, _ = ref.sparse_attn_varlen(*[t.float() for t in low], cu, cu, idx, block_size=16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.equal(out.float(), out32)  # computed in bf16, not upcast
    torch.testing.assert_close(out.double(), exact[0], rtol=0.05, atol=0.05)
    finite = exact[1] > NEG_INF
    torch.testing.assert_close(lse[finite].double(), exact[1][finite].double(), rtol=0.02, atol=0.02)
    out, lse = ref.dense_attn_varlen(*low, cu, cu)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_attention_dense_sparse_switch():
    lens_q, lens_k = [40, 1], [150, 100]
    q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, 2, 2, 16, seed=29)
    sel = dict(topk=2, local_blocks=0, **SMALL)
    dense = ref.dense_attn_varlen(q, k, v, cu_q, cu_k)
    idx = ref.select_blocks(q, k, cu_q, cu_k, **sel)
    sparse = ref.sparse_attn_varlen(q, k, v, cu_q, cu_k, idx, block_size=16)
    below = ref.attention(q, k, v, cu_q, cu_k, dense_len=151, **sel)
    at = ref.attention(q, k, v, cu_q, cu_k, dense_len=150, **sel)
    assert torch.equal(below[0], dense[0]) and torch.equal(below[1], dense[1])
    assert torch.equal(at[0], sparse[0]) and torch.equal(at[1], sparse[1])
    assert not torch.allclose(dense[0], sparse[0])
    # gradients flow through the sparse path; the selection carries none
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref.attention(*leaves, cu_q, cu_k, dense_len=100, **sel)[0].sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


# --------------------------------------------------------------------------------------------
# argument checking
# --------------------------------------------------------------------------------------------


def test_argument_errors():
    lens = [40, 30]
    q, k, v, cu, _ = make_inputs(lens, lens, 2, 2, 16, seed=30)
    idx = torch.zeros(2, 70, 2, dtype=torch.int32)
    ck, cu_c = ref.compress_keys(k, cu)
    bad = [
        (lambda: ref.dense_attn_varlen(q, k, v, cu.long(), cu), "cu_seqlens_q"),
        (lambda: ref.dense_attn_varlen(q, k, v, cu, torch.tensor([0, 50, 40], dtype=torch.int32)), "cu_seqlens_k"),
        (lambda: ref.dense_attn_varlen(q, k, v, cu, torch.tensor([0, 69], dtype=torch.int32)), "cu_seqlens_k"),
        (lambda: ref.dense_attn_varlen(q, k, v, cu_of([70]), cu), "cu_seqlens_k"),
        (lambda: ref.dense_attn_varlen(q, k, v, cu_of([41, 29]), cu), "keys"),
        (lambda: ref.dense_attn_varlen(q[:, :3], k, v, cu, cu), "multiple"),
        (lambda: ref.dense_attn_varlen(q, k[..., :8], v, cu, cu), "head_dim"),
        (lambda: ref.dense_attn_varlen(q, k, v[:, :1], cu, cu), "v shape"),
        (lambda: ref.dense_attn_varlen(q, k.float(), v, cu, cu), "dtype"),
        (lambda: ref.dense_attn_varlen(q, k, v, cu, cu, chunk=0), "chunk"),
        (lambda: ref.sparse_attn_varlen(q, k, v, cu, cu, idx[:1]), "topk_idx"),
        (lambda: ref.sparse_attn_varlen(q, k, v, cu, cu, idx.float()), "topk_idx"),
        (lambda: ref.sparse_attn_varlen(q, k, v, cu, cu, idx - 2), "topk_idx"),
        (lambda: ref.select_blocks(q, k, cu, cu, block_size=40), "block_size"),
        (lambda: ref.select_blocks(q, k, cu, cu, topk=0), "topk"),
        (lambda: ref.max_pool_blocks(torch.zeros(2, 70, 1), cu, cu, cu_c, block_size=40), "block_size"),
        (lambda: ref.max_pool_blocks(torch.zeros(2, 70, 1), cu, cu, cu_c, local_blocks=-1), "local_blocks"),
        (lambda: ref.max_pool_blocks(torch.zeros(2, 70, 1), cu, cu, cu_c, kernel_size=8), "cu_seqlens_c"),
        (lambda: ref.group_scores(q, ck, cu, cu, cu_c, kernel_stride=8), "cu_seqlens_c"),
        (lambda: ref.group_scores(q, ck, cu, cu, cu_c, norm_keys=ck), "cu_seqlens_norm"),
        (lambda: ref.group_scores(q, ck.float(), cu, cu, cu_c), "ck dtype"),
        (lambda: ref.compress_keys(k, cu, punct_mask=torch.zeros(70)), "punct_mask"),
        (lambda: ref.compress_keys(k, cu, kernel_stride=0), "kernel_stride"),
        (lambda: ref.attention(q, k, v, cu, cu, dense_len=10, return_scores=True), "return_scores"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()
