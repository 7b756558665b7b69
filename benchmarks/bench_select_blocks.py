"""Stage-1 block selection (compression through topk_idx), fused kernels against the reference
PyTorch pipeline on the GPU, measured in the same run.

    python benchmarks/bench_select_blocks.py --json out.json

Configuration: bf16, D = 128, Hq = 32, Hk = 2, K = 96 with 1 init and 32 local blocks, block 64,
compression 32/16 (coarse 128/64 for the approximate normaliser), equal-length varlen at
32K x 8, 64K x 4 and 128K x 2 tokens, both normalisers. Per row:

  ms        `infllmv2.select_blocks` as a user calls it: two compress_keys launches (one without
            the approximate normaliser) and the fused selection kernel; median of CUDA events
  +MiB      peak device memory during the call beyond the inputs and the topk_idx output
  TFLOP/s   on the q.k products actually needed: visible (query, compressed key) pairs x Hq x
            2D for the scores, plus the same for the normaliser keys
  ref ms    `infllmv2.reference.select_blocks` on the same GPU tensors (materialised scores,
            torch.topk), and its peak extra memory; at the lengths given by --ref-seqlens
  stage-2   the stage-2 forward (`sparse_attn_fwd`) on the selection just made, for scale
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import infllmv2
from infllmv2 import reference
from infllmv2.ops import sort_topk_idx
from infllmv2.testing import cu_seqlens, library_identity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_attn import bench  # noqa: E402

CONFIGS = [(32768, 8), (65536, 4), (131072, 2)]
HQ, HK, D, TOPK, INIT, LOCAL = 32, 2, 128, 96, 1, 32


def visible_key_pairs(seqlen, window, stride):
    """sum over positions p of the compressed keys (window, stride) visible at p."""
    p = torch.arange(seqlen, dtype=torch.float64)
    return float(torch.clamp(torch.div(p - window + 1, stride, rounding_mode="floor") + 1, min=0).sum())


def flops(seqlen, batch, approx):
    pairs = visible_key_pairs(seqlen, 32, 16) * (1 if approx else 2)
    if approx:
        pairs += visible_key_pairs(seqlen, 128, 64)
    return pairs * batch * HQ * 2 * D


def peak_extra_mib(fn, out_bytes):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out_bytes
    del out
    return extra / 2**20


def run(seqlen, batch, approx, reps, with_ref):
    lengths = [seqlen] * batch
    torch.manual_seed(0)
    q = torch.randn(seqlen * batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seqlen * batch, HK, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seqlen * batch, HK, D, device="cuda", dtype=torch.bfloat16)
    cu = cu_seqlens(lengths, "cuda")
    out_bytes = HK * seqlen * batch * TOPK * 4

    def ours():
        return infllmv2.select_blocks(q, k, cu, cu, topk=TOPK, init_blocks=INIT, local_blocks=LOCAL, approx_lse=approx,
                                      max_seqlen_q=seqlen, max_seqlen_k=seqlen)

    ms = bench(ours, reps)
    mib = peak_extra_mib(ours, out_bytes)
    row = {"tokens": f"{seqlen // 1024}K x {batch}", "seqlen": seqlen, "batch": batch,
           "normaliser": "approx" if approx else "exact", "ms": ms, "extra_mib": mib,
           "tflops": flops(seqlen, batch, approx) / ms / 1e9}
    idx = sort_topk_idx(ours())
    row["stage2_fwd_ms"] = bench(lambda: torch.ops.infllmv2.sparse_attn_fwd(q, k, v, idx, cu, cu, seqlen, seqlen, 0.0),
                                 reps)
    if with_ref:
        def ref():
            return reference.select_blocks(q, k, cu, cu, topk=TOPK, init_blocks=INIT, local_blocks=LOCAL,
                                           approx_lse=approx)

        row["ref_ms"] = bench(ref, 1, warmup=0)
        row["ref_extra_mib"] = peak_extra_mib(ref, out_bytes)
        row["speedup_vs_ref"] = row["ref_ms"] / ms
    del q, k, v
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="only 32K x 8 with the approximate normaliser")
    ap.add_argument("--ref-seqlens", type=int, nargs="*", default=[32768],
                    help="sequence lengths at which the PyTorch reference pipeline is timed too")
    args = ap.parse_args()
    configs = CONFIGS[:1] if args.quick else CONFIGS
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.version.__version__}, infllmv2 {infllmv2.__version__}")
    hdr = (f"{'tokens':>10} {'norm':>6} {'ms':>8} {'+MiB':>7} {'TFLOP/s':>8} {'ref ms':>9} {'ref +MiB':>9} "
           f"{'x ref':>6} {'stage2 fwd':>10}")
    print(hdr)
    rows = []
    for seqlen, batch in configs:
        for approx in ((True,) if args.quick else (True, False)):
            r = run(seqlen, batch, approx, args.reps, seqlen in args.ref_seqlens)
            rows.append(r)
            ref = (f"{r['ref_ms']:9.1f} {r['ref_extra_mib']:9.0f} {r['speedup_vs_ref']:6.1f}" if "ref_ms" in r
                   else f"{'-':>9} {'-':>9} {'-':>6}")
            print(f"{r['tokens']:>10} {r['normaliser']:>6} {r['ms']:8.2f} {r['extra_mib']:7.1f} {r['tflops']:8.1f} "
                  f"{ref} {r['stage2_fwd_ms']:10.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "torch": torch.version.__version__, "library": library_identity(),
                       "config": {"hq": HQ, "hk": HK, "head_dim": D, "topk": TOPK, "init_blocks": INIT,
                                  "local_blocks": LOCAL, "dtype": "bfloat16"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
