"""PHSA helpers (seed phsa-paper.txt): the punctuation token set of a vocabulary, and the per-token
mask that ``compress_keys`` / ``select_blocks`` / ``attention`` / ``InfLLMv2Attention`` take as
``punct_mask``.

The rule, the paper's ``P = {p in V | P(Z(p)) = 1}``: a token is punctuation when its decoded
text ``Z(p)``, with surrounding whitespace removed, is non-empty and every character in it is a
punctuation mark. So ",", " ,", ".", "...", "?!", "，", "。" and "」" are punctuation tokens;
"a,", "12", "$" (a symbol, category Sc) and bare whitespace are not. Punctuation marks are the
Unicode categories P* by default (English and CJK alike: the paper found Chinese marks help
Chinese tasks); ``punctuation`` narrows or replaces the set (e.g. ``string.punctuation`` for
ASCII marks, as the paper first trained) and ``extra`` adds characters.

Decoding: a tokenizer object decodes its own tokens (``convert_tokens_to_string``, else
``decode``), so byte-level BPE ("Ġ,", "ï¼Į" for "，") and SentencePiece ("▁.", "<0x2C>") tokens
are read as the text they produce. For a plain ``{token: id}`` mapping the vocabulary's style is
guessed: byte-level BPE when some token holds "Ġ" and none "▁" (each token decoded through
GPT-2's byte alphabet; a token that is not whole UTF-8, part of a character, is no
punctuation), else SentencePiece-like ("▁" read as a space).
"""

from __future__ import annotations

import functools
import unicodedata
from typing import Callable, Iterable, Mapping

import torch

__all__ = ["is_punctuation_text", "punctuation_token_ids", "punctuation_table", "punctuation_mask"]


def _predicate(punctuation, extra) -> Callable[[str], bool]:
    if punctuation is None:
        base = lambda ch: unicodedata.category(ch).startswith("P")  # noqa: E731
    elif callable(punctuation):
        base = punctuation
    elif isinstance(punctuation, Iterable):
        chars = set(punctuation)
        if not all(isinstance(c, str) and len(c) == 1 for c in chars):
            raise ValueError("punctuation must be None, a callable or a string / iterable of single characters")
        base = chars.__contains__
    else:
        raise ValueError("punctuation must be None, a callable or a string of characters, "
                         f"got {type(punctuation).__name__}")
    extra = set(extra)
    return (lambda ch: ch in extra or base(ch)) if extra else base


def is_punctuation_text(text: str, punctuation=None, extra: Iterable[str] = ()) -> bool:
    """Whether ``text`` is non-empty after stripping whitespace and consists of punctuation only
    (``punctuation`` / ``extra`` as in ``punctuation_token_ids``)."""
    is_punct = _predicate(punctuation, extra)
    text = text.strip()
    return bool(text) and all(is_punct(ch) for ch in text)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _byte_level_text(token: str) -> str:
    table = _byte_decoder()
    if not all(ch in table for ch in token):
        return token  # an added or special token, stored as text
    try:
        return bytes(table[ch] for ch in token).decode("utf-8")
    except UnicodeDecodeError:
        return ""  # part of a multi-byte character: no punctuation of its own


def _decoder(tokenizer):
    """token, id -> text, with the tokenizer's own decoding where it has one."""
    def decode(token, token_id):
        for fn in (lambda: tokenizer.convert_tokens_to_string([token]), lambda: tokenizer.decode([token_id])):
            try:
                text = fn()
            except Exception:  # tokenizers differ in what they offer and in what they refuse
                continue
            if isinstance(text, str):
                return text
        return token

    return decode


def punctuation_token_ids(tokenizer_or_vocab, punctuation=None, extra: Iterable[str] = ()) -> torch.Tensor:
    """Sorted int64 ids of the punctuation tokens of a vocabulary (the module docstring has the rule).

    ``tokenizer_or_vocab``: a ``{token: id}`` mapping, or a tokenizer with ``get_vocab()``
    (Hugging Face and the like). ``punctuation``: None for Unicode P*, a string / iterable of
    the characters that count, or a predicate ``char -> bool``. ``extra``: characters that count
    as well (e.g. "$" or "~", which Unicode files as symbols)."""
    is_punct = _predicate(punctuation, extra)
    if isinstance(tokenizer_or_vocab, Mapping):
        vocab = tokenizer_or_vocab
        byte_level = any("\u0120" in t for t in vocab) and not any("\u2581" in t for t in vocab)
        decode = (lambda t, i: _byte_level_text(t)) if byte_level else (lambda t, i: t.replace("\u2581", " "))
    elif callable(getattr(tokenizer_or_vocab, "get_vocab", None)):
        vocab, decode = tokenizer_or_vocab.get_vocab(), _decoder(tokenizer_or_vocab)
    else:
        raise ValueError("tokenizer_or_vocab must be a {token: id} mapping or a tokenizer with get_vocab(), "
                         f"got {type(tokenizer_or_vocab).__name__}")
    ids = set()
    for token, token_id in vocab.items():
        text = decode(token, int(token_id)).strip()
        if text and all(is_punct(ch) for ch in text):
            ids.add(int(token_id))
    return torch.tensor(sorted(ids), dtype=torch.int64)


def punctuation_table(punct_ids, device=None) -> torch.Tensor:
    """Bool lookup table of ``punct_ids`` (non-negative token ids): entry ``i`` is whether id ``i`` is
    punctuation, for ``i`` up to the largest id, and one last entry False for every other id.
    ``punctuation_mask`` builds it each call; a caller that masks every forward (a decoding loop)
    builds it once and passes it as ``table``."""
    ids = torch.as_tensor(punct_ids if isinstance(punct_ids, torch.Tensor) else list(punct_ids), dtype=torch.long)
    if ids.is_floating_point() or (ids.numel() and int(ids.min()) < 0):
        raise ValueError("punct_ids must be non-negative integer token ids")
    table = torch.zeros(int(ids.max()) + 2 if ids.numel() else 1, dtype=torch.bool)
    table[ids.flatten()] = True
    return table.to(device) if device is not None else table


def punctuation_mask(input_ids: torch.Tensor, punct_ids=None, table=None) -> torch.Tensor:
    """Bool mask of ``input_ids``' shape and device: which tokens are in ``punct_ids`` (a tensor or
    list of ids), or are marked in ``table`` (``punctuation_table``'s, on their device). For the
    varlen layout pass the packed ids ``(total_k,)``; for the padded one ``(B, S)``.

    A lookup, two kernels and no host synchronisation: ``torch.isin`` sorts when the ids are few
    against the punctuation set (a decoding step's one token), and the sort reads sizes back to the
    host (about 80 us of GPU time and two synchronisations a step on an H200). Given
    ``punct_ids``, each call builds the table again (a host-to-device copy): for repeated calls,
    such as decoding steps, build it once with ``punctuation_table`` and pass ``table``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex() \
            or input_ids.dtype == torch.bool:
        got = getattr(input_ids, "dtype", type(input_ids).__name__)
        raise ValueError(f"input_ids must be an integer tensor, got {got}")
    if (punct_ids is None) == (table is None):
        raise ValueError("pass punct_ids or a punctuation_table, not both or neither")
    if table is None:
        table = punctuation_table(punct_ids, input_ids.device)
    elif not isinstance(table, torch.Tensor) or table.dtype != torch.bool or table.dim() != 1 \
            or table.device != input_ids.device:
        raise ValueError(f"table must be a punctuation_table on input_ids' device ({input_ids.device})")
    # every id past the table, or negative, reads its last entry: False
    return table[input_ids.clamp(-1, table.numel() - 1)]
