"""InfLLMv2Attention: the attention of one layer as an nn.Module (no weights: the same
parameters serve the dense and the sparse path)."""

from __future__ import annotations

import math
from typing import Mapping

import torch

from .attention import SparseConfig, _config, attention, attention_padded


class InfLLMv2Attention(torch.nn.Module):
    """InfLLM-V2 attention given q, k, v (bottom-right causal; no projections).

    ``config``: a ``SparseConfig``, a ``sparse_config`` dict (MiniCPM4.1's keys) or None for
    the defaults. ``softmax_scale``: None for ``1/sqrt(head_dim)``.

    ``forward(q, k, v)`` in the padded layout ``q (B, Sq, Hq, D)``, ``k, v (B, Sk, Hk, D)``,
    ``punct_mask (B, Sk)``; or, with ``cu_seqlens_q`` and ``cu_seqlens_k``, in the varlen layout
    ``q (total_q, Hq, D)``, ``k, v (total_k, Hk, D)``, ``punct_mask (total_k,)``, where
    ``max_seqlen_q/k`` spare a host read of the offsets. A ``punct_mask`` switches compression to
    PHSA (``infllmv2.phsa``). Returns ``out`` shaped like ``q`` (and the fp32 LSE with
    ``return_lse``) as ``infllmv2.attention`` / ``attention_padded``.
    """

    def __init__(self, config: SparseConfig | Mapping | None = None, softmax_scale: float | None = None):
        super().__init__()
        if config is not None and not isinstance(config, (SparseConfig, Mapping)):
            raise ValueError(f"config must be a SparseConfig, a sparse_config dict or None, got {type(config).__name__}")
        scale = softmax_scale
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"softmax_scale must be None or a finite number > 0, got {softmax_scale!r}")
        self.config = _config(config)
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)

    def forward(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                punct_mask=None, return_lse=False):
        if cu_seqlens_q is None and cu_seqlens_k is None:
            if max_seqlen_q is not None or max_seqlen_k is not None:
                raise ValueError("max_seqlen_q/max_seqlen_k go with cu_seqlens_q/cu_seqlens_k (the varlen layout)")
            return attention_padded(q, k, v, self.config, self.softmax_scale, punct_mask, return_lse)
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("the varlen layout needs both cu_seqlens_q and cu_seqlens_k")
        return attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, self.config,
                         self.softmax_scale, punct_mask, return_lse)

    def extra_repr(self) -> str:
        c = self.config
        norm = f"coarse {c.norm_kernel_size}/{c.norm_kernel_stride}" if c.approx_lse else "exact"
        scale = "" if self.softmax_scale is None else f", softmax_scale={self.softmax_scale:g}"
        return (f"kernel={c.kernel_size}/{c.kernel_stride}, block={c.block_size}, init_blocks={c.init_blocks}, "
                f"window={c.window_size}, topk={c.topk} (K={c.num_selected}), dense_len={c.dense_len}, "
                f"lse={norm}, phsa_lambda={c.phsa_lambda:g}{scale}")
