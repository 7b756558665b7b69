"""End to end: `infllmv2.attention` (compression + selection + sparse attention, forward and
backward) against dense causal attention (SDPA cuDNN and flash backends) in the same run, plus
the dense path alone against cuDNN.

    python benchmarks/bench_attention.py --json bench_attention.json
    python benchmarks/bench_attention.py --inputs correlated --json bench_attention_correlated.json
    python benchmarks/bench_attention.py --plot bench_attention.json bench_attention_correlated.json \
        --png benchmarks/results/bench_attention.png

Configuration: bf16, D = 128, Hq = 32, Hk = 2, MiniCPM4.1's sparse_config (compression 32/16,
coarse-key normaliser 128/64, block 64, 1 init block, 2048-token window, top-64 + 32 local =
96 blocks, dense below 8192 keys), equal-length varlen at 32K x 8, 64K x 4, 128K x 2 tokens;
the dense path (`infllmv2.dense_attn_varlen`, causal) at 4K x 8 and 8K x 4. Random data, or with
`--inputs correlated` queries whose 64-token blocks share most of their direction (each token's
query is its block's random vector plus a tenth of its own noise), so that neighbouring tokens
pick mostly the same blocks, as a model's do (a synthetic stand-in: keys and values stay random);
that mode runs the sparse rows only (the dense path does not depend on the data).

ms are medians of CUDA-event timings after warm-up; "fwd+bwd" times one forward and one
backward (autograd). TFLOP/s count the query-key pairs actually visible (for the sparse path
those of the selection it made, `testing.visible_pairs`): 4 * D flops per pair and head
forward, 2.5x that backward; dense causal counts S(S+1)/2 pairs per sequence and head.
"tile fill": of the GEMM rows stage 2's forward and dQ compute, the share the selection made
asks for (`bench_sparse_attn.tile_fill`; random data makes neighbouring tokens' picks unrelated).
`--kernels` adds, for the sparse rows, each kernel's device time in one more forward + backward
call (torch profiler; into the JSON as "kernel_ms", as bench_sparse_attn.py does; the five
slowest device kernels printed). "fb MHz/W/cap", for the sparse rows: the median SM clock, the
median board power and the share of samples in which the driver named the power cap as what
held the clock down, over the timed forward + backward calls (`bench_sparse_attn.GpuSampler`,
NVML; n/a without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_attn import bench, clock_text, dense, gpu_fields, kernel_times, tile_fill  # noqa: E402

import infllmv2  # noqa: E402
from infllmv2.testing import cu_seqlens, library_identity, visible_pairs  # noqa: E402

D, HQ, HK = 128, 32, 2


QUERY_BLOCK, NOISE = 64, 0.1  # --inputs correlated: tokens sharing a query direction, and their own part


def _inputs(seqlen, batch, seed=0, correlated=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = seqlen * batch
    if correlated:
        base = torch.randn(-(-n // QUERY_BLOCK), 1, HQ, D, device="cuda", generator=g)
        own = torch.randn(base.shape[0], QUERY_BLOCK, HQ, D, device="cuda", generator=g)
        q = (base + NOISE * own).reshape(-1, HQ, D)[:n].to(torch.bfloat16).requires_grad_()
    else:
        q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(n, HK, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(n, HK, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    return q, k, v, cu_seqlens([seqlen] * batch, "cuda")


def _fwd_and_fwd_bwd(call, q, k, v, reps, kernels=False, gpu=None):
    """Median ms of the forward and of forward + backward; with kernels, also each kernel's
    device ms in one more forward + backward call; with a dict gpu, the GPU's clock, power and
    clock limits over the timed forward + backward calls (bench_sparse_attn.GpuSampler)."""
    fwd = bench(lambda: call(q, k, v), reps)
    dout = torch.randn_like(q)

    def fwd_bwd():
        out = call(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    return fwd, bench(fwd_bwd, reps, gpu=gpu), (kernel_times(fwd_bwd) if kernels else None)


def end_to_end(seqlen, batch, reps, cfg, kernels=False, correlated=False):
    q, k, v, cu = _inputs(seqlen, batch, correlated=correlated)

    def call(q, k, v):
        return infllmv2.attention(q, k, v, cu, cu, seqlen, seqlen, config=cfg)

    gpu = {}
    fwd, fwd_bwd, times = _fwd_and_fwd_bwd(call, q, k, v, reps, kernels, gpu)
    sel = bench(lambda: infllmv2.select_blocks(
        q, k, cu, cu, topk=cfg.num_selected, init_blocks=cfg.init_blocks, local_blocks=cfg.local_blocks,
        approx_lse=cfg.approx_lse, max_seqlen_q=seqlen, max_seqlen_k=seqlen), reps)
    idx = infllmv2.select_blocks(q, k, cu, cu, topk=cfg.num_selected, init_blocks=cfg.init_blocks,
                                 local_blocks=cfg.local_blocks, approx_lse=cfg.approx_lse, max_seqlen_q=seqlen,
                                 max_seqlen_k=seqlen)
    lengths = [seqlen] * batch
    pairs = visible_pairs(idx, lengths, lengths) * (HQ // HK)
    fill = tile_fill(idx, lengths, HQ // HK)
    del q, k, v, idx
    torch.cuda.empty_cache()
    r = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "selection_ms": sel, "visible_pairs": pairs, "tile_fill": fill,
         **gpu_fields(gpu, "fwd_bwd_")}
    if times is not None:
        r["kernel_ms"] = times
    return r


def dense_path(seqlen, batch, reps):
    q, k, v, cu = _inputs(seqlen, batch)

    def call(q, k, v):
        return infllmv2.dense_attn_varlen(q, k, v, cu, cu, seqlen, seqlen)

    fwd, fwd_bwd, _ = _fwd_and_fwd_bwd(call, q, k, v, reps)
    del q, k, v
    torch.cuda.empty_cache()
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "visible_pairs": batch * HQ * seqlen * (seqlen + 1) // 2}


def run(args):
    cfg = infllmv2.SparseConfig()
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}, bf16, D={D}, Hq={HQ}, Hk={HK}, config {cfg.to_dict()}")
    rows = [("sparse", 32768, 8), ("sparse", 65536, 4), ("sparse", 131072, 2), ("dense", 4096, 8), ("dense", 8192, 4)]
    if args.quick:
        rows = [rows[0], rows[3]]
    correlated = args.inputs == "correlated"
    if correlated:
        rows = [r for r in rows if r[0] == "sparse"]
    results = []
    for path, seqlen, batch in rows:
        r = (end_to_end(seqlen, batch, args.reps, cfg, args.kernels, correlated) if path == "sparse"
             else dense_path(seqlen, batch, args.reps))
        r.update(path=path, tokens=f"{seqlen // 1024}K x {batch}", seqlen=seqlen, batch=batch)
        pairs = r["visible_pairs"]
        r["fwd_tflops"] = 4 * D * pairs / r["fwd_ms"] / 1e9
        r["fwd_bwd_tflops"] = 3.5 * 4 * D * pairs / r["fwd_bwd_ms"] / 1e9
        dense_pairs = batch * HQ * seqlen * (seqlen + 1) // 2
        for backend in ("cudnn", "flash"):
            f, b = dense(seqlen, batch, HQ, HK, D, backend, args.reps)
            r[f"{backend}_fwd_ms"], r[f"{backend}_fwd_bwd_ms"] = f, (f + b if f else None)
            r[f"{backend}_fwd_tflops"] = 4 * D * dense_pairs / f / 1e9 if f else None
            if f:
                r[f"speedup_vs_{backend}_fwd"] = f / r["fwd_ms"]
                r[f"speedup_vs_{backend}_fwd_bwd"] = (f + b) / r["fwd_bwd_ms"]
        results.append(r)

    print(f"{'path':<7}{'tokens':<11}{'fwd ms':>8}{'fwd+bwd':>9}{'sel ms':>8}{'TF/s f/fb':>11}"
          f"{'cuDNN f / fb':>15}{'flash f / fb':>16}{'x cuDNN f / fb':>16}{'tile fill':>10}{'fb MHz/W/cap':>15}")
    for r in results:
        def pair(a, b):
            return f"{a:.1f}/{b:.1f}" if a else "n/a"

        sel = f"{r['selection_ms']:.1f}" if "selection_ms" in r else "-"
        ck = clock_text(r, "fwd_bwd_") if r["path"] == "sparse" else "-"  # sampled for the sparse rows
        sp = (f"{r['speedup_vs_cudnn_fwd']:.2f}/{r['speedup_vs_cudnn_fwd_bwd']:.2f}x"
              if "speedup_vs_cudnn_fwd" in r else "n/a")
        print(f"{r['path']:<7}{r['tokens']:<11}{r['fwd_ms']:>8.1f}{r['fwd_bwd_ms']:>9.1f}{sel:>8}"
              f"{r['fwd_tflops']:>5.0f}/{r['fwd_bwd_tflops']:<5.0f}"
              f"{pair(r['cudnn_fwd_ms'], r['cudnn_fwd_bwd_ms']):>15}{pair(r['flash_fwd_ms'], r['flash_fwd_bwd_ms']):>16}"
              f"{sp:>16}{format(r['tile_fill'], '.2f') if 'tile_fill' in r else '-':>10}{ck:>15}")
    for r in results:
        if "kernel_ms" in r:
            # device kernels only: the profiler also lists the ops that launched them
            top = [(n, ms) for n, ms in r["kernel_ms"].items() if n.endswith("_kernel") or n.startswith("void ")][:5]
            listed = ", ".join(f"{name.removeprefix('infllmv2_')[:60]} {ms:.2f}" for name, ms in top)
            print(f"{r['tokens']} fwd+bwd kernels (ms, one call): {listed}")
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "library": library_identity(), "config": cfg.to_dict(),
                   "inputs": args.inputs, "results": results}, f, indent=1)
    print(f"wrote {args.json}")


def plot(json_paths, png_path):
    """Speed-up of infllmv2.attention over dense attention vs sequence length, from JSONs of run():
    every curve of the first; forward + backward against cuDNN of the others (other inputs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ticks = set()
    for i, path in enumerate(json_paths):
        with open(path) as f:
            data = json.load(f)
        if i == 0:
            device = data["device"]
        inputs = data.get("inputs", "random")
        rows = sorted(data["results"], key=lambda r: r["seqlen"])
        ticks.update(r["seqlen"] for r in rows)
        curves = [("cudnn", "o-", "fwd_bwd", "fwd+bwd"), ("cudnn", "o-", "fwd", "fwd"),
                  ("flash", "s--", "fwd_bwd", "fwd+bwd"), ("flash", "s--", "fwd", "fwd")]
        for backend, style, what, label in curves if i == 0 else curves[:1]:
            pts = [(r["seqlen"], r[f"speedup_vs_{backend}_{what}"]) for r in rows
                   if r.get(f"speedup_vs_{backend}_{what}")]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, style if i == 0 else "^:", alpha=1.0 if what == "fwd_bwd" else 0.5,
                        label=f"{label} vs {backend} dense, {inputs} inputs")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [f"{n // 1024}K" for n in sorted(ticks)])
    ax.set_xlabel("sequence length (dense path below 8K, InfLLM-V2 sparse from 8K)")
    ax.set_ylabel("speed-up over dense causal attention")
    ax.set_title(f"infllmv2.attention, bf16 D=128 Hq=32 Hk=2 ({device})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench_attention.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="32K x 8 and the 4K dense row only")
    ap.add_argument("--inputs", choices=("random", "correlated"), default="random",
                    help="random q/k/v, or queries shared within 64-token blocks (sparse rows only)")
    ap.add_argument("--kernels", action="store_true",
                    help="per-kernel device ms of one sparse forward + backward call (torch profiler)")
    ap.add_argument("--plot", metavar="JSON", nargs="+",
                    help="only draw the PNG from earlier runs' JSONs (needs matplotlib): every curve of the first, "
                         "fwd+bwd vs cuDNN of the others")
    ap.add_argument("--png", default="bench_attention.png")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot, args.png)
    else:
        run(args)


if __name__ == "__main__":
    main()
