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

from infllmv2 import SparseConfig
from infllmv2.ops import sort_topk_idx
from infllmv2.testing import cu_seqlens, realistic_topk

# the pipeline through infllmv2.attention (compression, the fused selection, sparse attention
# forward and backward): Hq, Hk, D for the units G picks (16: the box dK/dV, 4-token dQ and the
# forward's cluster pair; 4 and 1: the 16-token units and the gather dK/dV; 32: two boxes)
PIPELINE = {"attention_g16": (32, 2, 128), "attention_g4": (8, 2, 128), "attention_g32": (32, 1, 128),
            "attention_g1_d64": (2, 2, 64)}
FAMILIES = (*PIPELINE, "sparse_attn_pieces", "dense_attn", "decode_g16", "decode_g4", "attention_kvcache",
            "dense_decode_kvcache")


def _qkv(lengths, hq, hk, head_dim=128, dtype=torch.bfloat16):
    n = sum(lengths)
    q, k, v = (torch.randn(n, h, head_dim, device="cuda", dtype=dtype) for h in (hq, hk, hk))
    return q, k, v, cu_seqlens(lengths, "cuda")


def _fwd_bwd(fn, q, k, v):
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


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
        # a prefill and a decoding step through paged caches, pages in reverse order
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
    else:
        raise SystemExit(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    torch.cuda.synchronize()


if __name__ == "__main__":
    family, arch = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    torch.manual_seed(0)
    if arch:
        infllmv2.set_arch_override(arch)
    run(family)
    print(family, arch or "native", "ok")
