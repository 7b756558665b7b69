"""One training step of a tiny MiniCPM4-shaped decoder through ``infllmv2.attention``.

The model (embedding, decoder layers with RMSNorm, GQA attention with per-sequence rotary
embedding in the packed varlen layout, SwiGLU MLP, final norm, LM head, cross-entropy) takes
its attention as a function, so the same weights run through the library and through a
reference. Two tiers:

* CPU (CI): on CPU ``infllmv2.attention`` runs the reference internally, so comparing it with
  ``reference.attention`` would compare a function with itself. Instead the library path is
  checked, in fp64, against an independent masked-softmax attention written here (its own
  GQA head mapping, causal mask and block mask, the selection taken from
  ``reference.select_blocks``): that catches wiring errors in the layer stack the kernels plug
  into (offsets, head mapping, layout, the dense/sparse switch, gradients into q, k and v).
* GPU: Hq = 32, Hk = 2, D = 128 at 16K tokens in bf16; the loss and every parameter gradient of
  the library step are judged against the same step in fp32 through the reference, by the
  project's rule (the library's error at most 2x that of the same bf16 step through the
  reference), once with every run selecting its own blocks and once with the references
  replaying the library's selection.
"""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import infllmv2
from infllmv2 import SparseConfig, reference
from infllmv2.testing import (assert_norm_close_to_reference, cu_seqlens, norm_error_ratio, selection_mismatch,
                              within_error_rule)

# ------------------------------------------------------------------------------------ the model


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalised in fp32 whatever the model's dtype, as MiniCPM (and every HF Llama) does
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary(x, positions, theta):
    """Rotary embedding (HF's rotate-half convention) of x (T, H, D) at per-token positions (T,)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    ang = (positions.double()[:, None] * inv_freq[None, :]).float()
    cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None, :]
    sin = torch.cat((ang.sin(), ang.sin()), -1)[:, None, :]
    x32 = x.float()
    rot = torch.cat((-x32[..., d // 2:], x32[..., : d // 2]), -1)
    return (x32 * cos + rot * sin).to(x.dtype)


class DecoderLayer(torch.nn.Module):
    def __init__(self, hidden, heads_q, heads_k, head_dim, intermediate):
        super().__init__()
        self.heads_q, self.heads_k, self.head_dim = heads_q, heads_k, head_dim
        self.input_norm = RMSNorm(hidden)
        self.q_proj = torch.nn.Linear(hidden, heads_q * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, heads_k * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, heads_k * head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads_q * head_dim, hidden, bias=False)
        self.post_norm = RMSNorm(hidden)
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, h, positions, cu, max_len, attn, theta):
        t = h.shape[0]
        x = self.input_norm(h)
        q = rotary(self.q_proj(x).view(t, self.heads_q, self.head_dim), positions, theta)
        k = rotary(self.k_proj(x).view(t, self.heads_k, self.head_dim), positions, theta)
        v = self.v_proj(x).view(t, self.heads_k, self.head_dim)
        h = h + self.o_proj(attn(q, k, v, cu, max_len).reshape(t, self.heads_q * self.head_dim))
        x = self.post_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TinyDecoder(torch.nn.Module):
    """A MiniCPM4-like decoder-only LM on packed sequences; ``attn(q, k, v, cu, max_len)`` is pluggable."""

    def __init__(self, vocab, hidden, layers, heads_q, heads_k, head_dim, intermediate, theta=10000.0, seed=0):
        super().__init__()
        self.theta = theta
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(
            DecoderLayer(hidden, heads_q, heads_k, head_dim, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    # not all ones, so that a gradient routed to the wrong norm shows
                    p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
                    continue
                # unit-variance activations everywhere: q and k of std ~1, attention logits of std ~1
                std = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(p.shape[1])
                p.copy_(std * torch.randn(p.shape, generator=g))

    def forward(self, ids, labels, cu, max_len, attn):
        # positions restart at 0 in every sequence of the pack (rotary embedding per sequence)
        lengths = (cu[1:] - cu[:-1]).long()
        starts = torch.repeat_interleave(cu[:-1].long(), lengths)
        positions = torch.arange(ids.shape[0], device=ids.device) - starts
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h, positions, cu, max_len, attn, self.theta)
        logits = self.lm_head(self.norm(h)).float()
        return F.cross_entropy(logits, labels, ignore_index=-100)


def packed_batch(lengths, vocab, device, seed=0):
    """Token ids, next-token labels (-100 at each sequence's last token: nothing to predict
    across a sequence boundary) and int32 offsets for sequences of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(lengths),), generator=g)
    labels = torch.full_like(ids, -100)
    off = 0
    for n in lengths:
        labels[off: off + n - 1] = ids[off + 1: off + n]
        off += n
    return ids.to(device), labels.to(device), cu_seqlens(lengths, device)


def training_step(model, ids, labels, cu, max_len, attn):
    """Forward, loss, backward; returns (loss, {name: grad}) detached, in the model's dtype."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels, cu, max_len, attn)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reaches {missing}"
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def reference_kwargs(cfg):
    """``reference.attention``'s keywords for a SparseConfig (K = topk + the local window)."""
    return dict(dense_len=cfg.dense_len, topk=cfg.num_selected, kernel_size=cfg.kernel_size,
                kernel_stride=cfg.kernel_stride, block_size=cfg.block_size, init_blocks=cfg.init_blocks,
                local_blocks=cfg.local_blocks, approx_lse=cfg.approx_lse, norm_kernel_size=cfg.norm_kernel_size,
                norm_kernel_stride=cfg.norm_kernel_stride)


def select_kwargs(cfg):
    kw = reference_kwargs(cfg)
    del kw["dense_len"]
    return kw


def library_attention(cfg):
    def attn(q, k, v, cu, max_len):
        return infllmv2.attention(q, k, v, cu, cu, max_len, max_len, config=cfg)
    return attn


def reference_attention(cfg):
    def attn(q, k, v, cu, max_len):
        return reference.attention(q, k, v, cu, cu, **reference_kwargs(cfg))[0]
    return attn


# ------------------------------------------------------------------------------------ CPU tier


def naive_attention(cfg, sparse):
    """Causal GQA attention by plain masked softmax, one sequence at a time, written apart from
    the reference's code: heads mapped by ``repeat_interleave`` (query head h reads KV head
    h // G), the block mask built from ``reference.select_blocks`` token by token."""

    def attn(q, k, v, cu, max_len):
        hq, hk, d = q.shape[1], k.shape[1], q.shape[2]
        g = hq // hk
        idx = reference.select_blocks(q, k, cu, cu, **select_kwargs(cfg)) if sparse else None
        offs = cu.tolist()
        outs = []
        for b in range(len(offs) - 1):
            s, e = offs[b], offs[b + 1]
            n = e - s
            if n == 0:
                continue
            qs = q[s:e].transpose(0, 1)                                  # (Hq, n, D)
            ks = k[s:e].repeat_interleave(g, dim=1).transpose(0, 1)      # (Hq, n, D)
            vs = v[s:e].repeat_interleave(g, dim=1).transpose(0, 1)
            pos = torch.arange(n)
            allowed = (pos[None, :] <= pos[:, None]).expand(hq, n, n)    # key <= query
            if sparse:
                sel = idx[:, s:e].long()                                 # (Hk, n, K), -1 = unused
                nb = -(-n // cfg.block_size)
                chosen = torch.zeros(hk, n, nb, dtype=torch.bool)
                for j in range(sel.shape[-1]):
                    col = sel[..., j]
                    hit = col >= 0
                    chosen |= hit[..., None] & (torch.arange(nb)[None, None, :] == col[..., None])
                blockmask = chosen[:, :, pos // cfg.block_size].repeat_interleave(g, dim=0)
                allowed = allowed & blockmask
            logits = (qs @ ks.transpose(1, 2)) / math.sqrt(d)
            probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
            outs.append((probs @ vs).transpose(0, 1))
        return torch.cat(outs, 0)

    return attn


CPU_LENGTHS = [700, 1, 300, 65]

# 64-token blocks, compression 32/16 (coarse 128/64) and a few selected blocks, so that the
# 700-token sequence (11 blocks) and the 300-token one (5 blocks) both drop blocks. The switch
# compares dense_len with the longest sequence (700), so the "dense" and "sparse-alt" cases sit
# on either side of it.
CPU_CASES = {
    "sparse": (SparseConfig(window_size=128, topk=2, dense_len=512), True),
    # other values in each field the selection takes from the config: no forced blocks but the
    # query's own, and the exact fine-key normaliser (which picks differently here for some rows)
    "sparse-alt": (SparseConfig(window_size=0, topk=4, init_blocks=0, approx_lse=False, dense_len=700), True),
    "dense": (SparseConfig(window_size=128, topk=2, dense_len=701), False),
}


@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("case", list(CPU_CASES))
def test_cpu_training_step_matches_independent_attention(G, case):
    cfg, sparse = CPU_CASES[case]
    hk, d = 2, 64
    model = TinyDecoder(vocab=256, hidden=128, layers=2, heads_q=hk * G, heads_k=hk, head_dim=d, intermediate=256,
                        seed=G).double()
    ids, labels, cu = packed_batch(CPU_LENGTHS, 256, "cpu", seed=1)
    max_len = max(CPU_LENGTHS)

    loss, grads = training_step(model, ids, labels, cu, max_len, library_attention(cfg))
    want_loss, want = training_step(model, ids, labels, cu, max_len, naive_attention(cfg, sparse))
    _, other = training_step(model, ids, labels, cu, max_len, naive_attention(cfg, not sparse))

    # fp64 on both sides: only summation order differs (~1e-16 relative)
    assert torch.allclose(loss, want_loss, rtol=1e-10, atol=0), (loss.item(), want_loss.item())
    for name, g in grads.items():
        assert torch.isfinite(g).all(), name
        w = want[name]
        assert w.abs().max() > 0, f"{name}: no gradient reaches it"
        excess = ((g - w).abs() - (1e-8 * w.abs() + 1e-9 * w.abs().max())).max().item()
        assert excess <= 0, f"{name}: differs from the independent step by {excess:.3g} beyond fp64 tolerance"
    # the check has teeth: the other side of the dense/sparse switch gives a clearly different
    # step here, so a library that took the wrong path (or ignored the selection) would fail above
    far = [n for n in want if torch.linalg.vector_norm(other[n] - want[n]) > 1e-3 * torch.linalg.vector_norm(want[n])]
    assert any(n.endswith("k_proj.weight") for n in far) and any(n.endswith("v_proj.weight") for n in far), far


# ------------------------------------------------------------------------------------ GPU tier

# The deliverable's shape: MiniCPM4's attention (Hq 32, Hk 2, D 128) in a few small layers.
GPU_DIMS = dict(vocab=4096, hidden=1024, layers=2, heads_q=32, heads_k=2, head_dim=128, intermediate=2816)

GPU_CASES = {
    # MiniCPM4.1's sparse_config: K = 64 + 32 local blocks = 6144 tokens, so the 12288-token
    # sequence's second half really drops blocks; the others go through stages 0-2 too (the
    # switch is per call, on the longest sequence) but keep every block
    "minicpm4.1": (SparseConfig(), [12288, 2048, 1536, 512]),
    # a narrow window (8 local + 16 scored blocks = 1536 tokens) so that every sequence but the
    # last drops blocks
    "narrow": (SparseConfig(window_size=512, topk=16, dense_len=4096), [8192, 4096, 3072, 1024]),
}

# Relative (Frobenius) errors of a bf16 step are ~1e-2 per tensor; below a tenth of bf16's
# rounding unit (2^-7) a result agrees with fp32 as well as bf16 storage allows, whatever the
# bf16 reference happened to do (the loss, a scalar, can be accurate by chance)
NORM_FLOOR = 0.1 * torch.finfo(torch.bfloat16).eps


class RecordingLibraryAttention:
    """``infllmv2.attention`` that also keeps each layer's selection and the q, k it was made from."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.calls = []

    def __call__(self, q, k, v, cu, max_len):
        cfg = self.cfg
        out = infllmv2.attention(q, k, v, cu, cu, max_len, max_len, config=cfg)
        assert max_len >= cfg.dense_len, "the GPU cases are meant to take the sparse path"
        # attention() selects through select_decode (select_blocks itself where the tiles fill the GPU)
        idx = infllmv2.select_decode(q.detach(), k.detach(), cu, cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
                                     **select_kwargs(cfg))
        with torch.no_grad():
            # the recorded selection is the one attention() used: stage 2 over it is its output, bit for bit
            again = infllmv2.sparse_attn_varlen(q, k, v, cu, cu, idx, max_len, max_len, block_size=cfg.block_size)
        assert torch.equal(again, out.detach()), "attention() did not use select_decode's selection"
        self.calls.append((q.detach(), k.detach(), idx))
        return out


class ReplayedReferenceAttention:
    """The reference's stage 2 over the selections a library run recorded, layer by layer."""

    def __init__(self, cfg, calls):
        self.cfg, self.calls, self.layer = cfg, calls, 0

    def __call__(self, q, k, v, cu, max_len):
        idx = self.calls[self.layer][2]
        self.layer += 1
        return reference.sparse_attn_varlen(q, k, v, cu, cu, idx, block_size=self.cfg.block_size)[0]


def block_scores(q, k, cu, cfg):
    """fp32 block scores (Hk, total_q, nb) to judge a selection by: the keys compressed by the
    library (as the selection kernel sees them), then the reference's scores and pooling in fp32
    on q's device (``testing.oracle_block_scores`` without the trip to the CPU, which takes
    ~20 s per layer at 16K tokens there)."""
    ck, cu_c = infllmv2.compress_keys(k, cu, cfg.kernel_size, cfg.kernel_stride)
    nk = cu_n = None
    if cfg.approx_lse:
        nk, cu_n = infllmv2.compress_keys(k, cu, cfg.norm_kernel_size, cfg.norm_kernel_stride)
        nk = nk.float()
    S = reference.group_scores(q.float(), ck.float(), cu, cu, cu_c, cfg.kernel_size, cfg.kernel_stride, None, nk, cu_n,
                               cfg.norm_kernel_size, cfg.norm_kernel_stride)
    return reference.max_pool_blocks(S, cu, cu, cu_c, cfg.kernel_size, cfg.kernel_stride, cfg.block_size,
                                     cfg.init_blocks, cfg.local_blocks)


def judge_step(what, lib, lowp, ref32, factor=2.0):
    """The 2x rule on the loss and on every parameter gradient; returns {name: (err, lowp_err)}.

    Gradients are judged by their relative Frobenius error per tensor, not by the worst element:
    top-k selection is a discontinuous function of q and k, and where two blocks score within
    rounding of each other the library, the bf16 reference and the fp32 reference may each keep
    a different one. A flipped pick moves a few rows of the attention output by far more than
    rounding does, and through the backward every weight gradient of the layers below, so the
    worst element would measure which run hit a tie, not the kernels' accuracy; the norm over
    16K tokens measures the whole step's precision, flips included (the bf16 reference, which
    scores in bf16, flips more picks than the kernels, which score in fp32). With the selection
    replayed nothing flips, but the worst element of a whole model's bf16 gradient is still a
    noisy statistic (in a CPU dry run with emulated kernels its ratio to the bf16 reference's
    ranged 0.8-1.6 across tensors where the norm's stayed within 0.9-1.1), so the norm is kept.
    """
    (loss, grads), (loss_lp, grads_lp), (loss32, grads32) = lib, lowp, ref32
    assert torch.isfinite(loss), f"{what}: loss {loss.item()}"
    ok, err, base = within_error_rule(loss.float().cpu().reshape(1), loss_lp.float().cpu().reshape(1),
                                      loss32.float().cpu().reshape(1), factor, floor=NORM_FLOOR * abs(loss32.item()))
    assert ok, f"{what} loss {loss.item():.6f}: error {err:.3g} > {factor} x bf16 reference error {base:.3g} (+ floor)"
    stats = {"loss": (err, base)}
    for name, g in grads.items():
        assert torch.isfinite(g).all(), f"{what} {name}: non-finite gradient"
        assert_norm_close_to_reference(g, grads_lp[name], grads32[name], factor, what=f"{what} grad {name}",
                                       floor=NORM_FLOOR)
        stats[name] = norm_error_ratio(g, grads_lp[name], grads32[name])
    return stats


def check_training_step(cfg, lengths, dims, device, dtype=torch.bfloat16, verbose=True):
    """One step through the library in ``dtype``, judged against fp32 reference steps (see the test)."""
    model = TinyDecoder(**dims, seed=0).to(device, dtype)
    model32 = copy.deepcopy(model).float()  # the same (dtype-representable) weights in fp32
    ids, labels, cu = packed_batch(lengths, dims["vocab"], device, seed=1)
    max_len = max(lengths)

    rec = RecordingLibraryAttention(cfg)
    lib = training_step(model, ids, labels, cu, max_len, rec)
    assert len(rec.calls) == dims["layers"]
    # each layer's selection is a valid top-K of the fp32 block scores of its own q and k
    # (tie-aware), so that replaying it below compares the kernels on a correct selection
    dropped = 0.0
    for layer, (q, k, idx) in enumerate(rec.calls):
        blocks = block_scores(q, k, cu, cfg)
        why = selection_mismatch(idx, blocks, cfg.num_selected)
        assert why is None, f"layer {layer}: {why}"
        dropped = max(dropped, ((blocks > float("-inf")).sum(-1) > cfg.num_selected).float().mean().item())
        del blocks
    # the sparse path must decide something here: rows with more candidate blocks than K
    assert dropped > 0.1, f"only {dropped:.1%} of the rows drop blocks"
    calls, rec.calls = rec.calls, []

    # (1) "own": every run selects its own blocks, the end-to-end claim; (2) "replayed": the
    # references reuse the library's selection layer by layer, so that no tie can flip and what
    # is left is the kernels' arithmetic, judged by the same rule at the precision of a bf16 step
    modes = {"own": lambda: reference_attention(cfg), "replayed": lambda: ReplayedReferenceAttention(cfg, calls)}
    stats = {}
    for mode, attn in modes.items():
        lowp = training_step(model, ids, labels, cu, max_len, attn())
        ref32 = training_step(model32, ids, labels, cu, max_len, attn())
        stats[mode] = st = judge_step(f"{mode} selection", lib, lowp, ref32)
        del lowp, ref32
        if verbose:  # pytest -s shows how close each rule came to failing
            name, (e, b) = max(((n, eb) for n, eb in st.items() if n != "loss"),
                               key=lambda kv: kv[1][0] / max(kv[1][1], 1e-30))
            print(f"{mode} selection: loss error {st['loss'][0]:.3g} (bf16 reference {st['loss'][1]:.3g}); "
                  f"worst gradient {name}: relative error {e:.3g} (bf16 reference {b:.3g})")
    return stats


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_cuda_training_step_matches_reference(case):
    """16K tokens, MiniCPM4 attention shape, bf16: the library's loss and every parameter
    gradient against an fp32 step through the reference, with the 2x rule."""
    cfg, lengths = GPU_CASES[case]
    assert sum(lengths) >= 16384 and max(lengths) >= cfg.dense_len
    # the fp32 oracle must be fp32: TF32 matmuls would make it hardly better than bf16
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        check_training_step(cfg, lengths, GPU_DIMS, "cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
