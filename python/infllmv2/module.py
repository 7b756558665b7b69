"""InfLLMv2Attention: the attention of one layer as an nn.Module (no weights: the same
parameters serve the dense and the sparse path)."""

from __future__ import annotations

import torch

from .attention import _config, attention, attention_padded


class InfLLMv2Attention(torch.nn.Module):
    """``forward(q, k, v)`` in the padded layout ``(B, S, H, D)``, or in the varlen layout
    ``(total, H, D)`` with ``cu_seqlens_q`` and ``cu_seqlens_k`` (and optionally
    ``max_seqlen_q/k``); ``punct_mask`` (bool, ``(B, Sk)`` or ``(total_k,)``) switches the
    compression to PHSA. ``config``: a ``SparseConfig`` or a ``sparse_config`` dict."""

    def __init__(self, config=None, softmax_scale=None):
        super().__init__()
        self.config = _config(config)
        self.softmax_scale = softmax_scale

    def forward(self, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                punct_mask=None):
        if cu_seqlens_q is None and cu_seqlens_k is None:
            if max_seqlen_q is not None or max_seqlen_k is not None:
                raise ValueError("max_seqlen_q/max_seqlen_k go with cu_seqlens_q/cu_seqlens_k (the varlen layout)")
            return attention_padded(q, k, v, self.config, self.softmax_scale, punct_mask)
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("the varlen layout needs both cu_seqlens_q and cu_seqlens_k")
        return attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, self.config,
                         self.softmax_scale, punct_mask)

    def extra_repr(self) -> str:
        c = self.config
        return (f"kernel={c.kernel_size}/{c.kernel_stride}, block={c.block_size}, init_blocks={c.init_blocks}, "
                f"window={c.window_size}, topk={c.topk} (K={c.num_selected}), dense_len={c.dense_len}, "
                f"normaliser={'coarse ' + str(c.norm_kernel_size) + '/' + str(c.norm_kernel_stride) if c.approx_lse else 'exact'}"
                + (f", softmax_scale={self.softmax_scale}" if self.softmax_scale is not None else ""))
