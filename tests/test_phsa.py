"""PHSA helpers: the punctuation token set of a vocabulary and the mask compression takes."""

import string

import pytest
import torch

import infllmv2
from infllmv2 import reference
from infllmv2.phsa import is_punctuation_text, punctuation_mask, punctuation_token_ids
from infllmv2.testing import cu_seqlens, random_tokens

# GPT-2 byte-level BPE spelling: "Ġ" a space, "Ċ" a newline, "ï¼Į" the bytes of "，", "ãĢĤ" of "。"
BYTE_LEVEL = {"To": 0, "Ġbe": 1, ",": 2, "Ġ,": 3, ".": 4, "...": 5, "?!": 6, "ï¼Į": 7, "ãĢĤ": 8, "Ġ": 9,
              "a,": 10, "$": 11, "Ċ": 12, '"': 13, "12": 14, "ï¼": 15, "ĠÂ¿": 16, "<|endoftext|>": 17}
BYTE_LEVEL_PUNCT = [2, 3, 4, 5, 6, 7, 8, 13, 16]  # not words, digits, "$", whitespace, half a "，" or "a,"
SENTENCEPIECE = {"▁To": 0, "▁be": 1, ",": 2, "▁,": 3, "▁...": 4, "，": 5, "。": 6, "▁": 7, "」": 8, "▁$": 9,
                 "ï": 10}


def test_rule_on_vocab_mappings():
    assert punctuation_token_ids(BYTE_LEVEL).tolist() == BYTE_LEVEL_PUNCT
    assert punctuation_token_ids(SENTENCEPIECE).tolist() == [2, 3, 4, 5, 6, 8]
    ids = punctuation_token_ids(SENTENCEPIECE, extra="$")
    assert ids.dtype == torch.int64 and ids.tolist() == [2, 3, 4, 5, 6, 8, 9]
    # ASCII marks only, as the paper first trained: no "，" or "。", and "$" is in string.punctuation
    assert punctuation_token_ids(BYTE_LEVEL, punctuation=string.punctuation).tolist() == [2, 3, 4, 5, 6, 11, 13]
    assert punctuation_token_ids(SENTENCEPIECE, punctuation=lambda ch: ch in "。，").tolist() == [5, 6]
    assert is_punctuation_text(" ; ") and not is_punctuation_text("  ") and not is_punctuation_text("x.")
    with pytest.raises(ValueError, match="punctuation must be"):
        punctuation_token_ids(BYTE_LEVEL, punctuation=["..."])
    with pytest.raises(ValueError, match="tokenizer_or_vocab must be"):
        punctuation_token_ids([",", "."])


def test_tokenizer_object_decodes_its_own_tokens():
    class Toy:  # opaque token strings: only the tokenizer knows their text
        def get_vocab(self):
            return {"<0>": 0, "<1>": 1, "<2>": 2, "<3>": 3}

        def convert_tokens_to_string(self, tokens):
            if tokens[0] == "<3>":
                raise KeyError(tokens[0])  # falls back to decode
            return {"<0>": "hello", "<1>": " ,", "<2>": "!"}[tokens[0]]

        def decode(self, ids):
            return "。"

    assert punctuation_token_ids(Toy()).tolist() == [1, 2, 3]


def test_hugging_face_byte_level_tokenizer_agrees_with_its_vocab_mapping():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    corpus = ["To be, or not to be, that is the question.", "你好，世界。", "Wait... what?! «Oui» ¿Qué?"] * 10
    bpe.train_from_iterator(corpus, tokenizers.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)
    ids = punctuation_token_ids(tok)
    assert ids.tolist() == punctuation_token_ids(tok.get_vocab()).tolist()
    text = "To be, or not to be, that is the question. 你好，世界。"
    enc = torch.tensor(tok(text)["input_ids"])
    marked = [tok.decode([int(i)]) for i in enc[punctuation_mask(enc, ids)]]
    assert marked == [",", ",", ".", "，", "。"]


def test_mask_shapes_and_inputs():
    ids = torch.tensor([[0, 2, 3], [7, 1, 8]])
    want = torch.tensor([[False, True, True], [True, False, True]])
    assert torch.equal(punctuation_mask(ids, punctuation_token_ids(BYTE_LEVEL)), want)
    assert torch.equal(punctuation_mask(ids.flatten().int(), BYTE_LEVEL_PUNCT), want.flatten())
    assert not punctuation_mask(ids, []).any()
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        punctuation_mask(ids.float(), BYTE_LEVEL_PUNCT)
    # the lookup against torch.isin, ids past the table and negative ones included
    punct = torch.tensor([0, 5, 17, 42, 99])
    wide = torch.arange(-3, 130).reshape(7, 19)
    table = infllmv2.phsa.punctuation_table(punct)
    for got in (punctuation_mask(wide, punct), punctuation_mask(wide, table=table),
                punctuation_mask(wide, [99, 0, 5, 17, 42, 5])):
        assert torch.equal(got, torch.isin(wide, punct))
    with pytest.raises(ValueError, match="punct_ids must be non-negative"):
        infllmv2.phsa.punctuation_table([3, -1])
    with pytest.raises(ValueError, match="not both or neither"):
        punctuation_mask(ids)
    with pytest.raises(ValueError, match="table must be a punctuation_table"):
        punctuation_mask(ids, table=table.int())


def test_mask_into_compression_and_attention_match_reference():
    lengths = [600, 300]
    ids = torch.randint(0, len(BYTE_LEVEL), (sum(lengths),), generator=torch.Generator().manual_seed(0))
    mask = punctuation_mask(ids, punctuation_token_ids(BYTE_LEVEL))
    assert mask.dtype == torch.bool and 0 < mask.sum() < mask.numel()
    k = random_tokens(lengths, 2, 16, torch.float32, seed=1)
    cu = cu_seqlens(lengths)
    ck, cu_c = infllmv2.compress_keys(k, cu, punct_mask=mask, phsa_lambda=0.3)
    want, want_cu = reference.compress_keys(k, cu, punct_mask=mask, phsa_lambda=0.3)
    assert torch.equal(cu_c, want_cu)
    torch.testing.assert_close(ck, want)
    assert not torch.allclose(ck, infllmv2.compress_keys(k, cu)[0])  # PHSA changes the block representation
    q, v = random_tokens(lengths, 4, 16, torch.float32, seed=2), random_tokens(lengths, 2, 16, torch.float32, seed=3)
    cfg = infllmv2.SparseConfig(dense_len=256, window_size=64, topk=3, phsa_lambda=0.3)
    out = infllmv2.attention(q, k, v, cu, cu, config=cfg, punct_mask=mask)
    ref = reference.attention(q, k, v, cu, cu, dense_len=256, topk=4, local_blocks=1, punct_mask=mask,
                              phsa_lambda=0.3)[0]
    torch.testing.assert_close(out, ref)
