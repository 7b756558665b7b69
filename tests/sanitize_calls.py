"""Small calls of every kernel family, one family per process, for ``compute-sanitizer``.

``python tests/sanitize_calls.py FAMILY [ARCH]`` runs the family's calls on the GPU (with the
library's arch forced to ``ARCH``, an sm_80 or sm_89 variant through its PTX, when given) and
prints ``FAMILY ARCH ok``. ``tests/test_sanitizer.py`` runs it under the sanitizer's tools; the
sizes are small because racecheck instruments every shared-memory access.
"""

import os
import sys

try:
    import infllmv2
except ImportError:  # a source checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import infllmv2
import torch

from infllmv2 import SparseConfig, ops
from infllmv2.ops import sort_topk_idx
from infllmv2.testing import cu_seqlens, realistic_topk

# the pipeline through infllmv2.attention (compression, the fused selection, sparse attention
# forward and backward): Hq, Hk, D for the units G picks (16: the box dK/dV, 4-token dQ and the
# forward's cluster pair; 4 and 1: the 16-token units and the gather dK/dV; 32: two boxes)
PIPELINE = {"attention_g16": (32, 2, 128), "attention_g4": (8, 2, 128), "attention_g32": (32, 1, 128),
            "attention_g1_d64": (2, 2, 64)}
FAMILIES = (*PIPELINE, "sparse_attn_pieces", "dense_attn", "decode_g16", "decode_g4", "attention_kvcache",
            "dense_decode_kvcache")
# inputs that disagree with the tensors they describe: for memcheck and a plain timed run only
# (their results are garbage, and reading garbage is what initcheck would report)
INCONSISTENT = "inconsistent_inputs"


def _qkv(lengths, hq, hk, head_dim=128, dtype=torch.bfloat16):
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, head_dim, device="cuda", dtype=dtype) for h in (hq, hk, hk))
    return q, k, v, cu_seqlens(lengths, "cuda")


def _fwd_bwd(fn, q, k, v):
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


def _poisoned(floats):
    ws = torch.empty(floats, device="cuda")
    ws.view(torch.int32).fill_(1 << 30)
    return ws


def _inconsistent_stage2(q, k, v, cu_q, cu_k, idx):
    """Stage 2 and the dense kernels through their launch functions (idx unsorted garbage, as the C
    ABI could be handed it), then the public calls that trust offsets when the lengths are given."""
    n, heads = q.shape[0], q.shape[1]
    out, lse = torch.empty_like(q), torch.empty(heads, n, device="cuda")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ops.sparse_attn_fwd_launch(q, k, v, idx, cu_q, cu_k, 130, 0.0, out, lse)
    # workspaces poisoned with large counts and offsets: what the kernels read of them without
    # having written it (bad offsets can leave parts of the member index unwritten) must not send
    # a loop or a load past its list
    ws = _poisoned(ops.sparse_attn_bwd_workspace_floats(q, k, idx, cu_k))
    ops.sparse_attn_bwd_launch(q, q, k, v, out, lse, idx, cu_q, cu_k, 130, 130, 0.0, dq, dk, dv, ws)
    ops.dense_attn_fwd_launch(q, k, v, cu_q, cu_k, 130, 130, True, 0.0, out, lse)
    ws = _poisoned(ops.dense_attn_bwd_workspace_floats(q))
    ops.dense_attn_bwd_launch(q, q, k, v, out, lse, cu_q, cu_k, 130, 130, True, 0.0, dq, dk, dv, ws)
    infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx, max_seqlen_q=130, num_splits=3)
    infllmv2.select_decode(q, k, cu_q, cu_k, topk=4, local_blocks=2, max_seqlen_q=130, max_seqlen_k=130, num_splits=2)
    cfg = SparseConfig(dense_len=0, window_size=128, topk=2)
    _fwd_bwd(lambda q, k, v: infllmv2.attention(q, k, v, cu_q, cu_k, 130, 130, config=cfg), q.clone(), k.clone(),
             v.clone())


def _inconsistent_inputs():
    """Offsets, cache lengths, block tables and selections that disagree with the tensors they
    describe, which the kernels read on the device and the C ABI trusts: garbage results, but no
    access outside the tensors."""
    lengths = [65, 130]
    q, k, v, cu = _qkv(lengths, 32, 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(-10**6, 10**6, (2, q.shape[0], 8), device="cuda", dtype=torch.int32, generator=g)
    idx[:, :, :4] = torch.randint(-2, 4, (2, q.shape[0], 4), device="cuda", dtype=torch.int32, generator=g)
    # past the tensors, decreasing, negative; lengths of 2^30 and more, which loops that followed
    # them would take hours to walk (each kernel now clamps its spans into its tensors,
    # dsl/spans.py; a length of 2^31 - 1 alone overflowed to no work in some of those loops); and
    # a first offset far below 0 with a last one that would put bwd_members_scan's last write
    # before its offsets
    bad = (_i32(0, 1_000_000, 2_000_000), _i32(0, 150, 10), _i32(0, -50, 195), _i32(5, 3, 1),
           _i32(0, 2**30, 2**31 - 1), _i32(-1_000_000, 10, -2**31))
    for cu_bad in bad:
        for cu_q, cu_k in ((cu_bad, cu), (cu, cu_bad), (cu_bad, cu_bad)):
            _inconsistent_stage2(q, k, v, cu_q, cu_k, idx)
    # a paged cache of 12 pages of 64 a sequence, and lengths, tables and query offsets past it
    page, pages, hk, head_dim = 64, 12, 2, 128
    kc = torch.randn(2 * pages, page, hk, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.arange(2 * pages, device="cuda", dtype=torch.int32).flip(0).reshape(2, pages).contiguous()
    wild = table.clone()
    wild[0, ::2], wild[1, 1::3] = 10**6, -3
    cap = page * pages
    ck = torch.zeros(2, infllmv2.compressed_capacity(cap), hk, head_dim, device="cuda", dtype=torch.bfloat16)
    nk = torch.zeros(2, infllmv2.compressed_capacity(cap, 128, 64), hk, head_dim, device="cuda", dtype=torch.bfloat16)
    qd = torch.randn(2, hk * 16, head_dim, device="cuda", dtype=torch.bfloat16)
    didx = torch.randint(-10**6, 10**6, (2, 2, 8), device="cuda", dtype=torch.int32, generator=g)
    cfg = SparseConfig(dense_len=256, window_size=128, topk=4)
    for lens in (_i32(10**6, 10**6), _i32(-5, 700), _i32(700, -10**6)):
        for tab in (table, wild):
            for cu_q in (cu_seqlens([1, 1], "cuda"), _i32(0, 5, 1), _i32(0, 10**6, 2 * 10**6),
                         _i32(0, 2**30, 2**31 - 1)):
                infllmv2.dense_decode_kvcache(qd, kc, vc, lens, cu_q, tab, max_seqlen_q=1, num_splits=3)
                infllmv2.sparse_decode_kvcache(qd, kc, vc, lens, cu_q, didx, tab, max_seqlen_q=1, num_splits=3)
                infllmv2.compress_keys_kvcache(kc, lens, ck, 700, tab)
                infllmv2.compress_keys_kvcache(kc, lens, nk, 700, tab, 128, 64)
                infllmv2.select_decode_kvcache(qd, ck, nk, lens, cu_q, cap, topk=4, local_blocks=2, max_seqlen_q=1)
                for max_k in (100, 700):  # both sides of dense_len
                    infllmv2.attention_kvcache(qd, kc, vc, lens, cu_q, ck, nk, 1, tab, cfg, max_seqlen_q=1,
                                               max_seqlen_k=max_k)


def run(family):
    if family in PIPELINE:
        hq, hk, head_dim = PIPELINE[family]
        lengths = [65, 400, 1]
        q, k, v, cu = _qkv(lengths, hq, hk, head_dim)
        cfg = SparseConfig(dense_len=300, window_size=128, topk=2)
        _fwd_bwd(lambda q, k, v: infllmv2.attention(q, k, v, cu, cu, 400, 400, config=cfg), q, k, v)
    elif family == "sparse_attn_pieces":
        # a sequence of more than 8192 queries: dK/dV's first key blocks in pieces, and their reduce
        lengths = [1, 63, 64, 65, 8300]
        q, k, v, cu = _qkv(lengths, 16, 1)
        idx = sort_topk_idx(realistic_topk(lengths, lengths, 1, 8, local_blocks=4, device="cuda"))
        _fwd_bwd(lambda q, k, v: infllmv2.sparse_attn_varlen(q, k, v, cu, cu, idx), q, k, v)
    elif family == "dense_attn":
        q, k, v, cu = _qkv([65, 130, 1], 32, 2)
        _fwd_bwd(lambda q, k, v: infllmv2.dense_attn_varlen(q, k, v, cu, cu), q, k, v)
    elif family in ("decode_g16", "decode_g4"):
        G = int(family.split("_g")[1])
        _, k, v, cu_k = _qkv([700, 1300], 2, 2)
        q = torch.randn(2, 2 * G, 128, device="cuda", dtype=torch.bfloat16)
        cu_q = cu_seqlens([1, 1], "cuda")
        idx = infllmv2.select_decode(q, k, cu_q, cu_k, topk=8, local_blocks=2, max_seqlen_q=1, max_seqlen_k=1300,
                                     num_splits=2)
        infllmv2.sparse_decode(q, k, v, cu_q, cu_k, idx, max_seqlen_q=1, num_splits=2)
    elif family == "attention_kvcache":
        # a prefill and a decoding step through paged caches, pages in reverse order, on the
        # sparse path; then a step on the dense path, whose cache update runs on the side stream
        page, pages, hk, head_dim = 64, 12, 2, 128
        lens = [700, 130]
        kc = torch.randn(2 * pages, page, hk, head_dim, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.arange(2 * pages, device="cuda", dtype=torch.int32).flip(0).reshape(2, pages).contiguous()
        ck = torch.zeros(2, infllmv2.compressed_capacity(page * pages), hk, head_dim, device="cuda",
                         dtype=torch.bfloat16)
        nk = torch.zeros(2, infllmv2.compressed_capacity(page * pages, 128, 64), hk, head_dim, device="cuda",
                         dtype=torch.bfloat16)
        cfg = SparseConfig(dense_len=256, window_size=128, topk=4)
        for new in (0, 1):
            now = torch.tensor([n + new for n in lens], dtype=torch.int32, device="cuda")
            q = torch.randn(2, hk * 16, head_dim, device="cuda", dtype=torch.bfloat16)
            infllmv2.attention_kvcache(q, kc, vc, now, cu_seqlens([1, 1], "cuda"), ck, nk, new or max(lens), table,
                                       cfg, max_seqlen_q=1, max_seqlen_k=max(lens) + new)
        now = torch.tensor([n + 2 for n in lens], dtype=torch.int32, device="cuda")
        infllmv2.attention_kvcache(q, kc, vc, now, cu_seqlens([1, 1], "cuda"), ck, nk, 1, table, SparseConfig(),
                                   max_seqlen_q=1, max_seqlen_k=max(lens) + 2)
    elif family == "dense_decode_kvcache":
        # paged (pages in reverse order) and padded caches, partial last blocks, one and three
        # tokens a sequence, fewer and more splits than blocks
        page, pages, hk, head_dim = 64, 12, 2, 128
        kc = torch.randn(2 * pages, page, hk, head_dim, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.arange(2 * pages, device="cuda", dtype=torch.int32).flip(0).reshape(2, pages).contiguous()
        lens = torch.tensor([700, 130], dtype=torch.int32, device="cuda")
        for tokens, splits in ((1, 3), (3, 40)):
            q = torch.randn(2 * tokens, hk * 16, head_dim, device="cuda", dtype=torch.bfloat16)
            cu_q = cu_seqlens([tokens, tokens], "cuda")
            infllmv2.dense_decode_kvcache(q, kc, vc, lens, cu_q, table, max_seqlen_q=tokens, num_splits=splits)
            infllmv2.dense_decode_kvcache(q, kc.view(2, pages * page, hk, head_dim),
                                          vc.view(2, pages * page, hk, head_dim), lens, cu_q, max_seqlen_q=tokens,
                                          num_splits=splits)
    elif family == INCONSISTENT:
        _inconsistent_inputs()
    else:
        raise SystemExit(f"unknown family {family!r}; one of {', '.join(FAMILIES)}, {INCONSISTENT}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    family, arch = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    torch.manual_seed(0)
    if arch:
        infllmv2.set_arch_override(arch)
    run(family)
    print(family, arch or "native", "ok")
