"""Stage-2 sparse attention, forward and backward, against dense causal attention (SDPA cuDNN and
flash backends) measured in the same run.

    python benchmarks/bench_sparse_attn.py --json out.json [--kernels]

Configuration of the original kernels' table: bf16, D = 128, Hq = 32, Hk = 2 (G = 16), block 64,
K = 64 selected blocks per token (the init block, the local window of 32 blocks plus the
current one, the rest drawn from past blocks: `infllmv2.testing.realistic_topk`), causal,
equal-length varlen at 32K x 8, 64K x 4, 128K x 2 tokens; plus G = 4 (Hk = 8) at 32K x 8 and
the worst case of independent per-token selections at 32K x 8.

TFLOP/s count the query-key pairs actually visible (causal, selected): 4 * D flops per pair and
head forward, 2.5x that backward; dense causal counts S(S+1)/2 pairs per sequence and head.
Times are medians of CUDA-event timings after warm-up; "bwd MHz/W/cap" is the median SM clock,
the median board power and the share of samples in which the driver named the power cap as
what held the clock down, during the timed backward calls, and "bwd C" the median GPU
temperature then (NVML; n/a without it; the JSON also has the thermal and hardware-slowdown
shares). "tile fill" is the share of the forward's and dQ's GEMM rows that the selections ask
for (`tile_fill`); `--kernels` adds each kernel's device time in one more forward and backward
call (torch profiler).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import threading

import torch
import torch.nn.functional as F

from infllmv2._lib import selected_arch
from infllmv2.ops import sort_topk_idx
from infllmv2.testing import cu_seqlens, library_identity, realistic_topk, tile_union_blocks, visible_pairs

import infllmv2  # noqa: F401  (registers the custom ops)


class GpuSampler:
    """The SM clock (MHz), board power (W), GPU temperature (C) and the driver's reasons for
    holding the clock below its maximum, sampled every 10 ms from NVML (the driver's
    libnvidia-ml, through ctypes) between start() and stop(). Long sparse backwards run at the
    board's power limit, which lowers the clock below its boost (H100 and H200: a 700 W cap,
    1.5-1.8 GHz against 1.98), so timings depend on it; the reasons say whether it is the power
    cap or heat. NVML averages power over the last second on these GPUs: the figure lags a short
    measurement."""

    # nvmlClocksEventReasons bits (nvml.h)
    REASONS = {"power_cap": 0x4, "hw_slowdown": 0x8 | 0x80, "thermal": 0x20 | 0x40}
    FIELDS = ("sm_mhz", "power_w", "temp_c", "clock_limits")  # what stop() returns

    def __init__(self):
        self.handle = None
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            uuid = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}".encode()
            handle = ctypes.c_void_p()
            if nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetHandleByUUID(uuid, ctypes.byref(handle)) == 0:
                self.nvml, self.handle = nvml, handle
                # the older name is still exported by current drivers; either may be missing
                self.reasons_fn = next((getattr(nvml, n) for n in ("nvmlDeviceGetCurrentClocksEventReasons",
                                        "nvmlDeviceGetCurrentClocksThrottleReasons") if hasattr(nvml, n)), None)
        except (OSError, AttributeError):  # no NVML here: no figures, the timings stand alone
            pass

    def _sample(self):
        mhz, mw, temp, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        while not self.done.wait(0.01):
            if self.nvml.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(mhz)) == 0:  # 1: NVML_CLOCK_SM
                self.mhz.append(mhz.value)
            if self.nvml.nvmlDeviceGetPowerUsage(self.handle, ctypes.byref(mw)) == 0:
                self.watts.append(mw.value / 1000)
            if self.nvml.nvmlDeviceGetTemperature(self.handle, 0, ctypes.byref(temp)) == 0:  # 0: NVML_TEMPERATURE_GPU
                self.temps.append(temp.value)
            if self.reasons_fn is not None and self.reasons_fn(self.handle, ctypes.byref(reasons)) == 0:
                self.reasons.append(reasons.value)

    def start(self):
        self.mhz, self.watts, self.temps, self.reasons, self.done = [], [], [], [], threading.Event()
        if self.handle is not None:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()

    def stop(self):
        """Medians over the samples taken, {"sm_mhz", "power_w", "temp_c"}, and for each reason in
        REASONS the share of samples in which the driver named it ("clock_limits"); None without
        NVML."""
        if self.handle is None:
            return dict.fromkeys(self.FIELDS)
        self.done.set()
        self.thread.join()

        def med(xs):
            return statistics.median(xs) if xs else None

        limits = ({name: sum(1 for r in self.reasons if r & bits) / len(self.reasons)
                   for name, bits in self.REASONS.items()} if self.reasons else None)
        return {"sm_mhz": med(self.mhz), "power_w": med(self.watts), "temp_c": med(self.temps),
                "clock_limits": limits}


def gpu_fields(gpu, prefix):
    """A GpuSampler reading as result fields named prefix + field, None where nothing was sampled
    (no NVML, or the timed calls failed before stop())."""
    return {prefix + f: gpu.get(f) for f in GpuSampler.FIELDS}


def clock_text(r, prefix):
    """The table's "MHz/W/cap" cell for the result fields prefix + ...: median SM clock, median
    board power, and the share of samples in which the driver held the clock for the power cap."""
    mhz, watts, lim = r.get(prefix + "sm_mhz"), r.get(prefix + "power_w"), r.get(prefix + "clock_limits")
    if not (mhz and watts):
        return "n/a"
    return f"{mhz:.0f}/{watts:.0f}/" + (f"{100 * lim['power_cap']:.0f}%" if lim else "n/a")


_SAMPLER = None


def bench(fn, reps, warmup=3, gpu=None):
    """Median ms of `reps` timed calls after `warmup` calls; with a dict `gpu`, also the median
    SM clock and board power over the timed calls (GpuSampler) into it."""
    global _SAMPLER
    # three calls, not one: with one, the first row of a run (32K x 8 selection on an H100) read
    # 11.9 ms at 5 reps where 20 reps read 11.3 (the GPU's clocks still settling)
    for _ in range(warmup):
        fn()
    if gpu is not None:
        _SAMPLER = _SAMPLER or GpuSampler()
        _SAMPLER.start()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    if gpu is not None:
        gpu.update(_SAMPLER.stop())
    return statistics.median(times)


def tile_fill(idx, lengths, groups, arch=None):
    """The share of the forward's and dQ's GEMM rows that the selections ask for: a query tile
    is min(64 // G, T_MAX) tokens x G heads padded to 64 rows, and walks the union of its
    tokens' selected blocks, each for all its rows. 1.0 when a tile's tokens picked the same
    blocks and fill its 64 rows. T_MAX is 16 on sm_90a and 8 on the other archs
    (dsl/sparse_attn.py, T_MAX_BY_ARCH): arch, by default the one the library runs on this GPU."""
    if arch is None:
        arch = selected_arch()
    tokens = min(max(64 // groups, 1), 16 if arch == "sm_90a" else 8)
    selected = tile_union_blocks(idx, lengths, lengths, 1)
    return selected * groups / (64 * tile_union_blocks(idx, lengths, lengths, tokens))


def dense(seqlen, batch, hq, hk, D, backend, reps, gpu=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(batch, hq, seqlen, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, hk, seqlen, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, hk, seqlen, D, device="cuda", dtype=torch.bfloat16)
    # GQA as the dense kernels take it: each KV head repeated for its G query heads
    k = k.repeat_interleave(hq // hk, dim=1).requires_grad_()
    v = v.repeat_interleave(hq // hk, dim=1).requires_grad_()
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    try:
        with sdpa_kernel([be]):
            fwd = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            dout = torch.randn_like(out)
            bwd = bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), reps, gpu=gpu)
    except RuntimeError as e:  # a backend missing on this GPU/torch
        print(f"  dense {backend}: unavailable ({str(e).splitlines()[0][:80]})")
        return None, None
    finally:
        del q, k, v
        torch.cuda.empty_cache()
    return fwd, bwd


def kernel_times(fn):
    """Device ms of each kernel in one call of fn (torch profiler), slowest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = {e.key: e.device_time_total / 1e3 for e in prof.key_averages() if e.device_time_total > 0}
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def sparse(seqlen, batch, hq, hk, D, topk, correlated, reps, kernels=False, gpu=None):
    lengths = [seqlen] * batch
    q = torch.randn(seqlen * batch, hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seqlen * batch, hk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seqlen * batch, hk, D, device="cuda", dtype=torch.bfloat16)
    cu = cu_seqlens(lengths, "cuda")
    idx = sort_topk_idx(realistic_topk(lengths, lengths, hk, topk, correlated=correlated, device="cuda"))
    pairs = visible_pairs(idx, lengths, lengths) * (hq // hk)
    fill = tile_fill(idx, lengths, hq // hk)
    ops = torch.ops.infllmv2

    def fwd_call():
        return ops.sparse_attn_fwd(q, k, v, idx, cu, cu, seqlen, seqlen, 0.0)

    fwd = bench(fwd_call, reps)
    out, lse = fwd_call()
    dout = torch.randn_like(out)

    def bwd_call():
        return ops.sparse_attn_bwd(dout, q, k, v, out, lse, idx, cu, cu, seqlen, seqlen, 0.0)

    bwd = bench(bwd_call, reps, gpu=gpu)
    times = {"fwd": kernel_times(fwd_call), "bwd": kernel_times(bwd_call)} if kernels else None
    return fwd, bwd, pairs, fill, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="bench_sparse_attn.json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="32K x 8 only")
    ap.add_argument("--kernels", action="store_true",
                    help="also each kernel's device time in one forward and one backward call (torch profiler)")
    args = ap.parse_args()
    D, hq, topk = 128, 32, 64
    rows = [(32768, 8, 2, True), (65536, 4, 2, True), (131072, 2, 2, True), (32768, 8, 8, True), (32768, 8, 2, False)]
    if args.quick:
        rows = rows[:1]
    dense_cache = {}
    results = []
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}, bf16, D={D}, Hq={hq}, K={topk}, block 64, causal")
    for seqlen, batch, hk, correlated in rows:
        gpu = {}
        fwd, bwd, pairs, fill, times = sparse(seqlen, batch, hq, hk, D, topk, correlated, args.reps, args.kernels, gpu)
        key = (seqlen, batch)
        if key not in dense_cache:
            # dense cost does not depend on Hk once K/V are expanded; measure once per shape
            # the GPU's clock and power during cuDNN's timed backward, beside the backends' times
            dense_gpu = {}
            dense_cache[key] = ({b: dense(seqlen, batch, hq, hk, D, b, args.reps, dense_gpu if b == "cudnn" else None)
                                 for b in ("cudnn", "flash")}, dense_gpu)
        dn, dn_gpu = dense_cache[key]
        dense_pairs = batch * hq * seqlen * (seqlen + 1) // 2
        f_flops, b_flops = 4 * D * pairs, 2.5 * 4 * D * pairs
        df, db = 4 * D * dense_pairs, 2.5 * 4 * D * dense_pairs
        r = {
            "tokens": f"{seqlen // 1024}K x {batch}", "seqlen": seqlen, "batch": batch, "heads": hq, "heads_k": hk,
            "G": hq // hk, "topk": topk, "selection": "correlated" if correlated else "independent",
            "fwd_ms": fwd, "bwd_ms": bwd, "fwd_tflops": f_flops / fwd / 1e9, "bwd_tflops": b_flops / bwd / 1e9,
            "visible_pairs": pairs, "tile_fill": fill,
            # the GPU during the timed backward calls (GpuSampler): both backwards run at the power cap
            **gpu_fields(gpu, "bwd_"), **gpu_fields(dn_gpu, "cudnn_bwd_"),
        }
        if times:
            r["kernel_ms"] = times
        for b in ("cudnn", "flash"):
            f, bw = dn[b]
            r[f"{b}_fwd_ms"], r[f"{b}_bwd_ms"] = f, bw
            r[f"{b}_fwd_tflops"] = df / f / 1e9 if f else None
            r[f"{b}_bwd_tflops"] = db / bw / 1e9 if bw else None
        if dn["cudnn"][0]:
            r["speedup_vs_cudnn_fwd_bwd"] = (dn["cudnn"][0] + dn["cudnn"][1]) / (fwd + bwd)
        results.append(r)
        torch.cuda.empty_cache()

    hdr = (f"{'tokens':<10}{'G':>3} {'selection':<12}{'fwd ms':>8}{'TF/s':>6}{'bwd ms':>8}{'TF/s':>6}"
           f"{'cuDNN f/b ms':>16}{'TF/s':>10}{'flash f/b ms':>16}{'x cuDNN':>9}{'tile fill':>10}"
           f"{'bwd MHz/W/cap':>15}{'cuDNN bwd':>15}{'bwd C':>7}")
    print(hdr)

    for r in results:
        cd = f"{r['cudnn_fwd_ms']:.1f}/{r['cudnn_bwd_ms']:.1f}" if r["cudnn_fwd_ms"] else "n/a"
        cdt = f"{r['cudnn_fwd_tflops']:.0f}/{r['cudnn_bwd_tflops']:.0f}" if r["cudnn_fwd_ms"] else ""
        fl = f"{r['flash_fwd_ms']:.1f}/{r['flash_bwd_ms']:.1f}" if r["flash_fwd_ms"] else "n/a"
        sp = f"{r.get('speedup_vs_cudnn_fwd_bwd', 0):.2f}x"
        ck = clock_text(r, "bwd_"), clock_text(r, "cudnn_bwd_")
        temp = f"{r['bwd_temp_c']:.0f}" if r["bwd_temp_c"] else "n/a"
        print(f"{r['tokens']:<10}{r['G']:>3} {r['selection']:<12}{r['fwd_ms']:>8.1f}{r['fwd_tflops']:>6.0f}"
              f"{r['bwd_ms']:>8.1f}{r['bwd_tflops']:>6.0f}{cd:>16}{cdt:>10}{fl:>16}{sp:>9}{r['tile_fill']:>10.2f}"
              f"{ck[0]:>15}{ck[1]:>15}{temp:>7}")
    for r in results:
        for call, times in r.get("kernel_ms", {}).items():
            listed = ", ".join(f"{name.removeprefix('infllmv2_')} {ms:.2f}" for name, ms in times.items())
            print(f"{r['tokens']} G={r['G']} {r['selection']} {call} kernels (ms, one call): {listed}")
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "library": library_identity(), "results": results}, f,
                  indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
