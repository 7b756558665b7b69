"""The custom ops called directly (``torch.ops.infllmv2.*``), as a user's code or compiled graph
may: the public functions check and convert what they pass an op, but an op hands data pointers
to the C library, which sees no dtype, stride or device. Every op checks its CUDA arguments
itself (ops._checked), and a bad one is a ValueError naming it, never a kernel reading it wrong.

The GPU tier records the ops' arguments from public calls (a dispatch mode sees each op called
with what the kernels take), replays them, then breaks one argument at a time."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import infllmv2
from infllmv2 import SparseConfig
from infllmv2.ops import _check_op_tensors
from infllmv2.testing import cu_seqlens, kv_cache_of, random_mask, random_tokens

OPS = ("compress_keys", "compress_keys_kvcache", "sparse_attn_fwd", "sparse_attn_bwd", "sparse_decode",
       "sparse_decode_kvcache", "dense_decode_kvcache", "dense_attn_fwd", "dense_attn_bwd", "select_blocks",
       "select_decode", "select_decode_kvcache", "attention_kvcache")


def test_every_op_is_listed():
    """A new op joins OPS, so its checks are tested."""
    names = {name for name in dir(torch.ops.infllmv2) if not name.startswith("_")}
    assert names >= set(OPS)
    assert not {name for name in names - set(OPS) if hasattr(getattr(torch.ops.infllmv2, name), "default")}


# ---- the generic part, on CPU tensors (the check itself does not need a GPU) ----

NAMES = ("q", "k", "lse", "topk_idx", "cu_seqlens_q", "punct_mask")


def _args(**change):
    args = dict(q=torch.zeros(4, 2, 64, dtype=torch.bfloat16), k=torch.zeros(4, 1, 64, dtype=torch.bfloat16),
                lse=torch.zeros(2, 4), topk_idx=torch.zeros(1, 4, 2, dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 4], dtype=torch.int32), punct_mask=None)
    args.update(change)
    return tuple(args[n] for n in NAMES)


def test_op_tensors_accepted():
    _check_op_tensors("infllmv2::x", NAMES, _args())
    _check_op_tensors("infllmv2::x", NAMES, _args(punct_mask=torch.zeros(4, dtype=torch.bool)))
    _check_op_tensors("infllmv2::x", NAMES, _args(q=torch.zeros(4, 2, 64, dtype=torch.float16),
                                                   k=torch.zeros(4, 1, 64, dtype=torch.float16)))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=torch.zeros(4, 2, 64)), "infllmv2::x: q must be bfloat16 or float16 on CUDA, got torch.float32"),
        (dict(k=torch.zeros(4, 1, 64, dtype=torch.float16)), "k dtype torch.float16 differs from q dtype"),
        (dict(lse=torch.zeros(2, 4, dtype=torch.float64)), "lse must be torch.float32, got torch.float64"),
        (dict(topk_idx=torch.zeros(1, 4, 2, dtype=torch.int64)), "topk_idx must be torch.int32, got torch.int64"),
        (dict(cu_seqlens_q=torch.tensor([0, 4])), "cu_seqlens_q must be torch.int32"),
        (dict(punct_mask=torch.zeros(4, dtype=torch.uint8)), "punct_mask must be torch.bool"),
        (dict(k=torch.zeros(4, 2, 64, dtype=torch.bfloat16)[:, :1]), "k must be contiguous"),
        (dict(topk_idx=torch.zeros(1, 2, 4, dtype=torch.int32).transpose(1, 2)), "topk_idx must be contiguous"),
        (dict(cu_seqlens_q=torch.tensor([0, 9, 4, 9], dtype=torch.int32)[::2]), "cu_seqlens_q must be contiguous"),
        (dict(lse=torch.zeros(4, 2).t()), "lse must be contiguous"),
        (dict(k=torch.zeros(4, 1, 64, dtype=torch.bfloat16, device="meta")), "k is on meta but q is on cpu"),
    ],
)
def test_op_tensors_refused(change, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        _check_op_tensors("infllmv2::x", NAMES, _args(**change))


# ---- every op on the GPU ----


class _Recorder(TorchDispatchMode):
    """The first call of each infllmv2 op, with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "infllmv2":
            self.calls.setdefault(func.__name__.split(".")[0], (func, args))
        return func(*args, **(kwargs or {}))


def _public_calls():
    """Public calls that between them run every op once."""
    dev, bf16 = "cuda", torch.bfloat16
    lengths = [65, 400, 1]
    cu = cu_seqlens(lengths, dev)
    q, k, v = (random_tokens(lengths, h, 128, bf16, dev, seed=s).requires_grad_() for s, h in ((1, 32), (2, 2), (3, 2)))
    cfg = SparseConfig(dense_len=300, window_size=128, topk=2)
    out = infllmv2.attention(q, k, v, cu, cu, 400, 400, config=cfg)  # select_decode, sparse_attn_fwd
    out.backward(torch.randn_like(out))  # sparse_attn_bwd
    infllmv2.select_blocks(q.detach(), k.detach(), cu, cu, topk=4, local_blocks=2, max_seqlen_q=400, max_seqlen_k=400)
    out = infllmv2.dense_attn_varlen(q, k, v, cu, cu, 400, 400)
    out.backward(torch.randn_like(out))
    q, k, v = q.detach(), k.detach(), v.detach()
    infllmv2.compress_keys(k, cu, punct_mask=random_mask(k.shape[0], 0.2, dev))
    # decoding: one query a sequence against the keys above
    qd = random_tokens([1, 1, 1], 32, 128, bf16, dev, seed=4)
    cu_q = cu_seqlens([1, 1, 1], dev)
    idx = infllmv2.select_decode(qd, k, cu_q, cu, topk=4, local_blocks=2, max_seqlen_q=1, max_seqlen_k=400,
                                 num_splits=2)
    infllmv2.sparse_decode(qd, k, v, cu_q, cu, idx, max_seqlen_q=1, num_splits=2)
    kc, vc, table = kv_cache_of(k, v, lengths, "paged64")
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    capacity = kc.shape[1] * table.shape[1]
    ck = torch.zeros(3, infllmv2.compressed_capacity(capacity), 2, 128, device=dev, dtype=bf16)
    nk = torch.zeros(3, infllmv2.compressed_capacity(capacity, 128, 64), 2, 128, device=dev, dtype=bf16)
    infllmv2.compress_keys_kvcache(kc, lens, ck, 400, table)
    infllmv2.compress_keys_kvcache(kc, lens, nk, 400, table, 128, 64)
    idx = infllmv2.select_decode_kvcache(qd, ck, nk, lens, cu_q, capacity, topk=4, local_blocks=2, max_seqlen_q=1)
    infllmv2.sparse_decode_kvcache(qd, kc, vc, lens, cu_q, idx, table, max_seqlen_q=1)
    infllmv2.dense_decode_kvcache(qd, kc, vc, lens, cu_q, table, max_seqlen_q=1)
    infllmv2.attention_kvcache(qd, kc, vc, lens, cu_q, ck, nk, 1, table, cfg, max_seqlen_q=1, max_seqlen_k=400,
                               punct_cache=torch.zeros(kc.shape[:2], dtype=torch.bool, device=dev))


@pytest.fixture(scope="module")
def recorded():
    with _Recorder() as rec:
        _public_calls()
    torch.cuda.synchronize()
    return rec.calls


def _names(func):
    return [a.name for a in func._schema.arguments]


def _non_contiguous(t):
    return torch.stack([t, t], -1)[..., 0]


def _other_dtype(t):
    return {torch.int32: torch.int64, torch.float32: torch.float64, torch.bool: torch.uint8}.get(t.dtype, torch.float32)


def _breaks(func, args):
    """(argument name, args with it broken, what the error must say)."""
    for i, (name, t) in enumerate(zip(_names(func), args)):
        if not isinstance(t, torch.Tensor):
            continue
        if t.numel() > 1 and t.dim() >= 1 and max(t.shape) > 1:
            yield name, args[:i] + (_non_contiguous(t),) + args[i + 1:], f"{name} must be contiguous"
        yield name, args[:i] + (t.to(_other_dtype(t)),) + args[i + 1:], name
        if i > 0:  # a CPU first argument takes the op to the reference
            yield name, args[:i] + (t.cpu(),) + args[i + 1:], f"{name} is on cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_direct_calls_are_checked(recorded, op):
    func, args = recorded[op]
    func(*args)  # the call as recorded runs
    torch.cuda.synchronize()
    tried = 0
    for name, broken, message in _breaks(func, args):
        with pytest.raises(ValueError, match=message):
            func(*broken)
        tried += 1
    assert tried >= 4
    torch.cuda.synchronize()  # nothing reached a kernel


def _replace(func, args, **change):
    names = _names(func)
    args = list(args)
    for name, value in change.items():
        args[names.index(name)] = value(args[names.index(name)])
    return tuple(args)


# shapes the C library is not given, or given from another tensor
SHAPES = [
    ("sparse_attn_bwd", dict(lse=lambda t: t[:, :-1].contiguous()), "lse must have shape"),
    ("sparse_attn_bwd", dict(dout=lambda t: t[:-1].contiguous()), "dout must have q's shape"),
    ("dense_attn_bwd", dict(out=lambda t: t[:, :-1].contiguous()), "out must have q's shape"),
    ("sparse_attn_fwd", dict(v=lambda t: t[:-1].contiguous()), "must share"),
    ("sparse_attn_fwd", dict(topk_idx=lambda t: t[:, :-1].contiguous()), "topk_idx must have shape"),
    ("dense_attn_fwd", dict(k=lambda t: t[..., :64].contiguous()), "must share"),
    ("sparse_decode_kvcache", dict(v_cache=lambda t: t[:-1].contiguous()), "k_cache and v_cache must both"),
    ("dense_decode_kvcache", dict(cache_seqlens=lambda t: t[:-1].contiguous()), "cache_seqlens must have 3"),
    ("dense_decode_kvcache", dict(block_table=lambda t: t[:-1].contiguous()), "block_table must be"),
    ("attention_kvcache", dict(ck_cache=lambda t: t[:, :1].contiguous()), "ck_cache holds 1 rows"),
    ("attention_kvcache", dict(punct_cache=lambda t: t[:, :-1].contiguous()), "punct_cache must be a bool"),
    ("attention_kvcache", dict(config=lambda c: c[:-1]), "config must hold the 10"),
    ("select_decode_kvcache", dict(nk_cache=lambda t: t[:, :1].contiguous()), "nk_cache holds 1 rows"),
    ("compress_keys", dict(punct_mask=lambda t: t[:-1].contiguous()), "punct_mask must have shape"),
    ("compress_keys_kvcache", dict(ck_cache=lambda t: t[..., :64].contiguous()), "ck_cache must be a tensor"),
    ("select_blocks", dict(k=lambda t: t[:, :, :64].contiguous()), "k head_dim 64 differs"),
    ("select_decode", dict(num_splits=lambda n: 65), "num_splits must be at most 64"),
    ("sparse_decode", dict(num_splits=lambda n: 65), "num_splits must be at most 64"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("op, change, message", SHAPES, ids=[f"{op}-{next(iter(c))}" for op, c, _ in SHAPES])
def test_direct_calls_check_shapes(recorded, op, change, message):
    func, args = recorded[op]
    with pytest.raises(ValueError, match=message):
        func(*_replace(func, args, **change))
