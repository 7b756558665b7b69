"""Hugging Face transformers integration: ``attn_implementation="infllmv2"``.

    import infllmv2.hf
    infllmv2.hf.register()              # once, before loading the model
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="infllmv2")

Each attention layer then runs ``infllmv2.attention`` with the model config's ``sparse_config``
(MiniCPM4.1's dict) when it has one, else the config given to ``register`` (default
``SparseConfig()``). The mask interface is FlashAttention's: no 4-D mask is built, and a 2-D
padding mask (left, right or any holes) is honoured by packing the valid tokens into the varlen
layout (one host read of the longest sequence). Importing this module does not import
transformers; ``register`` does.
"""

from __future__ import annotations

import torch

from .attention import SparseConfig, _config, attention, attention_padded

NAME = "infllmv2"


def _layer_config(module, default: SparseConfig) -> SparseConfig:
    sparse = getattr(getattr(module, "config", None), "sparse_config", None)
    return default if sparse is None else _config(sparse)


def _attention_forward(default: SparseConfig):
    def infllmv2_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise ValueError(f"attn_implementation='infllmv2' has no attention dropout, got dropout={dropout}")
        cfg = _layer_config(module, default)
        # transformers passes (B, H, S, D); the library's padded layout is (B, S, H, D)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        if attention_mask is None:
            return attention_padded(q, k, v, cfg, scaling), None
        if attention_mask.dim() != 2 or attention_mask.shape != (k.shape[0], k.shape[1]):
            raise ValueError(f"attention_mask must be a 2-D padding mask (batch, kv_len) = {tuple(k.shape[:2])}, "
                             f"got shape {tuple(attention_mask.shape)}")
        keep_k = attention_mask.bool()
        keep_q = keep_k[:, -q.shape[1]:]  # the queries are the last q_len positions of the keys
        lk, lq = keep_k.sum(1, dtype=torch.int32), keep_q.sum(1, dtype=torch.int32)
        cu_k = torch.cat([lk.new_zeros(1), lk.cumsum(0)]).to(torch.int32)
        cu_q = torch.cat([lq.new_zeros(1), lq.cumsum(0)]).to(torch.int32)
        out = attention(q[keep_q].contiguous(), k[keep_k].contiguous(), v[keep_k].contiguous(), cu_q, cu_k,
                        config=cfg, softmax_scale=scaling)
        full = out.new_zeros(q.shape)
        full[keep_q] = out
        return full, None

    return infllmv2_attention_forward


def register(config=None, name: str = NAME) -> None:
    """Registers ``name`` with transformers' attention and mask interfaces. ``config``: the
    ``SparseConfig`` (or sparse_config dict) for models whose config has no ``sparse_config``."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as e:
        raise ImportError("infllmv2.hf.register needs transformers >= 5 (pip install transformers)") from e
    AttentionInterface.register(name, _attention_forward(_config(config)))
    AttentionMaskInterface.register(name, flash_attention_mask)
