"""Hugging Face decoding: one generated token's step of a small Llama model (random weights) with
attn_implementation="infllmv2", its keys in a DynamicCache (every step compresses all the cached
keys again) or in infllmv2.hf.InfLLMv2Cache (a step compresses only its new key), against
attn_implementation="sdpa" (dense attention over the whole cache) in the same run.

    python benchmarks/bench_hf_generate.py --json out.json

Configuration: bf16, 2 decoder layers of MiniCPM4's attention shape (Hq = 32, Hk = 2, D = 128,
hidden 4096, MLP 1024, vocabulary 1024), MiniCPM4.1's sparse_config defaults (K = 96, dense
below 8192 keys), prompts of 32K and 128K tokens at batch 1, and a left-padded batch of four
prompts of 32K, 28K, 24K and 20K tokens (generate()'s padded batches; SDPA not run there: its
prompt would build a 4 GiB mask). A prompt is one forward into an empty cache (after a short
warm-up prompt); then `--steps` steps of one token each, synchronised after
each. "step ms" is the median wall time of a step (Python and transformers included, as a user
sees it: in this two-layer model the host's work); "GPU ms" is the kernels' time of a step (the
torch profiler over the steps, divided by their count), the part the attention implementation
decides, which grows with the layers and the batch. The ", PHSA" rows run InfLLMv2Cache with
`infllmv2.hf.punctuation_hook`, a fifth of the vocabulary (ids 1-204) counted as punctuation: each
forward's flags are recorded beside its keys and both compressed caches are PHSA's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import infllmv2
import infllmv2.hf
from infllmv2.testing import hf_cache_kwargs, library_identity

# (padded length, left padding of each row)
CASES = [(32768, (0,)), (131072, (0,)), (32768, (0, 4096, 8192, 12288))]
PUNCT_IDS = 204  # the PHSA rows' punctuation: token ids 1 .. 204 of the 1024


def model_of(impl):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=4096, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=32, num_key_value_heads=2, head_dim=128,
                                   max_position_embeddings=262144)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    model.set_attn_implementation(impl)
    return model


def run_case(model, cache, tokens, pads, steps):
    batch = len(pads)
    ids = torch.randint(1, 1024, (batch, tokens), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = None
    if any(pads):
        mask = (torch.arange(tokens, device="cuda") >= torch.tensor(pads, device="cuda")[:, None]).long()
        ids = ids * mask

    def forward(x, c, m):
        return model(x, attention_mask=m, **hf_cache_kwargs(c)).logits[:, -1:].argmax(-1)

    def grown(m):  # generate()'s mask for one more token
        return None if m is None else torch.cat([m, m.new_ones(batch, 1)], 1)

    with torch.no_grad():
        # a short prompt and a step into a cache of the same kind first: one-time costs (library
        # load, kernel modules, the allocator) stay out of the timed prompt
        warm = type(cache)()
        m = None if mask is None else mask[:, -1024:]
        forward(forward(ids[:, -1024:], warm, m), warm, grown(m))
        del warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        nxt = forward(ids, cache, mask)
        torch.cuda.synchronize()
        prompt_ms = (time.perf_counter() - t0) * 1e3
        for _ in range(3):  # warm-up steps
            mask = grown(mask)
            nxt = forward(nxt, cache, mask)
        walls = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                mask = grown(mask)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                nxt = forward(nxt, cache, mask)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
    gpu_us = sum(e.device_time_total for e in prof.key_averages())  # CUDA activity only: the kernels and copies
    return prompt_ms, statistics.median(walls), gpu_us / 1e3 / steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers

    infllmv2.hf.register()  # SparseConfig(): MiniCPM4.1's defaults
    rows = []
    print(f"{'tokens':>10} {'implementation':>28} {'prompt ms':>10} {'step ms':>8} {'GPU ms':>7}")
    for tokens, pads in CASES:
        batch = len(pads)
        impls = (("infllmv2", "DynamicCache", False), ("infllmv2", "InfLLMv2Cache", False),
                 ("infllmv2", "InfLLMv2Cache", True))
        for impl, cache_name, phsa in impls + ((("sdpa", "DynamicCache", False),) if not any(pads) else ()):
            model = model_of(impl)
            if phsa:  # a fifth of the vocabulary taken for punctuation
                infllmv2.hf.punctuation_hook(model, range(1, PUNCT_IDS + 1))
            cache = infllmv2.hf.InfLLMv2Cache() if cache_name == "InfLLMv2Cache" else transformers.DynamicCache()
            prompt_ms, step_ms, gpu_ms = run_case(model, cache, tokens, pads, args.steps)
            name = f"{impl} + {cache_name}{', PHSA' if phsa else ''}"
            print(f"{tokens // 1024:>8}K x{batch} {name:>28} {prompt_ms:10.1f} {step_ms:8.2f} {gpu_ms:7.3f}", flush=True)
            rows.append({"tokens": tokens, "batch": batch, "left_padding": list(pads), "attn_implementation": impl,
                         "cache": cache_name, "phsa": phsa, "prompt_ms": prompt_ms, "step_ms": step_ms,
                         "step_gpu_ms": gpu_ms})
            del model, cache
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "transformers": transformers.__version__, "library": library_identity(), "steps": args.steps,
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
