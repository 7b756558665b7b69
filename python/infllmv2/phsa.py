"""PHSA helpers (../shared/seeds/phsa-paper.txt): the punctuation token set of a vocabulary, and
the per-token mask that ``compress_keys`` / ``select_blocks`` / ``attention`` take as
``punct_mask``.

Rule (the paper's P(Z(p))): a token is punctuation when its decoded text, with surrounding
whitespace removed, is non-empty and every character is punctuation: Unicode category P*
(so ",", ".", "，", "。", "...", "?!") or one of ``extra``. Byte-level BPE and SentencePiece
markers ("Ġ", "▁", "Ċ") count as whitespace when a token cannot be decoded.
"""

from __future__ import annotations

import unicodedata
from typing import Iterable, Mapping

import torch

_MARKERS = {"\u0120": " ", "\u2581": " ", "\u010a": "\n", "\u0109": "\t"}  # Ġ ▁ Ċ ĉ


def is_punctuation_text(text: str, extra: Iterable[str] = ()) -> bool:
    """Whether ``text`` is non-empty after stripping whitespace and consists of punctuation only."""
    extra = set(extra)
    text = text.strip()
    return bool(text) and all(unicodedata.category(ch).startswith("P") or ch in extra for ch in text)


def _token_text(tokenizer, token: str, token_id: int) -> str:
    if tokenizer is not None:
        for decode in (lambda: tokenizer.convert_tokens_to_string([token]), lambda: tokenizer.decode([token_id])):
            try:
                text = decode()
            except Exception:  # tokenizers differ in what they offer; fall back to the raw token
                continue
            if isinstance(text, str):
                return text
    return "".join(_MARKERS.get(ch, ch) for ch in token)


def punctuation_token_ids(tokenizer_or_vocab, extra: Iterable[str] = ()) -> torch.Tensor:
    """Sorted int64 ids of the punctuation tokens of a vocabulary.

    ``tokenizer_or_vocab``: a ``{token: id}`` mapping, or a tokenizer with ``get_vocab()`` (Hugging
    Face and the like), whose own decoding is used to read each token's text. ``extra``: more
    characters to count as punctuation (e.g. symbols of category S* such as "$")."""
    if isinstance(tokenizer_or_vocab, Mapping):
        tokenizer, vocab = None, tokenizer_or_vocab
    elif hasattr(tokenizer_or_vocab, "get_vocab"):
        tokenizer, vocab = tokenizer_or_vocab, tokenizer_or_vocab.get_vocab()
    else:
        raise ValueError("tokenizer_or_vocab must be a {token: id} mapping or a tokenizer with get_vocab(), "
                         f"got {type(tokenizer_or_vocab).__name__}")
    extra = tuple(extra)
    ids = sorted(int(i) for tok, i in vocab.items() if is_punctuation_text(_token_text(tokenizer, tok, int(i)), extra))
    return torch.tensor(ids, dtype=torch.int64)


def punctuation_mask(input_ids: torch.Tensor, punct_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask of ``input_ids``' shape: which tokens are in ``punct_ids``. For the varlen layout
    pass the packed ids ``(total_k,)``; for the padded one ``(B, S)``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point():
        raise ValueError("input_ids must be an integer tensor")
    if not isinstance(punct_ids, torch.Tensor):
        punct_ids = torch.as_tensor(list(punct_ids), dtype=torch.int64)
    return torch.isin(input_ids, punct_ids.to(device=input_ids.device, dtype=input_ids.dtype))
