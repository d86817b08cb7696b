"""Token bytes read off the vocabulary (engine/vocab_bytes.py) against llguidance's view of it, and the end of an
output that stops inside a character, which reads its held tokens' bytes on the engine thread without that view."""

from __future__ import annotations

import random

import pytest

import engine.tokenizer as tokenizer_module
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer, _llguidance_view
from engine.vocab_bytes import BYTE_FALLBACK, BYTE_LEVEL, vocabulary_encoding
from tests.engine.helpers import smollm2_tokenizer
from tests.engine.test_detokenizer import _byte_level_tokenizer, _sentencepiece_tokenizer

TOKENIZERS = [(_byte_level_tokenizer, BYTE_LEVEL), (_sentencepiece_tokenizer, BYTE_FALLBACK),
              (smollm2_tokenizer, BYTE_LEVEL)]
IDS = ["byte-level", "sentencepiece", "smollm2"]


@pytest.mark.parametrize("make, encoding", TOKENIZERS, ids=IDS)
def test_vocabulary_bytes_equal_llguidances_view_on_random_ids(make, encoding):
    tok = make()
    assert vocabulary_encoding(tok.hf) == encoding
    view = _llguidance_view(tok.hf, min(tok.eos_token_ids, default=0))
    added = set(tok.hf.added_tokens_decoder)
    rng = random.Random(11)
    ids = [i for i in (rng.randrange(tok.vocab_size) for _ in range(2000)) if i not in added]
    assert len(ids) > 1500
    for i in ids:
        own = tok.token_bytes([i])
        expected = view.decode_bytes([i])
        if expected == b"" and own == b"\xff":  # llguidance marks its special tokens with 0xFF: its own 0xFF is empty
            continue
        assert own == expected, (i, tok.convert_ids_to_tokens([i]))
    assert tok.token_bytes(ids[:50]) == b"".join(view.decode_bytes([i]) for i in ids[:50])
    assert tok.token_bytes([tok.vocab_size + 3]) == b""


@pytest.mark.parametrize("make, encoding", TOKENIZERS, ids=IDS)
def test_an_output_cut_inside_a_character_ends_without_building_the_vocabulary_view(make, encoding, monkeypatch):
    """The held tokens' bytes come off the vocabulary: llguidance's view (0.3 s and more on the engine thread,
    stalling every stream) is never built for them."""
    def no_view(*args):
        raise AssertionError("llguidance's view was built")

    monkeypatch.setattr(tokenizer_module, "_llguidance_view", no_view)
    tok = make()
    ids = tok.encode("ok 東京", add_special_tokens=False)
    for cut in range(1, len(ids)):
        detok = IncrementalDetokenizer(tok, [])
        for t in ids[:-cut]:
            detok.add_token(t)
        text = detok.text + detok.finish()
        assert "\ufffd" not in text and "ok 東京".startswith(text.lstrip()), (cut, text)
    assert tok.knows_token_bytes


def test_a_tokenizer_of_another_encoding_takes_the_general_path():
    """WordPiece (BERT's): not read off the vocabulary; llguidance cannot read it either, so decode()'s text."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "caf": 1, "##é": 2, "東": 3, "##京": 4}
    raw = RawTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    tok = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]"))
    assert vocabulary_encoding(tok.hf) is None
    assert not tok.knows_token_bytes
    assert tok.token_bytes(tok.encode("café 東京", add_special_tokens=False)) == "café 東京".encode()
