"""Dense decoding over a KV cache: `infllmv2.dense_decode_kvcache` (one query token a sequence
against every cached key, split over the keys) against dense attention through SDPA's cuDNN and
flash backends, measured in the same run.

    python benchmarks/bench_dense_decode_kvcache.py --json out.json

Configuration: bf16, D = 128, Hq = 32, Hk = 2 (G = 16), one query a sequence, caches of 4K, 8K,
32K and 128K keys in pages of 64 keys in shuffled order, batch 1 and 8 (and 32 up to 32K). Also:
- "every block": the same attention as `sparse_decode_kvcache` with every block selected (what
  the decoding step ran below `dense_len` before this op; at most 128 blocks, 8192 keys);
- "step": `infllmv2.attention_kvcache` with MiniCPM4.1's `sparse_config` and `dense_len` above
  the cache (its dense path: the compressed caches updated, then this op);
- forced split counts against the library's;
- "compat": `infllmv2.compat.infllmv2_attn_with_kvcache` without a selection over caches whose
  capacity (128K keys) exceeds the keys held, as a server with a preallocated block table calls
  it: the library sizes its splits by the capacity, the kernel reads the lengths.

Times are per call, as `bench_sparse_decode.py` takes them: calls on enough copies of the cache
to exceed the L2, captured as one CUDA graph, median of replays. GB/s count the K and V bytes of
the cache once per KV head; TFLOP/s the query-key pairs (4 * D flops a pair and head). The
baselines get the cache with its Hk heads and `enable_gqa=True` where the backend takes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_decode import copies_for, dense_decode, graphed_ms  # noqa: E402

import infllmv2  # noqa: E402
from infllmv2.compat import infllmv2_attn_with_kvcache  # noqa: E402
from infllmv2.ops import _dense_decode_kvcache_op, _sparse_decode_kvcache_op, dense_decode_kvcache_splits  # noqa: E402
from infllmv2.testing import cu_seqlens, every_block_selection, library_identity  # noqa: E402

D, HQ, HK = 128, 32, 2
PAGE = 64
CASES = [(4096, 1), (4096, 8), (4096, 32), (8192, 1), (8192, 8), (8192, 32), (32768, 1), (32768, 8), (32768, 32),
         (131072, 1), (131072, 8)]
COMPAT_CASES = [(4096, 1), (4096, 8)]  # keys held, batch; capacity 128K
SWEEP = (2, 4, 8, 16, 32, 64, 128)
CAPACITY = 131072


def paged(batch, pages_per_seq, copies, seed=0):
    """`copies` paged caches of `pages_per_seq` shuffled pages a sequence, random keys and values,
    with their queries: [(q, k_cache, v_cache)] and the block table."""
    n_pages = batch * pages_per_seq
    g = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(n_pages, device="cuda", generator=g).view(batch, pages_per_seq).to(torch.int32)
    caches = [(torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g),
               torch.randn(n_pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16, generator=g),
               torch.randn(n_pages, PAGE, HK, D, device="cuda", dtype=torch.bfloat16, generator=g))
              for _ in range(copies)]
    return caches, table


def case(cache, batch, reps):
    copies = copies_for(batch * cache * HK * D * 2 * 2)
    caches, table = paged(batch, cache // PAGE, copies)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    cu_q = cu_seqlens([1] * batch, "cuda")
    q0 = caches[0][0]
    row = {"cache": cache, "batch": batch, "copies": copies,
           "splits": dense_decode_kvcache_splits(q0, HK, cu_q, 1, cache, 0)}
    def calls(num_splits):
        return [lambda q=q, kc=kc, vc=vc: _dense_decode_kvcache_op(q, kc, vc, cu_q, lens, table, 1, cache, 0.0,
                                                                   num_splits) for q, kc, vc in caches]

    with torch.no_grad():
        row["dense_decode_ms"] = graphed_ms(calls(0), reps)
        # the library's split count against forced ones
        row["sweep_ms"] = {s: graphed_ms(calls(s), reps) for s in SWEEP}
        row["every_block_ms"] = None
        if cache // 64 <= 128:
            idx = every_block_selection(HK, batch, cache, "cuda")
            row["every_block_ms"] = graphed_ms([lambda q=q, kc=kc, vc=vc: _sparse_decode_kvcache_op(
                q, kc, vc, idx, cu_q, lens, table, 1, 0.0, 0) for q, kc, vc in caches], reps)
        cfg = infllmv2.SparseConfig(dense_len=cache + 1)
        step = []
        for q, kc, vc in caches:
            ck, nk = (torch.empty((batch, infllmv2.compressed_capacity(cache, w, s), HK, D), device="cuda",
                                  dtype=kc.dtype) for w, s in ((32, 16), (128, 64)))
            infllmv2.compress_keys_kvcache(kc, lens, ck, cache, table)
            infllmv2.compress_keys_kvcache(kc, lens, nk, cache, table, 128, 64)
            step.append(lambda q=q, kc=kc, vc=vc, ck=ck, nk=nk: infllmv2.attention_kvcache(
                q, kc, vc, lens, cu_q, ck, nk, 1, table, cfg, max_seqlen_q=1, max_seqlen_k=cache))
        row["step_ms"] = graphed_ms(step, reps)
    del caches, step
    torch.cuda.empty_cache()
    return row


def compat_case(keys, batch, reps):
    """compat's dense call over caches of CAPACITY keys a sequence holding `keys` each."""
    copies = copies_for(batch * keys * HK * D * 2 * 2)
    caches, table = paged(batch, CAPACITY // PAGE, copies, seed=1)
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    row = {"keys": keys, "capacity": CAPACITY, "batch": batch, "copies": copies}
    with torch.no_grad():
        row["compat_ms"] = graphed_ms([lambda q=q, kc=kc, vc=vc: infllmv2_attn_with_kvcache(
            q.view(batch, 1, HQ, D), kc, vc, cache_seqlens=lens, block_table=table) for q, kc, vc in caches], reps)
    del caches
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for cache, batch in CASES:
        row = case(cache, batch, args.reps)
        for backend in ("cudnn", "flash"):
            row[f"{backend}_ms"], row[f"{backend}_gqa"] = dense_decode(cache, batch, backend, args.reps)
        rows.append(row)
    compat_rows = []
    for keys, batch in COMPAT_CASES:
        row = compat_case(keys, batch, args.reps)
        row["cudnn_ms"], row["cudnn_gqa"] = dense_decode(keys, batch, "cudnn", args.reps)
        compat_rows.append(row)
    gpu = torch.cuda.get_device_name()

    def fmt(ms):
        return "-" if ms is None else f"{ms:.4f}"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    print(f"\n{gpu}, bf16, D = {D}, Hq = {HQ}, Hk = {HK}, one query a sequence, pages of {PAGE} keys\n")
    print("| cache | batch | splits | dense_decode_kvcache ms | GB/s | TFLOP/s | every block ms | step ms "
          "| cuDNN ms (gqa) | flash ms (gqa) | cuDNN / ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        nbytes = r["batch"] * r["cache"] * HK * 2 * D * 2
        flop = 4 * D * r["batch"] * r["cache"] * HQ
        ms = r["dense_decode_ms"]

        def base(backend):
            b = r[f"{backend}_ms"]
            return "-" if b is None else f"{b:.4f} ({'yes' if r[f'{backend}_gqa'] else 'no'})"

        print(f"| {r['cache'] // 1024}K | {r['batch']} | {r['splits']} | {fmt(ms)} | {nbytes / ms / 1e6:.0f} "
              f"| {flop / ms / 1e9:.1f} | {fmt(r['every_block_ms'])} | {fmt(r['step_ms'])} | {base('cudnn')} "
              f"| {base('flash')} | {ratio(r['cudnn_ms'], ms)} |")
    print("\nforced splits, ms: " + " | ".join(str(s) for s in SWEEP))
    for r in rows:
        print(f"{r['cache'] // 1024}K x {r['batch']} (library: {r['splits']}): "
              + " | ".join(fmt(r["sweep_ms"][s]) for s in SWEEP))
    print(f"\ncompat infllmv2_attn_with_kvcache, no selection, capacity {CAPACITY // 1024}K keys a sequence\n")
    print("| keys held | batch | compat ms | cuDNN ms on the keys held | cuDNN / compat |")
    print("|---|---|---|---|---|")
    for r in compat_rows:
        print(f"| {r['keys'] // 1024}K | {r['batch']} | {fmt(r['compat_ms'])} | {fmt(r['cudnn_ms'])} "
              f"| {ratio(r['cudnn_ms'], r['compat_ms'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "library": library_identity(), "rows": rows,
                       "compat_rows": compat_rows}, f, indent=1)


if __name__ == "__main__":
    main()
