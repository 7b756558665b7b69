"""Hugging Face transformers integration: ``attn_implementation="infllmv2"``.

    import infllmv2.hf
    infllmv2.hf.register()              # once, before loading the model
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="infllmv2")

``register`` adds an attention function (``AttentionInterface``) and a mask function
(``AttentionMaskInterface``) under one name. Each attention layer then runs
``infllmv2.attention`` with the model config's ``sparse_config`` (MiniCPM4.1's dict) when it has
one, else the config given to ``register`` (default ``SparseConfig()``).

The mask function is FlashAttention's (plus the StaticCache count below): the model never builds
a 4-D mask, and the attention function gets ``None`` (no padding) or the 2-D padding mask.
Supported:

- causal self-attention without padding, prefill and decode against a ``DynamicCache``: the
  padded layout directly, nothing gathered (batch-1 prefill reads ``position_ids`` once per
  layer to detect packed sequences, as FlashAttention's integration does);
- 2-D padding masks, left, right or with holes (``generate`` with a padded batch): the valid
  tokens are packed into the varlen layout, one host read of the sequence lengths per layer;
- ``StaticCache``: keys past the written slots are ignored (the mask function passes their
  count on as a mask, as FlashAttention's does; one host read per forward);
- packed sequences (padding-free training): FlashAttention's ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` keyword arguments, or batch-1 ``position_ids`` that restart.

Decoding with ``cache=infllmv2.hf.InfLLMv2Cache()`` (``generate`` takes it as any cache; releases
of transformers before its rename of ``past_key_values`` take it by that name) keeps each layer's
keys and values in the library's padded cache layout with the compressed keys beside them: the
prompt runs ``infllmv2.attention`` and compresses its keys once, and every later step runs
``infllmv2.attention_kvcache``, which compresses only the keys the step added. With a
``DynamicCache`` every step compresses all of the keys again (the outputs are the same). Beam
search, ``crop`` and batch selection work on it. A left-padded batch (``generate`` with an
``attention_mask``) does too: the prompt runs the general path, then each row's valid keys move to
the start of its cache row (the kernels read a row from its start), and every step writes its keys
behind them, so ``layer.keys`` holds each row's valid keys first, not transformers' padded layout;
``crop`` then removes only tokens valid in every row. Other masks (right padding, holes in the
prompt) take the general path over the cached keys at every step.

PHSA (punctuation-aware compression, ``infllmv2.phsa``): a forward given ``punct_mask`` (bool
``(batch, tokens)``, which of its tokens are punctuation) passes it on to the attention layers,
and ``punctuation_hook(model, punct_ids)`` computes it from every forward's ``input_ids``, so
that ``generate`` gets it at every step. Attention needs the flags of all its keys: a forward
without a cache has them; ``InfLLMv2Cache`` keeps each cached key's flag beside it (the prompt's
forward turns PHSA on, and every later one must pass its tokens' flags); a ``DynamicCache`` or
``StaticCache`` step raises ``NotImplementedError`` unless ``punct_mask`` covers every key.

Non-causal attention, sliding windows shorter than the keys, soft-capping, attention sinks,
position biases and the paged (continuous batching) cache raise ``NotImplementedError``;
``dropout > 0`` raises ``ValueError``. Importing this module does not import transformers;
``register`` does.
"""

from __future__ import annotations

import functools
import weakref
from typing import Mapping

import torch

from .attention import SparseConfig, _config, attention, attention_kvcache, attention_padded
from .ops import _equal_cu_seqlens, compress_keys_kvcache, compressed_capacity
from .phsa import punctuation_mask, punctuation_table

NAME = "infllmv2"


@functools.lru_cache(maxsize=32)
def _frozen_config(items: tuple) -> SparseConfig:
    return SparseConfig.from_dict(dict(items))


def _layer_config(module, default: SparseConfig) -> SparseConfig:
    sparse = getattr(getattr(module, "config", None), "sparse_config", None)
    if sparse is None:
        return default
    try:
        if isinstance(sparse, Mapping):
            try:  # every layer of every forward reads it: validate each distinct dict once
                return _frozen_config(tuple(sorted(sparse.items())))
            except TypeError:  # unhashable values: let from_dict report them
                pass
        return _config(sparse)
    except ValueError as e:
        raise ValueError(f"model config sparse_config: {e}") from e


def _check_supported(module, key, dropout, kwargs) -> None:
    if dropout:
        raise ValueError(f"attn_implementation='infllmv2' has no attention dropout: dropout must be 0, got {dropout}")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if not is_causal:
        raise NotImplementedError("attn_implementation='infllmv2' is causal self-attention only "
                                  f"({type(module).__name__} asks for is_causal=False)")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise NotImplementedError(f"attn_implementation='infllmv2' has no sliding window (sliding_window={window} "
                                  f"< {key.shape[2]} keys): use it for full-attention layers only")
    for name in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"attn_implementation='infllmv2' does not support {name}")
    # continuous batching hands its paged cache over as `cache`; a model may pass any other cache
    # on by that name too (transformers' new name for past_key_values), whose keys are already in place
    if type(kwargs.get("cache")).__name__ == "PagedAttentionCache":
        raise NotImplementedError("attn_implementation='infllmv2' does not support the paged cache (continuous batching)")


def _restarts(position_ids, S: int):
    """Sequence starts of a batch-1 row whose positions restart (packed sequences), or None."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() != S or S < 2:
        return None
    pos = position_ids.reshape(S)
    starts = torch.nonzero(pos[1:] - pos[:-1] != 1).flatten()  # the one host read
    return None if starts.numel() == 0 else [0, *(starts + 1).tolist(), S]


def _unpadded(q, k, v, mask, cfg, scaling, punct=None):
    """Attention of a padded batch given its 2-D padding mask (B, L): the valid tokens packed;
    ``punct`` the keys' punctuation flags (B, >= L) or None."""
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
    if mask.dim() != 2 or mask.shape[0] != B or not Sq <= mask.shape[1] <= Sk:
        raise NotImplementedError(
            f"attn_implementation='infllmv2' takes a 2-D padding mask (batch={B}, kv_len) with "
            f"{Sq} <= kv_len <= {Sk}, got shape {tuple(mask.shape)}: custom (4-D) masks are not supported")
    L = mask.shape[1]
    mask = mask.bool()
    # a StaticCache's slots past the mask were never written; the queries are the last Sq positions
    return _packed(q, k[:, :L], v[:, :L], mask[:, L - Sq:], mask, cfg, scaling, None if punct is None else punct[:, :L])


def _packed(q, k, v, keep_q, keep_k, cfg, scaling, punct=None):
    """Attention of the queries and keys that keep_q (B, Sq) and keep_k (B, L) mark, each row's kept
    queries the last of its kept keys; zeros at the other queries. ``punct`` (B, L): the keys'
    punctuation flags (PHSA), or None."""
    B, Sq, L = q.shape[0], q.shape[1], k.shape[1]
    len_k, len_q = keep_k.sum(1, dtype=torch.int32), keep_q.sum(1, dtype=torch.int32)
    n_k, n_q, max_k, max_q = torch.stack([len_k.sum(), len_q.sum(), len_k.max(), len_q.max()]).tolist()
    if n_k == B * L and n_q == B * Sq:  # a static cache without padding
        return attention_padded(q, k, v, cfg, scaling, punct)
    out = q.new_zeros(q.shape)
    if n_q == 0:
        return out
    ik = torch.nonzero_static(keep_k.reshape(-1), size=n_k).flatten()
    iq = torch.nonzero_static(keep_q.reshape(-1), size=n_q).flatten()
    bk, sk, bq, sq = ik // L, ik % L, iq // Sq, iq % Sq
    cu_k, cu_q = (torch.nn.functional.pad(n.cumsum(0, dtype=torch.int32), (1, 0)) for n in (len_k, len_q))
    packed = attention(q[bq, sq], k[bk, sk], v[bk, sk], cu_q, cu_k, max_q, max_k, config=cfg, softmax_scale=scaling,
                       punct_mask=None if punct is None else punct[bk, sk])
    return out.index_put((bq, sq), packed)


def _flags(punct, B, S, L):
    """A forward's ``punct_mask`` as bool flags: (B, S) of its tokens or (B, L) of every key."""
    if not isinstance(punct, torch.Tensor) or punct.dim() != 2 or punct.shape[0] != B or punct.shape[1] not in (S, L) \
            or punct.is_floating_point() or punct.is_complex():
        got = f"{punct.dtype} {tuple(punct.shape)}" if isinstance(punct, torch.Tensor) else type(punct).__name__
        raise ValueError(f"punct_mask must be a bool or integer tensor of shape (batch={B}, {S} tokens) or (batch, {L} "
                         f"keys), got {got}")
    return punct.bool()


def _key_flags(punct, B, S, L):
    """The punctuation flags (B, L) of a layer's keys from a forward's ``punct_mask``, or None."""
    if punct is None:
        return None
    punct = _flags(punct, B, S, L)
    if punct.shape[1] != L:
        raise NotImplementedError(
            f"PHSA (punct_mask) needs the flags of all {L} keys, not only of the {S} new tokens: decode with "
            "infllmv2.hf.InfLLMv2Cache, which keeps them, or pass punct_mask over every key")
    return punct


@functools.lru_cache(maxsize=64)
def _steps(n: int, device):
    """0, ..., n - 1 (int64, an index), made once rather than every layer of every decoding step."""
    return torch.arange(n, device=device)


# made once rather than every layer of every decoding step
_step_cu_seqlens = functools.lru_cache(maxsize=64)(_equal_cu_seqlens)


_checked_mask = (None, None)  # (weak reference to a mask, its host-side facts): one read a forward, not a layer


def _mask_facts(mask, S: int):
    """Host-side facts of a 2-D padding mask (B, L) whose last S columns are a call's tokens:
    (rows all of the form 0...0 1...1, their counts of ones, last S columns all ones)."""
    global _checked_mask
    ref, facts = _checked_mask
    # the same mask, unchanged since (a loop may write one mask in place: its version moves)
    if ref is not None and ref() is mask and facts[:2] == (S, mask._version):
        return facts[2]
    m = mask.bool()
    left = (m[:, 1:] >= m[:, :-1]).all() if m.shape[1] > 1 else m.new_ones(())
    values = torch.cat([torch.stack([left, m[:, m.shape[1] - S:].all()]).int(), m.sum(1, dtype=torch.int32)]).tolist()
    out = (bool(values[0]), values[2:], bool(values[1]))
    _checked_mask = (weakref.ref(mask), (S, mask._version, out))
    return out


class _CacheState:
    """One layer's keys and values in the padded cache layout (batch, capacity, Hk, D), the first
    ``length`` of each row written, and the compressed keys of all but the last ``uncompressed``.

    A left-padded prompt (generate() with a padded batch) puts the cache in compacted mode: row
    ``b``'s tokens are its ``rows[b]`` valid ones, first, and ``append`` writes each step's keys
    into the row's next slots, so that the kernels, which read a row's keys from its start, see
    only valid keys. ``length`` stays the padded count that transformers' positions and masks
    use; the last ``tail`` positions are valid in every row.

    PHSA: when the prompt's forward passes ``punct_mask``, ``punct`` (batch, capacity) holds every
    cached key's punctuation flag, laid out as the keys (each forward records its tokens' flags),
    and both compressed caches are PHSA's; every later forward must pass one too."""

    def __init__(self, key_states):
        B, Hk, _, D = key_states.shape
        self.k_cache = self.v_cache = key_states.new_empty((B, 0, Hk, D))
        self.length = 0
        self.uncompressed = 0
        self.params = None  # the compressed caches' (kernel, stride) pairs and approx_lse
        self.ck = self.nk = None
        self.rows = None  # compacted mode: each row's valid keys (int32, on the device)
        self.rows_max = self.tail = 0
        self.punct = None  # PHSA: the keys' punctuation flags (bool, laid out as k_cache's rows)
        self.phsa = None  # whether the prompt's forward passed punct_mask (None before it)

    def append(self, key_states, value_states):
        B, Hk, S, D = key_states.shape
        if (B, Hk, D) != (self.k_cache.shape[0], *self.k_cache.shape[2:]):
            raise ValueError(f"InfLLMv2Cache: a layer holds (batch={self.k_cache.shape[0]}, heads_k="
                             f"{self.k_cache.shape[2]}, head_dim={self.k_cache.shape[3]}), got key states of shape "
                             f"{tuple(key_states.shape)}")
        need = self.length + S
        if need > self.k_cache.shape[1]:
            # doubling: appending n keys one at a time copies O(n) in all
            self._resize(max(need, 2 * self.k_cache.shape[1], 256))
        if self.rows is None:
            self.k_cache[:, self.length:need] = key_states.transpose(1, 2)
            self.v_cache[:, self.length:need] = value_states.transpose(1, 2)
        else:  # compacted: behind each row's valid keys (attend drops the ones the mask calls padding)
            dst = (self.rows[:, None].long() + _steps(S, key_states.device))[:, :, None, None].expand(B, S, Hk, D)
            self.k_cache.scatter_(1, dst, key_states.transpose(1, 2))
            self.v_cache.scatter_(1, dst, value_states.transpose(1, 2))
        self.length = need
        self.uncompressed += S

    def crop(self, n):
        """Drops the last n cached tokens (transformers' positions)."""
        n = min(n, self.length)
        if self.rows is not None:
            if n > self.tail:
                raise NotImplementedError(
                    f"InfLLMv2Cache: a padded batch's cache crops only tokens valid in every row (the last {self.tail} "
                    f"of {self.length}), not {n}")
            self.rows = self.rows - n
            self.rows_max -= n
            self.tail -= n
        # compressed keys of the kept keys stay valid; the ones past them are rewritten once
        # later keys complete them again
        self.length -= n
        self.uncompressed = max(self.uncompressed - n, 0)

    def _resize(self, capacity):
        capacity = -(-capacity // 256) * 256
        self.k_cache, self.v_cache = (self._resized(t, capacity, self.length) for t in (self.k_cache, self.v_cache))
        if self.punct is not None:
            self.punct = self._resized(self.punct, capacity, self.length)
        if self.params is not None:
            (ks, kst), (nks, nkst), _ = self.params
            self.ck = self._resized(self.ck, compressed_capacity(capacity, ks, kst), self.ck.shape[1])
            if self.nk is not None:
                self.nk = self._resized(self.nk, compressed_capacity(capacity, nks, nkst), self.nk.shape[1])

    @staticmethod
    def _resized(t, rows, keep):
        """Zeros shaped like t with ``rows`` rows a sequence, t's first ``keep`` rows copied in."""
        out = t.new_zeros((t.shape[0], rows, *t.shape[2:]))
        out[:, :keep] = t[:, :keep]
        return out

    def views(self):
        """keys, values as transformers reads them: (batch, Hk, length, D), views of the cache."""
        return self.k_cache[:, :self.length].transpose(1, 2), self.v_cache[:, :self.length].transpose(1, 2)

    def _compressed_caches(self, cfg):
        params = ((cfg.kernel_size, cfg.kernel_stride), (cfg.norm_kernel_size, cfg.norm_kernel_stride), cfg.approx_lse)
        if params != self.params:
            (ks, kst), (nks, nkst), approx = self.params = params
            capacity = self.k_cache.shape[1]
            self.ck = self._resized(self.k_cache, compressed_capacity(capacity, ks, kst), 0)
            self.nk = self._resized(self.k_cache, compressed_capacity(capacity, nks, nkst), 0) if approx else None
            self.uncompressed = self.length

    def _compress(self, cfg, lens, new_keys):
        self._compressed_caches(cfg)
        compress_keys_kvcache(self.k_cache, lens, self.ck, new_keys, None, cfg.kernel_size, cfg.kernel_stride,
                              self.punct, cfg.phsa_lambda)
        if self.nk is not None:
            compress_keys_kvcache(self.k_cache, lens, self.nk, new_keys, None, cfg.norm_kernel_size,
                                  cfg.norm_kernel_stride, self.punct, cfg.phsa_lambda)
        self.uncompressed = 0

    def key_flags(self):
        """The cached keys' punctuation flags (batch, length) as transformers lays the keys out, or None."""
        return None if self.punct is None else self.punct[:, :self.length]

    def _record_flags(self, punct, B, S):
        """Writes the punctuation flags of the forward's S tokens (the last S cached) where append
        wrote their keys."""
        if self.phsa is None:  # the prompt's forward decides, as the compressed caches are built then
            if punct is not None and S != self.length:
                raise ValueError("InfLLMv2Cache: PHSA (punct_mask) must start with the prompt's forward, not after "
                                 f"{self.length - S} cached tokens")
            self.phsa = punct is not None
            if self.phsa:
                self.punct = torch.zeros(self.k_cache.shape[:2], dtype=torch.bool, device=self.k_cache.device)
        if self.phsa != (punct is not None):
            raise ValueError("InfLLMv2Cache: " + (
                "the prompt's forward passed punct_mask (PHSA), so every later forward must pass one"
                if self.phsa else "the prompt's forward passed no punct_mask, so later forwards cannot start PHSA"))
        if punct is None:
            return
        flags = _flags(punct, B, S, self.length)[:, -S:].to(self.punct.device)
        if self.rows is None:
            self.punct[:, self.length - S:self.length] = flags
        else:  # where append scattered the keys: behind each row's valid ones
            self.punct.scatter_(1, self.rows[:, None].long() + _steps(S, flags.device), flags)

    def attend(self, q, cfg, scaling, mask=None, punct=None):
        """Attention of q (B, S, Hq, D), the last S of the cached tokens, given the 2-D padding mask
        (B, length) or None and the forward's punctuation flags (PHSA) or None; None where the
        general path must run over the cached keys as they are (``key_flags`` their flags)."""
        grad = torch.is_grad_enabled() and (q.requires_grad or self.k_cache.requires_grad or
                                            self.v_cache.requires_grad)
        self._record_flags(punct, q.shape[0], q.shape[1])
        if self.rows is not None:
            return self._attend_compacted(q, cfg, scaling, mask, grad)
        B, S = q.shape[:2]
        L = self.length
        if mask is not None:
            if S != L or grad or mask.dim() != 2 or tuple(mask.shape) != (B, L):
                return None
            left, lens, _ = _mask_facts(mask, S)
            return self._prefill_compacted(q, cfg, scaling, mask, lens) if left else None
        if grad:
            return None  # attention_kvcache is forward only; the compression stays pending
        lens = torch.full((B,), L, dtype=torch.int32, device=q.device)
        if S == L:
            # the prompt: the prefill path, then its keys compressed once for the steps to come
            k, v = (t[:, :L] for t in (self.k_cache, self.v_cache))
            out = attention_padded(q, k, v, cfg, scaling, self.key_flags())
            self._compress(cfg, lens, L)
            return out
        return self._step(q, cfg, scaling, lens, L)

    def _step(self, q, cfg, scaling, lens, longest):
        """attention_kvcache of q, the last S tokens of rows of ``lens`` keys (at most ``longest``),
        compressing the keys added since the last step."""
        B, S, Hq, D = q.shape
        self._compressed_caches(cfg)
        out = attention_kvcache(q.reshape(B * S, Hq, D), self.k_cache, self.v_cache, lens,
                                _step_cu_seqlens(B, S, q.device), self.ck, self.nk, self.uncompressed, None, cfg,
                                scaling, max_seqlen_q=S, max_seqlen_k=longest, punct_cache=self.punct)
        self.uncompressed = 0
        return out.view(B, S, Hq, D)

    def _prefill_compacted(self, q, cfg, scaling, mask, lens):
        """A left-padded prompt: the general path (the same call as without the cache), then each row's
        valid keys moved to its start and compressed once."""
        L = self.length
        k, v = (t[:, :L] for t in (self.k_cache, self.v_cache))
        out = _unpadded(q, k, v, mask, cfg, scaling, self.key_flags())
        self.rows = torch.tensor(lens, dtype=torch.int32, device=q.device)
        self.rows_max, self.tail = max(lens), 0
        src = (torch.arange(L, device=q.device) + (L - self.rows)[:, None]).clamp_(max=L - 1)
        for t in (self.k_cache, self.v_cache, self.punct):
            if t is not None:
                t[:, :L] = t[:, :L].gather(1, src.view(*src.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))
        self._compress(cfg, self.rows, L)
        return out

    def _attend_compacted(self, q, cfg, scaling, mask, grad):
        B, S = q.shape[:2]
        L, prev = self.length, self.length - S
        if mask is not None and (mask.dim() != 2 or tuple(mask.shape) != (B, L)):
            raise NotImplementedError(f"InfLLMv2Cache with a padded batch takes generate()'s 2-D padding mask "
                                      f"(batch={B}, {L} cached tokens), got shape {tuple(mask.shape)}")
        valid = mask is None or _mask_facts(mask, S)[2]
        if valid:
            self.rows.add_(S)
            self.rows_max += S
            self.tail += S
        else:  # append wrote the step's tokens behind each row's valid keys: keep the valid ones, in order
            keep = mask[:, prev:].bool()
            rank = keep.cumsum(1) - 1
            b, j = keep.nonzero(as_tuple=True)
            base = self.rows.long()
            for t in (self.k_cache, self.v_cache, self.punct):
                if t is not None:
                    t[b, base[b] + rank[b, j]] = t[b, base[b] + j]
            self.rows = self.rows + keep.sum(1, dtype=torch.int32)
            self.rows_max, self.tail = int(self.rows.max()), 0
        if grad or not valid:
            # the general path over the compacted keys; the compression stays pending
            keep_q = q.new_ones((B, S), dtype=torch.bool) if mask is None else mask[:, prev:].bool()
            keep_k = torch.arange(L, device=q.device) < self.rows[:, None]
            return _packed(q, self.k_cache[:, :L], self.v_cache[:, :L], keep_q, keep_k, cfg, scaling,
                           self.key_flags())
        return self._step(q, cfg, scaling, self.rows, self.rows_max)

    def select_batch(self, index):
        index = index.to(self.k_cache.device)
        for name in ("k_cache", "v_cache", "ck", "nk", "rows", "punct"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index))
        if self.rows is not None:
            self.rows_max = int(self.rows.max()) if self.rows.numel() else 0


@functools.cache
def _cache_classes():
    from transformers.cache_utils import Cache, DynamicLayer

    class InfLLMv2CacheLayer(DynamicLayer):
        """A layer of ``InfLLMv2Cache``: the keys and values in the library's padded cache layout,
        with the compressed keys that ``infllmv2.attention_kvcache`` keeps up to date."""

        def lazy_initialization(self, key_states, value_states):
            self.device = key_states.device
            self.state = _CacheState(key_states)
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.state.append(key_states, value_states)
            return self._views()

        def _views(self):
            self.keys, self.values = self.state.views()
            # the attention function finds the layer's cache through the keys transformers hands it
            self.keys._infllmv2_cache = self.state
            return self.keys, self.values

        def get_seq_length(self):
            return self.state.length if self.is_initialized else 0

        def reset(self):
            self.state = self.keys = self.values = None
            self.is_initialized = False

        def crop(self, tokens_to_remove):
            # transformers' convention: a negative count of tokens to drop from the end
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
            if tokens_to_remove == 0 or not self.is_initialized:
                return
            self.state.crop(-tokens_to_remove)
            self._views()

        def reorder_cache(self, beam_idx):
            if self.is_initialized:
                self.state.select_batch(beam_idx)
                self._views()

        def batch_select_indices(self, indices):
            indices = torch.as_tensor(indices, device=self.device)
            if indices.dtype == torch.bool:  # DynamicLayer indexes with either
                indices = indices.nonzero().flatten()
            self.reorder_cache(indices.reshape(-1))

        def batch_repeat_interleave(self, repeats):
            if self.is_initialized:
                B = self.state.k_cache.shape[0]
                self.reorder_cache(torch.arange(B, device=self.device).repeat_interleave(repeats))

        def offload(self):
            raise NotImplementedError("InfLLMv2Cache does not offload layers to the CPU")

        def prefetch(self):
            raise NotImplementedError("InfLLMv2Cache does not offload layers to the CPU")

    class InfLLMv2Cache(Cache):
        """A transformers cache for ``attn_implementation="infllmv2"`` that keeps each layer's
        compressed keys, so that a decoding step compresses only the keys it added (see the
        module's docstring). ``model.generate(..., cache=InfLLMv2Cache())`` (``past_key_values=``
        before transformers renamed it)."""

        def __init__(self):
            super().__init__(layer_class_to_replicate=InfLLMv2CacheLayer)

    return InfLLMv2Cache, InfLLMv2CacheLayer


def __getattr__(name):
    # the classes subclass transformers' and are built on first use: importing this module
    # does not import transformers
    if name in ("InfLLMv2Cache", "InfLLMv2CacheLayer"):
        try:
            classes = _cache_classes()
        except ImportError as e:
            raise ImportError(f"infllmv2.hf.{name} needs transformers >= 5 (pip install 'transformers>=5')") from e
        return classes[0] if name == "InfLLMv2Cache" else classes[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _attention_forward(default: SparseConfig):
    def infllmv2_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _check_supported(module, key, dropout, kwargs)
        cfg = _layer_config(module, default)
        # transformers passes (B, H, S, D); the library's padded layout is (B, S, H, D)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        B, Sq, Hq, D = q.shape
        cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
        bounds = None  # packed sequences in one row
        if attention_mask is None and cu_q is None and B == 1 and Sq == k.shape[1]:
            bounds = _restarts(kwargs.get("position_ids"), Sq)
        punct = kwargs.get("punct_mask")  # PHSA: the punctuation flags of the forward's tokens (or of every key)
        cached = getattr(key, "_infllmv2_cache", None)  # an InfLLMv2Cache layer's keys
        if cached is not None:
            if cu_q is None and bounds is None and cached.length == k.shape[1]:
                out = cached.attend(q, cfg, scaling, attention_mask, punct)
                if out is not None:
                    return out, None
                punct = cached.key_flags()  # the general path over the cached keys, as they are
            elif cached.rows is not None or cached.phsa or punct is not None:
                # its keys, or their flags, are not where the general path would look
                raise NotImplementedError("InfLLMv2Cache holding a padded batch or punctuation flags (PHSA) takes no "
                                          "packed sequences (cu_seq_lens_q, restarting position_ids)")
        punct = _key_flags(punct, B, Sq, k.shape[1])
        if attention_mask is not None:
            return _unpadded(q, k, v, attention_mask, cfg, scaling, punct), None
        if bounds is not None:
            cu_q = cu_k = torch.tensor(bounds, dtype=torch.int32, device=q.device)
            kwargs["max_length_q"] = kwargs["max_length_k"] = max(b - a for a, b in zip(bounds, bounds[1:]))
        if cu_q is None:
            return attention_padded(q, k, v, cfg, scaling, punct), None
        # with B = 1 the reshape is a strided view; the kernels read memory in order
        q, k, v = (t.reshape(-1, *t.shape[2:]).contiguous() for t in (q, k, v))
        out = attention(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), kwargs.get("max_length_q"),
                        kwargs.get("max_length_k"), config=cfg, softmax_scale=scaling,
                        punct_mask=None if punct is None else punct.reshape(-1))
        return out.view(B, Sq, Hq, D), None

    return infllmv2_attention_forward


def _mask_function(flash_attention_mask):
    def infllmv2_mask(batch_size, q_length, kv_length, q_offset=None, kv_offset=0, attention_mask=None, **kwargs):
        mask = flash_attention_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                                    q_offset=0 if q_offset is None else q_offset, kv_offset=kv_offset,
                                    attention_mask=attention_mask, **kwargs)
        if mask is None and q_offset is not None and not kv_offset:
            # A StaticCache hands over all kv_length slots; generate() drops an all-ones mask
            # for any implementation but FlashAttention, so say here how many are written.
            written = int(q_offset) + q_length
            if written < kv_length:
                mask = torch.ones(batch_size, written, dtype=torch.bool, device=kwargs.get("device"))
        return mask

    return infllmv2_mask


def punctuation_hook(model, punct_ids):
    """PHSA for a transformers model: a forward pre-hook on ``model`` that passes each forward's
    ``punct_mask`` (which of its ``input_ids`` are in ``punct_ids``, e.g.
    ``infllmv2.phsa.punctuation_token_ids(tokenizer)``) on to the attention layers, ``generate``'s
    steps included. Returns the hook's handle (``.remove()`` takes PHSA off again). A forward
    given ``inputs_embeds`` instead of ``input_ids`` raises ``ValueError``."""
    table = punctuation_table(punct_ids)
    # the lookup table where the input ids are, copied once: a copy from pageable host memory at
    # every forward would wait for the GPU
    placed = {}

    def pass_punct_mask(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError("infllmv2.hf.punctuation_hook: PHSA needs the forward's input_ids (punctuation is a "
                             "property of tokens), got inputs_embeds only")
        if input_ids.device not in placed:
            placed[input_ids.device] = table.to(input_ids.device)
        kwargs["punct_mask"] = punctuation_mask(input_ids, table=placed[input_ids.device])
        return args, kwargs

    return model.register_forward_pre_hook(pass_punct_mask, with_kwargs=True)


def register(config=None, name: str = NAME) -> None:
    """Registers ``name`` with transformers' attention and mask interfaces.

    ``config``: the ``SparseConfig`` (or sparse_config dict) for models whose config has no
    ``sparse_config``; calling ``register`` again replaces it. Needs transformers >= 5."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:
        raise ImportError("infllmv2.hf.register() needs transformers >= 5 with AttentionInterface and "
                          "AttentionMaskInterface (pip install 'transformers>=5')") from e
    default = _config(config)
    AttentionInterface.register(name, _attention_forward(default))
    AttentionMaskInterface.register(name, _mask_function(flash_attention_mask))
