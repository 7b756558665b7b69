"""Decoding: stage 2 for one query token a sequence against a long key cache, split over the
selected blocks (`infllmv2.sparse_decode`) and not (the plain forward), against dense attention
of the token over the whole cache (SDPA cuDNN and flash backends) measured in the same run.

    python benchmarks/bench_sparse_decode.py --json out.json

Configuration: bf16, D = 128, Hq = 32, Hk = 2 (G = 16), block 64, K = 96 selected blocks per
token (MiniCPM4.1: the init block, the local window of 32 blocks plus the current one, the rest
drawn from past blocks: `infllmv2.testing.realistic_topk`), caches of 32K and 128K keys, batch
1, 8 and 32 (32K) or 1 and 8 (128K). "paged": the same call over the same keys in a paged KV
cache (`infllmv2.sparse_decode_kvcache`, pages of 64 keys in shuffled order, the library's split
count). Also one whole decoding step two ways: through `infllmv2.attention`
under no_grad on the packed keys (compression of the whole cache, selection and the split stage
2), and through `infllmv2.attention_kvcache` on the paged cache with compressed caches kept
across steps (the step compresses only what its one new key completed). `--eager` times only
that step, called eagerly (host and wall time a call, as a decoding loop without CUDA graphs
pays it) against its CUDA graph, on one cache; and the same with PHSA (a punctuation cache).

Times are per call: each case captures calls on enough copies of its cache to exceed the L2
(256 MB together; one copy where a cache alone is larger) as one CUDA graph, as a decoding loop
runs, and takes the median of CUDA-event timings of its replays, divided by the copies. A
decoding call issues microseconds of GPU work, so launched one by one from Python its time would
be the host's. TFLOP/s count the visible query-key
pairs (4 * D flops per pair and head); GB/s count the K and V bytes of the selected blocks (for
dense, of the whole cache) once per KV head, the traffic that bounds decoding. The dense
baselines get the cache with its Hk heads and `enable_gqa=True` where the backend takes it,
else each KV head repeated for its G query heads (the "gqa" column says which). A second
table times the split forward with forced split counts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_attn import bench  # noqa: E402

import infllmv2  # noqa: E402
from infllmv2.ops import (_sparse_decode, _sparse_decode_kvcache_op, sort_topk_idx, sparse_attn_fwd_launch,  # noqa: E402
                          sparse_decode_splits)
from infllmv2.testing import cu_seqlens, library_identity, realistic_topk, visible_pairs  # noqa: E402

D, HQ, HK, TOPK = 128, 32, 2, 96
PAGE = 64
CASES = [(32768, 1), (32768, 8), (32768, 32), (131072, 1), (131072, 8)]
SWEEP = (2, 4, 8, 12, 16, 24, 32, 48, 64)


L2_BYTES = 256 << 20  # rotate through caches of at least this many bytes together: each call reads from DRAM


def graphed_ms(calls, reps):
    """Median ms per call of `calls` (one each, in turn) replayed as one CUDA graph: decoding runs
    this way (launch overhead would otherwise dominate: a call issues microseconds of work), and
    capturing also checks that nothing synchronises with the host. None if capture fails."""
    def run():
        for c in calls:
            c()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # allocations and one-time initialisation outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            run()
    except RuntimeError as e:
        print(f"  capture failed: {str(e).splitlines()[0][:100]}")
        return None
    return bench(graph.replay, reps) / len(calls)


def copies_for(nbytes):
    return max(1, min(8, -(-L2_BYTES // nbytes)))


def dense_decode(cache, batch, backend, reps):
    """ms of SDPA for one query a sequence over the whole cache, and whether GQA ran unexpanded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    n = copies_for(batch * cache * HK * D * 2 * 2)
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    kv = [(torch.randn(batch, HK, cache, D, device="cuda", dtype=torch.bfloat16),
           torch.randn(batch, HK, cache, D, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]
    try:
        with sdpa_kernel([be]):
            try:
                F.scaled_dot_product_attention(q, *kv[0], enable_gqa=True)
                gqa = True
            except RuntimeError:
                kv = [tuple(t.repeat_interleave(HQ // HK, dim=1) for t in pair) for pair in kv[:1]]
                gqa = False
            calls = [lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa) for k, v in kv]
            return graphed_ms(calls, reps), gqa
    except RuntimeError as e:  # a backend missing on this GPU/torch
        print(f"  dense {backend}: unavailable ({str(e).splitlines()[0][:80]})")
        return None, None
    finally:
        del q, kv
        torch.cuda.empty_cache()


def paged_caches(qkv, batch, cache):
    """The same keys and values in paged caches, pages of PAGE keys shuffled, for half the copies
    (the packed copies stay allocated): [(q, k_cache, v_cache)], block_table, cache_seqlens."""
    n_pages = batch * cache // PAGE
    g = torch.Generator(device="cpu").manual_seed(1)
    perm = torch.randperm(n_pages, generator=g).cuda()
    table = perm.view(batch, cache // PAGE).to(torch.int32)
    lens = torch.full((batch,), cache, dtype=torch.int32, device="cuda")
    caches = []
    for q, k, v in qkv[: max(1, len(qkv) // 2)]:
        kc = torch.empty((n_pages, PAGE, HK, D), device="cuda", dtype=k.dtype)
        vc = torch.empty_like(kc)
        kc[perm], vc[perm] = k.view(n_pages, PAGE, HK, D), v.view(n_pages, PAGE, HK, D)
        caches.append((q, kc, vc))
    return caches, table, lens


def paged_ms(caches, table, lens, idx, cu_q, reps):
    """The split forward over the paged caches."""
    return graphed_ms([lambda q=q, kc=kc, vc=vc: _sparse_decode_kvcache_op(q, kc, vc, idx, cu_q, lens, table, 1, 0.0, 0)
                       for q, kc, vc in caches], reps)


def cache_step_calls(caches, table, lens, cu_q, cache, phsa=False):
    """A whole decoding step through `infllmv2.attention_kvcache` on each of the paged caches: the
    compressed caches (built once, before) updated for the step's one new key, the selection
    over them, the split stage 2. `phsa`: with a punctuation cache (a fifth of the keys)."""
    cfg = infllmv2.SparseConfig()
    calls = []
    for q, kc, vc in caches:
        ck, nk = (torch.empty((len(lens), infllmv2.compressed_capacity(cache, w, s), HK, D), device="cuda",
                              dtype=kc.dtype) for w, s in ((32, 16), (128, 64)))
        pc = (torch.rand(kc.shape[:2], device="cuda", generator=torch.Generator("cuda").manual_seed(2)) < 0.2) \
            if phsa else None
        infllmv2.compress_keys_kvcache(kc, lens, ck, cache, table, punct_cache=pc)
        infllmv2.compress_keys_kvcache(kc, lens, nk, cache, table, 128, 64, punct_cache=pc)
        calls.append(lambda q=q, kc=kc, vc=vc, ck=ck, nk=nk, pc=pc: infllmv2.attention_kvcache(
            q, kc, vc, lens, cu_q, ck, nk, 1, table, cfg, max_seqlen_q=1, max_seqlen_k=cache, punct_cache=pc))
    return calls


def eager_us(fn, batches=30, calls=50):
    """Host and wall microseconds per call of `fn` called eagerly, `calls` at a time, the least of
    `batches` batches: a decoding loop without CUDA graphs pays the host's time (Python, the
    launches) wherever it exceeds the kernels'. The least batch, because this host's
    interruptions move single batches by tens of microseconds."""
    for _ in range(20):
        fn()
    host, wall = [], []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((time.perf_counter() - t0) / calls * 1e6)
    return min(host), min(wall)


def eager_case(cache, batch, reps):
    """`infllmv2.attention_kvcache`'s decoding step on one paged cache, eager and as a CUDA graph."""
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [(torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(batch * cache, HK, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(batch * cache, HK, D, device="cuda", dtype=torch.bfloat16, generator=g))]
    row = {"cache": cache, "batch": batch}
    with torch.no_grad():
        caches, table, lens = paged_caches(qkv, batch, cache)
        for name, phsa in (("", False), ("phsa_", True)):
            step = cache_step_calls(caches, table, lens, cu_seqlens([1] * batch, "cuda"), cache, phsa)
            row[f"{name}eager_host_us"], row[f"{name}eager_wall_us"] = eager_us(step[0])
            graph = graphed_ms(step, reps)
            row[f"{name}graph_us"] = None if graph is None else graph * 1e3
    del qkv, caches
    torch.cuda.empty_cache()
    return row


def sparse_decode_case(cache, batch, reps):
    lq, lk = [1] * batch, [cache] * batch
    n = copies_for(batch * cache * HK * D * 2 * 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [(torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(batch * cache, HK, D, device="cuda", dtype=torch.bfloat16, generator=g),
            torch.randn(batch * cache, HK, D, device="cuda", dtype=torch.bfloat16, generator=g)) for _ in range(n)]
    cu_q, cu_k = cu_seqlens(lq, "cuda"), cu_seqlens(lk, "cuda")
    idx = sort_topk_idx(realistic_topk(lq, lk, HK, TOPK, local_blocks=32, correlated=False, device="cuda"))
    pairs = visible_pairs(idx, lq, lk) * (HQ // HK)
    q0, k0 = qkv[0][:2]
    splits = sparse_decode_splits(q0, k0, idx, cu_q, 1)
    out, lse = torch.empty_like(q0), torch.empty(HQ, batch, device="cuda")

    def split_calls(num_splits):
        return [lambda q=q, k=k, v=v: _sparse_decode(q, k, v, cu_q, cu_k, idx, 1, None, num_splits, 64, False,
                                                      rows_sorted=True) for q, k, v in qkv]

    row = {"cache": cache, "batch": batch, "topk": TOPK, "splits": splits, "visible_pairs": pairs,
           "kv_bytes": pairs // (HQ // HK) * 2 * D * 2, "copies": n, "page": PAGE}
    with torch.no_grad():
        row["split_ms"] = graphed_ms(split_calls(0), reps)
        caches, table, lens = paged_caches(qkv, batch, cache)
        row["paged_ms"] = paged_ms(caches, table, lens, idx, cu_q, reps)
        row["cache_step_ms"] = graphed_ms(cache_step_calls(caches, table, lens, cu_q, cache), reps)
        del caches
        row["plain_ms"] = graphed_ms([lambda q=q, k=k, v=v: sparse_attn_fwd_launch(q, k, v, idx, cu_q, cu_k, 1, 0.0, out,
                                                                                   lse) for q, k, v in qkv], reps)
        # the split count against forced ones: how the library's choice compares
        row["sweep_ms"] = {s: graphed_ms(split_calls(s), reps) for s in SWEEP}
        cfg = infllmv2.SparseConfig()
        row["step_ms"] = graphed_ms([lambda q=q, k=k, v=v: infllmv2.attention(q, k, v, cu_q, cu_k, 1, cache, config=cfg)
                                     for q, k, v in qkv], reps)
    del qkv
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--eager", action="store_true",
                    help="only the attention_kvcache step's host and wall time called eagerly, against its CUDA graph")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.eager:
        return eager_main(args)
    rows = []
    for cache, batch in CASES:
        row = sparse_decode_case(cache, batch, args.reps)
        for backend in ("cudnn", "flash"):
            row[f"{backend}_ms"], row[f"{backend}_gqa"] = dense_decode(cache, batch, backend, args.reps)
        rows.append(row)
    gpu = torch.cuda.get_device_name()

    def rate(ms, flop_or_bytes, scale):
        return "-" if ms is None else f"{flop_or_bytes / ms / scale:.0f}"

    def fmt(ms):
        return "-" if ms is None else f"{ms:.4f}"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a / b:.1f}x"

    print(f"\n{gpu}, bf16, D = {D}, Hq = {HQ}, Hk = {HK}, K = {TOPK}, one query a sequence\n")
    print("| cache | batch | splits | split ms | TFLOP/s | GB/s | paged ms | plain ms | cuDNN ms (gqa) | flash ms (gqa) "
          "| vs plain | vs cuDNN | attention() step ms | attention_kvcache() step ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dense_bytes = r["batch"] * r["cache"] * HK * 2 * D * 2

        def dense_col(backend):
            ms = r[f"{backend}_ms"]
            return "-" if ms is None else f"{ms:.4f} ({'yes' if r[f'{backend}_gqa'] else 'no'}, " \
                                          f"{dense_bytes / ms / 1e6:.0f} GB/s)"

        print(f"| {r['cache'] // 1024}K | {r['batch']} | {r['splits']} | {fmt(r['split_ms'])} "
              f"| {rate(r['split_ms'], 4 * D * r['visible_pairs'], 1e9)} | {rate(r['split_ms'], r['kv_bytes'], 1e6)} "
              f"| {fmt(r['paged_ms'])} | {fmt(r['plain_ms'])} | {dense_col('cudnn')} | {dense_col('flash')} "
              f"| {ratio(r['plain_ms'], r['split_ms'])} | {ratio(r['cudnn_ms'], r['split_ms'])} | {fmt(r['step_ms'])} "
              f"| {fmt(r['cache_step_ms'])} |")
    print("\nforced splits, ms: " + " | ".join(str(s) for s in SWEEP))
    for r in rows:
        print(f"{r['cache'] // 1024}K x {r['batch']} (library: {r['splits']}): "
              + " | ".join(fmt(r["sweep_ms"][s]) for s in SWEEP))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "library": library_identity(), "rows": rows}, f, indent=1)



def eager_main(args):
    gpu = torch.cuda.get_device_name()
    print(f"\n{gpu}: infllmv2.attention_kvcache, one decoding step (bf16, D = {D}, Hq = {HQ}, Hk = {HK}, K = {TOPK}, "
          f"paged cache), us a call\n")
    print("| cache | batch | eager host us | eager wall us | CUDA graph us | PHSA: eager host / wall us | PHSA: CUDA graph us |")
    print("|---|---|---|---|---|---|---|")
    rows = []

    def us(x):
        return "-" if x is None else f"{x:.1f}"

    for cache, batch in CASES:
        r = eager_case(cache, batch, args.reps)
        rows.append(r)
        print(f"| {cache // 1024}K | {batch} | {us(r['eager_host_us'])} | {us(r['eager_wall_us'])} | {us(r['graph_us'])} "
              f"| {us(r['phsa_eager_host_us'])} / {us(r['phsa_eager_wall_us'])} | {us(r['phsa_graph_us'])} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.__version__, "library": library_identity(), "mode": "eager",
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
