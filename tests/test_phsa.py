"""PHSA helpers: the punctuation token set of a vocabulary and the mask compression takes."""

import torch

import infllmv2
from infllmv2 import reference
from infllmv2.phsa import is_punctuation_text, punctuation_mask, punctuation_token_ids
from infllmv2.testing import cu_seqlens, random_tokens

VOCAB = {"To": 0, "Ġbe": 1, ",": 2, "Ġ,": 3, ".": 4, "▁.": 5, "...": 6, "?!": 7, "，": 8, "。": 9, "Ġ": 10, "a,": 11,
         "$": 12, "Ċ": 13, "\"": 14, "12": 15}


def test_rule_on_a_vocab_mapping():
    ids = punctuation_token_ids(VOCAB)
    assert ids.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 14]  # not words, digits, bare whitespace or "a,"
    assert punctuation_token_ids(VOCAB, extra="$").tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 12, 14]
    assert is_punctuation_text(" ; ") and not is_punctuation_text("  ") and not is_punctuation_text("x.")


def test_tokenizer_object_decodes_its_own_tokens():
    class Toy:  # a tokenizer whose tokens are opaque ids and whose decoding gives the text
        def get_vocab(self):
            return {"<0>": 0, "<1>": 1, "<2>": 2}

        def convert_tokens_to_string(self, tokens):
            return {"<0>": "hello", "<1>": " ,", "<2>": "!"}[tokens[0]]

    assert punctuation_token_ids(Toy()).tolist() == [1, 2]


def test_mask_into_compression_and_attention_match_reference():
    ids = torch.randint(0, len(VOCAB), (500,), generator=torch.Generator().manual_seed(0))
    mask = punctuation_mask(ids, punctuation_token_ids(VOCAB))
    assert mask.dtype == torch.bool and mask.sum() > 0 and torch.equal(mask, torch.isin(ids, torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 14])))
    lengths = [300, 200]
    k = random_tokens(lengths, 2, 16, torch.float64, seed=1)
    cu = cu_seqlens(lengths)
    ck, cu_c = infllmv2.compress_keys(k, cu, punct_mask=mask, phsa_lambda=0.3)
    want, want_cu = reference.compress_keys(k, cu, punct_mask=mask, phsa_lambda=0.3)
    assert torch.equal(cu_c, want_cu) and torch.allclose(ck, want)
    q = random_tokens(lengths, 4, 16, torch.float64, seed=2)
    cfg = infllmv2.SparseConfig(dense_len=100, window_size=64, topk=2, phsa_lambda=0.3)
    out = infllmv2.attention(q, k, k, cu, cu, config=cfg, punct_mask=mask)
    ref = reference.attention(q, k, k, cu, cu, dense_len=100, topk=3, local_blocks=1, punct_mask=mask,
                              phsa_lambda=0.3)[0]
    assert torch.allclose(out, ref)
