"""Decoding: stages 0 and 1 for one query token a sequence against a long key cache, with the
selection split over the compressed keys (`infllmv2.select_decode`) and fused in one thread
block per sequence and KV head (`infllmv2.select_blocks`), next to the compression alone.

    python benchmarks/bench_select_decode.py --json out.json

Configuration: bf16, D = 128, Hq = 32, Hk = 2 (G = 16), MiniCPM4.1's selection (compression
32/16, the coarse normaliser 128/64, K = 96 with the init block and a local window of 32
blocks), caches of 32K and 128K keys, batch 1, 8 and 32 (32K) or 1 and 8 (128K). Both calls
start from the raw keys, as `infllmv2.attention` runs them: each includes the compression of the
whole cache into C1 and C2 ("compress ms", timed alone from the same kernels), since no
compressed cache is kept between steps yet. Times are per call, CUDA graphs replayed over copies
of the cache that together exceed the L2 (see bench_sparse_decode.py). A second table times the
split selection with forced split counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_decode import CASES, copies_for, graphed_ms  # noqa: E402

import infllmv2  # noqa: E402
from infllmv2.ops import compress_keys_launch, select_decode_splits  # noqa: E402
from infllmv2.testing import cu_seqlens, library_identity  # noqa: E402

D, HQ, HK, TOPK = 128, 32, 2, 96
SWEEP = (2, 4, 8, 16, 24, 32, 48, 64)


def select_decode_case(cache, batch, reps):
    lq, lk = [1] * batch, [cache] * batch
    n = copies_for(batch * cache * HK * D * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    qk = [(torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g),
           torch.randn(batch * cache, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)) for _ in range(n)]
    cu_q, cu_k = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    q0, k0 = qk[0]
    splits = select_decode_splits(q0, k0, cu_q, 1, cache)
    kw = dict(topk=TOPK, local_blocks=32, max_seqlen_q=1, max_seqlen_k=cache)
    row = {"cache": cache, "batch": batch, "topk": TOPK, "splits": splits, "copies": n}

    def split_calls(num_splits):
        return [lambda q=q, k=k: infllmv2.select_decode(q, k, cu_q, cu_k, num_splits=num_splits, **kw) for q, k in qk]

    # the compression both calls start with, into buffers sized once (offsets computed outside the graph)
    levels = []
    for w, s in ((32, 16), (128, 64)):
        ck, cu_c = infllmv2.compress_keys(k0, cu_k, w, s)
        levels.append((w, s, ck, cu_c, ck.shape[0] // batch))
    row["compress_ms"] = graphed_ms([lambda k=k: [compress_keys_launch(k, cu_k, cu_c, None, 0.5, ck, nc, w, s)
                                                   for w, s, ck, cu_c, nc in levels] for _, k in qk], reps)
    row["fused_ms"] = graphed_ms([lambda q=q, k=k: infllmv2.select_blocks(q, k, cu_q, cu_k, **kw) for q, k in qk], reps)
    row["split_ms"] = graphed_ms(split_calls(0), reps)
    row["sweep_ms"] = {s: graphed_ms(split_calls(s), reps) for s in SWEEP}
    del qk, levels
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [select_decode_case(cache, batch, args.reps) for cache, batch in CASES]
    gpu = torch.cuda.get_device_name()

    def fmt(ms):
        return "-" if ms is None else f"{ms:.4f}"

    def sub(a, b):
        return "-" if a is None or b is None else f"{a - b:.4f}"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a / b:.1f}x"

    print(f"\n{gpu}, bf16, D = {D}, Hq = {HQ}, Hk = {HK}, K = {TOPK}, one query a sequence\n")
    print("| cache | batch | splits | compress ms | fused ms | split ms | fused - compress | split - compress "
          "| selection speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["compress_ms"]
        fsel = None if r["fused_ms"] is None or c is None else r["fused_ms"] - c
        ssel = None if r["split_ms"] is None or c is None else r["split_ms"] - c
        print(f"| {r['cache'] // 1024}K | {r['batch']} | {r['splits']} | {fmt(c)} | {fmt(r['fused_ms'])} "
              f"| {fmt(r['split_ms'])} | {sub(r['fused_ms'], c)} | {sub(r['split_ms'], c)} | {ratio(fsel, ssel)} |")
    print("\nforced splits, ms: " + " | ".join(str(s) for s in SWEEP))
    for r in rows:
        print(f"{r['cache'] // 1024}K x {r['batch']} (library: {r['splits']}): "
              + " | ".join(fmt(r["sweep_ms"][s]) for s in SWEEP))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "library": library_identity(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
