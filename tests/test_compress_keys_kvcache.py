"""compress_keys_kvcache: compressed caches kept up to date over a padded or paged KV cache,
against compress_keys on the same keys packed (bitwise) and against the reference."""

import pytest
import torch

import infllmv2
from infllmv2 import _lib, reference
from infllmv2.ops import compress_keys_kvcache_launch
from infllmv2.testing import (assert_close_to_reference, cu_seqlens, kv_cache_of, no_host_sync, punct_cache_of,
                              random_tokens)

LAYOUTS = ("padded", "batch_idx", "paged64", "paged256")  # kv_cache_of's
LENGTHS = {"one": [1], "edges": [31, 32, 33, 63, 64, 65, 127, 128, 129], "mix": [3000, 1, 777, 200, 64]}
# compress_keys takes the runs-of-gcd path for every block of these: the entries are bitwise equal
BITWISE = [(32, 16), (128, 64), (48, 16), (5, 3)]


def _cache(lengths, dtype, D, layout, heads_k=2, seed=0, device="cuda", spare=37):
    k = random_tokens(lengths, heads_k, D, dtype, device, seed=seed)
    kc, _, table = kv_cache_of(k, k, lengths, layout, seed, spare)
    return k, kc, table, torch.tensor(lengths, dtype=torch.int32, device=device)


def _empty_compressed(kc, table, batch, w, s):
    """A NaN-filled compressed cache: entries the call does not write stay NaN."""
    cap = infllmv2.compressed_capacity(kc.shape[1] * (1 if table is None else table.shape[1]), w, s)
    return torch.full((batch, cap, kc.shape[2], kc.shape[3]), float("nan"), dtype=kc.dtype, device=kc.device)


def _packed(k, lengths, w, s):
    ck, cu_c = infllmv2.compress_keys(k, cu_seqlens(lengths, k.device), w, s)
    return [ck[a:b] for a, b in zip(cu_c[:-1].tolist(), cu_c[1:].tolist())]


def _punct(lengths, layout, seed=0, device="cuda", spare=37):
    """Random punctuation flags of the packed keys, and the same flags laid out as kv_cache_of lays
    out the keys with this seed (its table)."""
    flags = (torch.rand(sum(lengths), generator=torch.Generator().manual_seed(seed + 100)) < 0.2).to(device)
    return flags, *punct_cache_of(flags, lengths, layout, seed, spare)


def _packed_phsa(k, lengths, flags, w, s, lam):
    ck, cu_c = infllmv2.compress_keys(k, cu_seqlens(lengths, k.device), w, s, punct_mask=flags, phsa_lambda=lam)
    return [ck[a:b] for a, b in zip(cu_c[:-1].tolist(), cu_c[1:].tolist())]


# ---------------------------------------------------------------------------------- CPU tier


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_reference_writes_only_the_new_entries(layout):
    lengths = [100, 1, 64, 300]
    k, kc, table, lens = _cache(lengths, torch.float32, 64, layout, device="cpu")
    ck = _empty_compressed(kc, table, len(lengths), 32, 16)
    new = 40
    got = infllmv2.compress_keys_kvcache(kc, lens, ck, new, table)
    assert got is ck
    full = _packed(k, lengths, 32, 16)
    for b, n_k in enumerate(lengths):
        lo, hi = (reference._num_windows(n, 32, 16) for n in (max(n_k - new, 0), n_k))
        assert torch.equal(ck[b, lo:hi], full[b][lo:hi])
        assert torch.isnan(ck[b, :lo]).all() and torch.isnan(ck[b, hi:]).all()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cpu_phsa_writes_compress_keys_phsa_entries(layout):
    lengths = [100, 1, 64, 300]
    k, kc, table, lens = _cache(lengths, torch.float32, 64, layout, device="cpu")
    flags, pc, ptable = _punct(lengths, layout, device="cpu")
    assert (table is None and ptable is None) or torch.equal(table, ptable)
    ck = _empty_compressed(kc, table, len(lengths), 32, 16)
    new = 40
    infllmv2.compress_keys_kvcache(kc, lens, ck, new, table, punct_cache=pc, phsa_lambda=0.3)
    full = _packed_phsa(k, lengths, flags, 32, 16, 0.3)
    assert not all(torch.equal(a, b) for a, b in zip(full, _packed(k, lengths, 32, 16)))  # PHSA changed something
    for b, n_k in enumerate(lengths):
        lo, hi = (reference._num_windows(n, 32, 16) for n in (max(n_k - new, 0), n_k))
        assert torch.equal(ck[b, lo:hi], full[b][lo:hi])
        assert torch.isnan(ck[b, :lo]).all() and torch.isnan(ck[b, hi:]).all()


def test_bad_inputs_name_the_argument():
    k, kc, table, lens = _cache([100, 50], torch.float32, 64, "paged64", device="cpu")
    ck = _empty_compressed(kc, table, 2, 32, 16)
    with pytest.raises(ValueError, match="ck_cache holds 3 rows a sequence"):
        infllmv2.compress_keys_kvcache(kc, lens, ck[:, :3], 1, table)
    with pytest.raises(ValueError, match="new_keys"):
        infllmv2.compress_keys_kvcache(kc, lens, ck, -1, table)
    with pytest.raises(ValueError, match="ck_cache must be a tensor of shape"):
        infllmv2.compress_keys_kvcache(kc, lens, ck.double(), 1, table)
    with pytest.raises(ValueError, match="cache_seqlens must have 2 entries"):
        infllmv2.compress_keys_kvcache(kc, lens[:1], ck, 1, table)
    with pytest.raises(ValueError, match="block_table must be an int32 tensor"):
        infllmv2.compress_keys_kvcache(kc, lens, ck, 1, table[:1])
    pc = torch.zeros(kc.shape[:2], dtype=torch.bool)
    with pytest.raises(ValueError, match="punct_cache must be a bool tensor of shape"):
        infllmv2.compress_keys_kvcache(kc, lens, ck, 1, table, punct_cache=pc.to(torch.uint8))
    with pytest.raises(ValueError, match="punct_cache must be a bool tensor of shape"):
        infllmv2.compress_keys_kvcache(kc, lens, ck, 1, table, punct_cache=pc[:, :10])
    with pytest.raises(ValueError, match="phsa_lambda must be in"):
        infllmv2.compress_keys_kvcache(kc, lens, ck, 1, table, punct_cache=pc, phsa_lambda=1.5)


# ---------------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("lengths", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("ws", BITWISE, ids=[f"{w}_{s}" for w, s in BITWISE])
def test_cuda_prefill_is_compress_keys_bitwise(dtype, head_dim, layout, lengths, ws):
    """From an empty (NaN) compressed cache with new_keys = the lengths: every entry is
    compress_keys' on the packed keys, bit for bit, and nothing past n(L) is written."""
    w, s = ws
    k, kc, table, lens = _cache(lengths, dtype, head_dim, layout)
    ck = _empty_compressed(kc, table, len(lengths), w, s)
    with no_host_sync():
        infllmv2.compress_keys_kvcache(kc, lens, ck, max(lengths), table, w, s)
    for b, (n_k, want) in enumerate(zip(lengths, _packed(k, lengths, w, s))):
        assert torch.equal(ck[b, :want.shape[0]], want), f"sequence {b}"
        assert torch.isnan(ck[b, want.shape[0]:]).all(), f"sequence {b}: written past n(L)"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("step", [1, 3, 16, 17, 100])
def test_cuda_decode_steps_write_only_what_the_new_keys_completed(layout, step):
    """A cache growing by `step` keys a call: the entries before n(L - step) are never written
    again (poisoned with NaN before each call, they stay NaN), the new ones are compress_keys'."""
    final = [700, 130, 64, 1000]
    k, kc, table, _ = _cache(final, torch.bfloat16, 128, layout)
    ck = _empty_compressed(kc, table, len(final), 32, 16)
    full = _packed(k, final, 32, 16)
    start = [max(n - 3 * step, 0) for n in final]
    for i in range(1, 4):
        now = [min(a + i * step, n) for a, n in zip(start, final)]
        ck.fill_(float("nan"))
        infllmv2.compress_keys_kvcache(kc, torch.tensor(now, dtype=torch.int32, device="cuda"), ck, step, table)
        for b, n_k in enumerate(now):
            lo, hi = (reference._num_windows(n, 32, 16) for n in (max(n_k - step, 0), n_k))
            assert torch.isnan(ck[b, :lo]).all() and torch.isnan(ck[b, hi:]).all(), f"step {i} sequence {b}"
            assert torch.equal(ck[b, lo:hi], full[b][lo:hi]), f"step {i} sequence {b}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ws", [(96, 64), (64, 32), (7, 2)])
def test_cuda_other_windows_match_the_reference(dtype, ws):
    """Windows where compress_keys may sum a row's keys directly: the 2x error rule."""
    w, s = ws
    lengths = [1000, 95, 96, 97, 1]
    k, kc, table, lens = _cache(lengths, dtype, 128, "paged64")
    ck = torch.zeros((len(lengths), infllmv2.compressed_capacity(kc.shape[1] * table.shape[1], w, s), 2, 128),
                     dtype=dtype, device="cuda")
    infllmv2.compress_keys_kvcache(kc, lens, ck, 1000, table, w, s)
    cpu = (kc.cpu(), lens.cpu(), ck.cpu(), 1000, table.cpu(), w, s)
    ref32 = reference.compress_keys_kvcache(cpu[0].float(), *cpu[1:2], cpu[2].float(), *cpu[3:])
    lowp = reference.compress_keys_kvcache(*cpu)
    assert_close_to_reference(ck.cpu(), lowp, ref32, what=f"compressed cache {w}/{s}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ws", [(32, 16), (128, 64), (7, 2), (96, 64)], ids=["32_16", "128_64", "7_2", "96_64"])
def test_cuda_phsa_steps_are_compress_keys_phsa_bitwise(dtype, head_dim, layout, ws):
    """PHSA over the cache (punct_cache): a prefill and decoding steps into NaN-poisoned caches
    write exactly the entries the new keys completed, each bit for bit compress_keys' PHSA entry
    on the packed keys (which sums every window directly, so any window and stride), with no host
    synchronisation. The last step is larger than the cache; in the padded layout the longest
    sequence ends at the capacity."""
    w, s = ws
    final = [700, 130, 64, 1000, 1]
    spare = 0 if layout == "padded" else 37
    k, kc, table, _ = _cache(final, dtype, head_dim, layout, spare=spare)
    flags, pc, _ = _punct(final, layout, spare=spare)
    ck = _empty_compressed(kc, table, len(final), w, s)
    full = _packed_phsa(k, final, flags, w, s, 0.25)
    now = [max(n - 40, 0) for n in final]
    for i, step in enumerate((max(now), 1, 16, 3, 20, 10 ** 6)):
        now = now if i == 0 else [min(n + step, f) for n, f in zip(now, final)]
        ck.fill_(float("nan"))
        lens = torch.tensor(now, dtype=torch.int32, device="cuda")
        with no_host_sync():
            infllmv2.compress_keys_kvcache(kc, lens, ck, step, table, w, s, punct_cache=pc, phsa_lambda=0.25)
        for b, n_k in enumerate(now):
            lo, hi = (reference._num_windows(n, w, s) for n in (max(n_k - step, 0), n_k))
            assert torch.isnan(ck[b, :lo]).all() and torch.isnan(ck[b, hi:]).all(), f"step {i} sequence {b}"
            assert torch.equal(ck[b, lo:hi], full[b][lo:hi]), f"step {i} sequence {b}"


@pytest.mark.gpu
def test_cuda_c_abi_errors_name_the_argument():
    lib = _lib.lib()
    k, kc, table, lens = _cache([100, 50], torch.bfloat16, 128, "paged64")
    ck = _empty_compressed(kc, table, 2, 32, 16)

    def call(**over):
        a = dict(k=kc, table=table, lens=lens, ck=ck, batch=2, pages=kc.shape[0], page=kc.shape[1],
                 per_seq=table.shape[1], cap_c=ck.shape[1], new=1, w=32, s=16, punct=None, lam=0.5)
        a.update(over)
        st = lib.infllmv2_compress_keys_kvcache(
            a["k"].data_ptr(), 0 if a["table"] is None else a["table"].data_ptr(), a["lens"].data_ptr(),
            None if a["punct"] is None else a["punct"].data_ptr(), a["lam"], a["ck"].data_ptr(), a["batch"], a["pages"], a["page"], a["per_seq"], a["cap_c"], a["new"], 2, 128,
            _lib.DTYPE_BF16, a["w"], a["s"], None)
        return st, lib.infllmv2_last_error().decode()

    assert call()[0] == _lib.OK
    st, msg = call(cap_c=3)
    assert st == _lib.ERR_INVALID_ARGUMENT and "capacity_c must hold the" in msg
    st, msg = call(new=-1)
    assert st == _lib.ERR_INVALID_ARGUMENT and "new_keys must be >= 0" in msg
    st, msg = call(table=None)
    assert st == _lib.ERR_INVALID_ARGUMENT and "pages_per_seq must be 0 for a padded cache" in msg
    st, msg = call(page=48)
    assert st == _lib.ERR_UNSUPPORTED and "page_size must be a multiple of 64" in msg
    st, msg = call(lens=lens.cpu())
    assert st == _lib.ERR_INVALID_ARGUMENT and "cache_seqlens" in msg
    pc = torch.zeros(kc.shape[:2], dtype=torch.uint8, device="cuda")
    assert call(punct=pc)[0] == _lib.OK
    st, msg = call(punct=pc, lam=1.5)
    assert st == _lib.ERR_INVALID_ARGUMENT and "phsa_lambda must be in [0, 1], got 1.5" in msg
    st, msg = call(punct=pc, lam=float("nan"))
    assert st == _lib.ERR_INVALID_ARGUMENT and "phsa_lambda must be in [0, 1]" in msg
    st, msg = call(punct=pc.cpu())
    assert st == _lib.ERR_INVALID_ARGUMENT and "punct_cache" in msg
    assert call(lam=7.0)[0] == _lib.OK  # no punct_cache: phsa_lambda is not read
    # no new keys: nothing written
    ck.fill_(float("nan"))
    assert call(new=0)[0] == _lib.OK and torch.isnan(ck).all()


@pytest.mark.gpu
def test_cuda_lengths_past_the_capacity_are_clamped():
    """cache_seqlens beyond a sequence's capacity read no row outside its page: the entries are
    those of a full cache."""
    kc = torch.randn((2, 256, 1, 64), device="cuda").to(torch.bfloat16)
    full, big = (torch.full((2,), n, dtype=torch.int32, device="cuda") for n in (256, 10 ** 6))
    want = _empty_compressed(kc, None, 2, 32, 16)
    got = want.clone()
    infllmv2.compress_keys_kvcache(kc, full, want, 256)
    infllmv2.compress_keys_kvcache(kc, big, got, 10 ** 6)
    assert not torch.isnan(want).any() and torch.equal(got, want)
    pc = torch.rand(kc.shape[:2], generator=torch.Generator().manual_seed(1)).lt(0.3).cuda()
    want.fill_(float("nan"))
    got.fill_(float("nan"))
    infllmv2.compress_keys_kvcache(kc, full, want, 256, punct_cache=pc)
    infllmv2.compress_keys_kvcache(kc, big, got, 10 ** 6, punct_cache=pc)
    assert not torch.isnan(want).any() and torch.equal(got, want)


@pytest.mark.gpu
def test_cuda_torch_compile_fullgraph():
    lengths = [300, 65]
    k, kc, table, lens = _cache(lengths, torch.bfloat16, 128, "paged64")
    ck = _empty_compressed(kc, table, 2, 32, 16)

    @torch.compile(fullgraph=True)
    def step(kc, lens, ck, table):
        infllmv2.compress_keys_kvcache(kc, lens, ck, 300, table)
        return ck * 1

    got = step(kc, lens, ck, table)
    for b, want in enumerate(_packed(k, lengths, 32, 16)):
        assert torch.equal(got[b, :want.shape[0]], want)

    flags, pc, _ = _punct(lengths, "paged64")

    @torch.compile(fullgraph=True)
    def phsa_step(kc, lens, ck, table, pc):
        infllmv2.compress_keys_kvcache(kc, lens, ck, 300, table, punct_cache=pc, phsa_lambda=0.25)
        return ck * 1

    got = phsa_step(kc, lens, ck, table, pc)
    for b, want in enumerate(_packed_phsa(k, lengths, flags, 32, 16, 0.25)):
        assert torch.equal(got[b, :want.shape[0]], want)
