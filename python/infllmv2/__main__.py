"""python -m infllmv2 {check,info}

check: prints the build info and the device, then runs every op on the GPU if there is one
(with every arch variant this GPU can run) and otherwise on the CPU reference path, and
checks each result against the fp32 reference by the library's error rule. Exits 1 on any
mismatch.
info: prints the build info as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import infllmv2
from infllmv2 import reference
from infllmv2.testing import (
    GRAD_FLOOR,
    cu_seqlens,
    kv_cache_of,
    random_mask,
    random_tokens,
    realistic_topk,
    scores_mismatch,
    selection_mismatch,
    within_error_rule,
)


def _cached_compression(k, lengths, geometry, layout="paged64"):
    """compress_keys_kvcache of k stored in a KV cache, from an empty compressed cache: the
    entries packed as compress_keys returns them."""
    kc, _, table = kv_cache_of(k, k, lengths, layout)
    cap = kc.shape[1] * (1 if table is None else table.shape[1])
    cache = torch.zeros((len(lengths), infllmv2.compressed_capacity(cap, *geometry), *k.shape[1:]), dtype=k.dtype,
                        device=k.device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=k.device)
    infllmv2.compress_keys_kvcache(kc, lens, cache, max(lengths), table, *geometry)
    n = [reference._num_windows(x, *geometry) for x in lengths]
    return torch.cat([cache[b, :m] for b, m in enumerate(n)]), cache, kc, table, lens


def _check_compress_keys(device, dtype, head_dim, phsa, geometry, cached=False):
    """compress_keys, or (cached) compress_keys_kvcache over a paged cache."""
    lengths = [1, 63, 64, 65, 257, 1000]
    k = random_tokens(lengths, 2, head_dim, dtype, device, seed=head_dim + phsa)
    cu = cu_seqlens(lengths, device)
    mask = random_mask(k.shape[0], 0.05, device) if phsa else None
    if cached:
        out = _cached_compression(k, lengths, geometry)[0]
    else:
        out, _ = infllmv2.compress_keys(k, cu, *geometry, punct_mask=mask, phsa_lambda=0.25)
    lowp, _ = reference.compress_keys(k.cpu(), cu.cpu(), *geometry, punct_mask=None if mask is None else mask.cpu(), phsa_lambda=0.25)
    ref32, _ = reference.compress_keys(k.cpu().float(), cu.cpu(), *geometry, punct_mask=None if mask is None else mask.cpu(), phsa_lambda=0.25)
    return within_error_rule(out.cpu(), lowp, ref32)


def _check_kvcache_step(device, dtype, head_dim):
    """attention_kvcache from empty compressed caches of a paged cache (both levels updated in one
    launch), dense path: its caches against compress_keys' reference."""
    lengths = [1, 63, 64, 65, 257, 1000]
    k = random_tokens(lengths, 2, head_dim, dtype, device, seed=head_dim + 7)
    kc, vc, table = kv_cache_of(k, k, lengths, "paged64")
    cap = kc.shape[1] * table.shape[1]
    caches = [torch.zeros((len(lengths), infllmv2.compressed_capacity(cap, *g), 2, head_dim), dtype=dtype,
                          device=device) for g in ((32, 16), (128, 64))]
    q = random_tokens([1] * len(lengths), 32, head_dim, dtype, device, seed=head_dim + 8)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with torch.no_grad():
        infllmv2.attention_kvcache(q, kc, vc, lens, cu_seqlens([1] * len(lengths), device), *caches, max(lengths),
                                   table, max_seqlen_q=1, max_seqlen_k=max(lengths))
    ok_all, worst = True, (0.0, 0.0)
    cu = cu_seqlens(lengths)
    for cache, g in zip(caches, ((32, 16), (128, 64))):
        got = torch.cat([cache[b, :reference._num_windows(n, *g)] for b, n in enumerate(lengths)]).cpu()
        lowp = reference.compress_keys(k.cpu(), cu, *g)[0]
        ref32 = reference.compress_keys(k.cpu().float(), cu, *g)[0]
        ok, err, base = within_error_rule(got, lowp, ref32)
        ok_all &= ok
        worst = max(worst, (err, base))
    return ok_all, worst[0], worst[1]


def _check_attention(device, dtype, head_dim, G, op):
    """sparse_attn_varlen (op "sparse") or dense_attn_varlen (op "dense"), forward and backward;
    sparse_decode (op "decode", split 5 ways) and sparse_decode_kvcache over a paged cache (op
    "kvcache", the same), forward."""
    lengths_q, lengths_k = [1, 63, 64, 65, 300, 17], [1, 63, 64, 65, 300, 700]
    hk = 2
    q = random_tokens(lengths_q, G * hk, head_dim, dtype, device, seed=G)
    k = random_tokens(lengths_k, hk, head_dim, dtype, device, seed=G + 1)
    v = random_tokens(lengths_k, hk, head_dim, dtype, device, seed=G + 2)
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    idx = realistic_topk(lengths_q, lengths_k, hk, 6, local_blocks=2, correlated=False, device=device)
    dout = torch.randn_like(q)
    ok_all, worst = True, (0.0, 0.0)
    runs = []
    for qq, kk, vv, do in ((q, k, v, dout), (q.cpu(), k.cpu(), v.cpu(), dout.cpu()),
                           (q.cpu().float(), k.cpu().float(), v.cpu().float(), dout.cpu().float())):
        c_q, c_k, ix = cu_q.to(qq.device), cu_k.to(qq.device), idx.to(qq.device)
        if op == "decode":
            runs.append([infllmv2.sparse_decode(qq, kk, vv, c_q, c_k, ix, num_splits=5).cpu()])
            continue
        if op == "kvcache":
            kc, vc, table = kv_cache_of(kk, vv, lengths_k, "paged64")
            lens = torch.tensor(lengths_k, dtype=torch.int32, device=qq.device)
            runs.append([infllmv2.sparse_decode_kvcache(qq, kc, vc, lens, c_q, ix, table, num_splits=5).cpu()])
            continue
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (qq, kk, vv))
        if op == "sparse":
            out = infllmv2.sparse_attn_varlen(qq, kk, vv, c_q, c_k, ix)
        else:
            out = infllmv2.dense_attn_varlen(qq, kk, vv, c_q, c_k)
        runs.append([out.detach().cpu(), *(g.cpu() for g in torch.autograd.grad(out, (qq, kk, vv), do))])
    for i, (got, lowp, ref32) in enumerate(zip(*runs)):
        ok, err, base = within_error_rule(got, lowp, ref32, floor=GRAD_FLOOR if i else None)
        ok_all &= ok
        if err > worst[0]:
            worst = (err, base)
    return ok_all, worst[0], worst[1]


def _check_select_blocks(device, dtype, head_dim, G, op):
    """Scores (fp32 tolerance) and selections (tie-aware) against the fp32 reference on the CPU: of
    select_blocks (op "select"), select_decode split 3 ways (op "decode"), or select_decode_kvcache
    split 3 ways over compressed caches of a paged cache (op "kvcache")."""
    lengths_q, lengths_k = [1, 31, 64, 65, 700, 1, 900], [1, 31, 64, 65, 700, 2000, 1500]
    q = random_tokens(lengths_q, 2 * G, head_dim, dtype, device, seed=G)
    k = random_tokens(lengths_k, 2, head_dim, dtype, device, seed=G + 1)
    if device == "cpu":  # the CPU path is the reference, which computes in the input dtype
        q, k = q.float(), k.float()
    cu_q, cu_k = cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)
    ck, cu_c = infllmv2.compress_keys(k, cu_k, 32, 16)
    nk, cu_n = infllmv2.compress_keys(k, cu_k, 128, 64)
    S = infllmv2.group_scores(q, ck, cu_q, cu_k, cu_c, norm_keys=nk, cu_seqlens_norm=cu_n)
    if op == "decode":
        idx = infllmv2.select_decode(q, k, cu_q, cu_k, topk=12, local_blocks=4, num_splits=3)
    elif op == "kvcache":
        _, c1, kc, table, lens = _cached_compression(k, lengths_k, (32, 16))
        c2 = _cached_compression(k, lengths_k, (128, 64))[1]
        idx = infllmv2.select_decode_kvcache(q, c1, c2, lens, cu_q, kc.shape[1] * table.shape[1], topk=12,
                                             local_blocks=4, num_splits=3)
    else:
        idx = infllmv2.select_blocks(q, k, cu_q, cu_k, topk=12, local_blocks=4)
    cpu = [t.cpu() for t in (cu_q, cu_k, cu_c, cu_n)]
    want = reference.group_scores(q.cpu().float(), ck.cpu().float(), cpu[0], cpu[1], cpu[2], norm_keys=nk.cpu().float(),
                                  cu_seqlens_norm=cpu[3])
    blocks = reference.max_pool_blocks(want, cpu[0], cpu[1], cpu[2], local_blocks=4)
    why = scores_mismatch(S.cpu(), want) or selection_mismatch(idx.cpu(), blocks, 12)
    if why:
        print(f"  {'select_decode' if op == 'decode' else 'select_blocks'}: {why}")
    return why is None, (S.cpu() - want).abs().max().item(), 0.0


def check() -> int:
    print(f"infllmv2 {infllmv2.__version__}")
    if infllmv2.library_available():
        info = infllmv2.build_info()
        print(f"library: {infllmv2.library_path()}")
        print(f"  abi {info['abi_version']}, cuda runtime {info['cuda_runtime']}, tilelang {info['tilelang']}, "
              f"archs {', '.join(info['archs'])}, {len(info['kernels'])} kernel units")
    else:
        print(f"library: not available ({infllmv2.library_path()})")
    gpu = torch.cuda.is_available() and infllmv2.library_available()
    if gpu:
        major, minor = torch.cuda.get_device_capability()
        print(f"device: {torch.cuda.get_device_name()} (sm_{major}{minor}), kernels: {infllmv2.selected_arch()}")
        archs = [a for a in infllmv2.build_info()["archs"] if not (a.endswith("a") and a[3:-1] != f"{major}{minor}")
                 and int(a[3:5]) <= 10 * major + minor]
    else:
        print("device: no CUDA GPU: running the CPU reference path")
        archs = [None]
    failures = 0
    print(f"{'op':<16}{'arch':<8}{'dtype':<10}{'D':>4}  {'variant':<14}{'max err':>10}{'torch err':>11}  result")
    for arch in archs:
        if arch is not None:
            infllmv2.set_arch_override(arch)
        try:
            for dtype in (torch.bfloat16, torch.float16):
                for head_dim in (64, 128):
                    for phsa in (0, 1):
                        for geometry in ((32, 16), (128, 64)):
                            ok, err, base = _check_compress_keys("cuda" if gpu else "cpu", dtype, head_dim, phsa, geometry)
                            failures += not ok
                            variant = f"{'phsa ' if phsa else ''}{geometry[0]}/{geometry[1]}"
                            print(f"{'compress_keys':<16}{arch or 'cpu':<8}{str(dtype)[6:]:<10}{head_dim:>4}  {variant:<14}"
                                  f"{err:>10.2e}{base:>11.2e}  {'ok' if ok else 'FAIL'}")
                    for geometry in ((32, 16), (128, 64)):
                        ok, err, base = _check_compress_keys("cuda" if gpu else "cpu", dtype, head_dim, 0, geometry,
                                                             cached=True)
                        failures += not ok
                        print(f"{'compress_keys':<16}{arch or 'cpu':<8}{str(dtype)[6:]:<10}{head_dim:>4}  "
                              f"{f'paged {geometry[0]}/{geometry[1]}':<14}{err:>10.2e}{base:>11.2e}  "
                              f"{'ok' if ok else 'FAIL'}")
                    ok, err, base = _check_kvcache_step("cuda" if gpu else "cpu", dtype, head_dim)
                    failures += not ok
                    print(f"{'compress_keys':<16}{arch or 'cpu':<8}{str(dtype)[6:]:<10}{head_dim:>4}  {'step, 2 levels':<14}"
                          f"{err:>10.2e}{base:>11.2e}  {'ok' if ok else 'FAIL'}")
                    for op in ("sparse", "dense", "decode", "kvcache"):
                        for G in (1, 4, 16):
                            ok, err, base = _check_attention("cuda" if gpu else "cpu", dtype, head_dim, G, op)
                            failures += not ok
                            # the kvcache entry point is sparse_decode's kernel over a paged cache
                            name, what = {"decode": ("sparse_decode", "fwd"), "kvcache": ("sparse_decode", "paged")}.get(
                                op, (op + "_attn", "fwd+bwd"))
                            print(f"{name:<16}{arch or 'cpu':<8}{str(dtype)[6:]:<10}{head_dim:>4}  "
                                  f"{f'G={G} {what}':<14}{err:>10.2e}{base:>11.2e}  {'ok' if ok else 'FAIL'}")
                    for op in ("select", "decode", "kvcache"):
                        for G in (1, 4, 16):
                            # fp32 computations on both sides: no PyTorch low-precision error to compare with
                            ok, err, _ = _check_select_blocks("cuda" if gpu else "cpu", dtype, head_dim, G, op)
                            failures += not ok
                            name = "select_blocks" if op == "select" else "select_decode"
                            print(f"{name:<16}{arch or 'cpu':<8}{str(dtype)[6:]:<10}{head_dim:>4}  "
                                  f"{f'G={G}' + (' paged' if op == 'kvcache' else ''):<14}{err:>10.2e}{'-':>11}  "
                                  f"{'ok' if ok else 'FAIL'}")
        finally:
            if arch is not None:
                infllmv2.set_arch_override(None)
    print("all checks passed" if failures == 0 else f"{failures} checks FAILED")
    return 1 if failures else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infllmv2")
    ap.add_argument("command", choices=["check", "info"])
    args = ap.parse_args(argv)
    if args.command == "info":
        print(json.dumps(infllmv2.build_info(), indent=1))
        return 0
    return check()


if __name__ == "__main__":
    sys.exit(main())
