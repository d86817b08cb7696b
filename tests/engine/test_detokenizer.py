import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from tests.engine.helpers import smollm2_tokenizer

TEXT = "日本語 🙂 café"
MIXED = "Héllo wörld! 東京タワー 🙂👍🏽 naïve façade — done."


def _byte_level_tokenizer() -> Tokenizer:
    """One token per byte, so most tokens of non-ASCII text are partial UTF-8 characters."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw = RawTokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw))


def _sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2 style: '▁' marks spaces, the decoder strips the first one, unknown characters fall back to bytes."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", "▁c", "▁ca", "▁d", "▁do"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "c"), ("▁c", "a"), ("▁", "d"), ("▁d", "o")]
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf)


def _windows_only(tok: Tokenizer) -> Tokenizer:
    """A copy of the tokenizer without a streaming decoder, as the detokenizer sees one: it decodes windows."""
    copy = Tokenizer(tok.hf, tok.eos_token_ids)
    copy.decode_stream = lambda skip_special_tokens=True: None  # type: ignore[method-assign]
    return copy


class _DecodeSpans:
    """Wraps a tokenizer's decode to note the most ids one call of it decodes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.longest = 0
        self.decode = tok.decode
        tok.decode = self._counting  # type: ignore[method-assign]

    def _counting(self, token_ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(token_ids))
        return self.decode(token_ids, skip_special_tokens)


def _stream(tok: Tokenizer, ids: list[int], chunk: int, prompt: list[int] | None = None,
            skip_special_tokens: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt or [], skip_special_tokens=skip_special_tokens)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    return pieces, detok


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer, smollm2_tokenizer],
                         ids=["byte-level", "sentencepiece", "smollm2"])
@pytest.mark.parametrize("text", [TEXT, MIXED, " do a cat do"])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("windows", [False, True], ids=["stream", "windows"])
def test_streamed_pieces_add_up_to_the_full_decode(make, text, chunk, windows):
    tok = _windows_only(make()) if windows else make()
    ids = tok.encode(text, add_special_tokens=False)
    pieces, detok = _stream(tok, ids, chunk, prompt=tok.encode("Say:", add_special_tokens=False))
    assert not any("\ufffd" in p for p in pieces), pieces
    assert "".join(pieces) == tok.decode(ids) == detok.text
    if make is not _sentencepiece_tokenizer:
        assert detok.text == text


def test_byte_level_tokens_are_partial_characters_and_are_held_back():
    tok = _byte_level_tokenizer()
    ids = tok.encode("日")
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(ids[:1]) == "" and detok.add(ids[1:2]) == ""
    assert detok.add(ids[2:]) == "日"
    assert detok.finish() == ""


def _reference_token_bytes(tok: Tokenizer, token_id: int) -> bytes:
    """A token's bytes read off its vocabulary entry: GPT-2's byte-to-character table for byte-level BPE, `<0xNN>`
    and '▁' for SentencePiece with byte fallback."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    piece = tok.convert_ids_to_tokens([token_id])[0]
    if "▁" in piece or piece.startswith("<0x"):
        return bytes([int(piece[3:5], 16)]) if piece.startswith("<0x") else piece.replace("▁", " ").encode()
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in piece) if all(c in byte_of for c in piece) else piece.encode()


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer, smollm2_tokenizer],
                         ids=["byte-level", "sentencepiece", "smollm2"])
def test_token_bytes_are_each_tokens_own_bytes_on_random_ids(make):
    import random

    tok = make()
    rng = random.Random(5)
    specials = set(tok.hf.all_special_ids)
    # llguidance marks special tokens with a leading 0xFF, a byte UTF-8 never has: a token that begins with it
    # gives nothing (engine/tokenizer.py token_bytes)
    ids = [i for i in (rng.randrange(tok.vocab_size) for _ in range(400))
           if i not in specials and not _reference_token_bytes(tok, i).startswith(b"\xff")]
    assert [tok.token_bytes([i]) for i in ids] == [_reference_token_bytes(tok, i) for i in ids]
    assert tok.token_bytes(ids) == b"".join(_reference_token_bytes(tok, i) for i in ids)
    assert tok.token_bytes([tok.vocab_size, tok.vocab_size + 7]) == b""


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer, smollm2_tokenizer],
                         ids=["byte-level", "sentencepiece", "smollm2"])
@pytest.mark.parametrize("windows", [False, True], ids=["stream", "windows"])
def test_finish_drops_only_a_character_the_output_ended_inside(make, windows):
    """An output cut inside a character (max_tokens) ends before that character: the text is the bytes up to it,
    whichever tokens held them; every whole character before it stays."""
    tok = _windows_only(make()) if windows else make()
    for text in ["ca é日", "hi 🙂", "a 東京タワー", "naïve 👍🏽"]:
        ids = tok.encode(text, add_special_tokens=False)
        raw = b"".join(_reference_token_bytes(tok, i) for i in ids)
        assert raw.decode().lstrip() == text
        for cut in range(1, len(ids)):
            kept = b"".join(_reference_token_bytes(tok, i) for i in ids[:-cut])
            expected = kept.decode("utf-8", "ignore")
            while expected.encode() != kept[:len(expected.encode())]:
                expected = expected[:-1]
            pieces, detok = _stream(tok, ids[:-cut], 1)
            assert detok.text == "".join(pieces)
            assert detok.text.lstrip() == expected.lstrip(), (text, cut)


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer, smollm2_tokenizer],
                         ids=["byte-level", "sentencepiece", "smollm2"])
@pytest.mark.parametrize("count", [1, 5, 300])
def test_stray_bytes_at_the_end_stay_one_replacement_character_each(make, count):
    """Bytes that cannot begin a character (a lone 0x80, as logit_bias can force) are text the output has: all of
    them stay, at the end as before it."""
    tok = make()
    byte = next(i for i in range(tok.vocab_size) if _reference_token_bytes(tok, i) == b"\x80")
    ids = tok.encode("ok", add_special_tokens=False) + [byte] * count
    pieces, detok = _stream(tok, ids, 1)
    assert detok.text == "".join(pieces) == tok.decode(ids) == "ok" + "\ufffd" * count


def test_sentencepiece_leading_space_and_byte_fallback():
    tok = _sentencepiece_tokenizer()
    ids = tok.encode("ca do é", add_special_tokens=False)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    pieces, detok = _stream(tok, ids, 1)
    assert detok.text == tok.decode(ids) == "ca do é"
    assert pieces[0] == "ca" and " do" in pieces


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(skip):
    tok = smollm2_tokenizer()
    ids = tok.encode("Hi 🙂", add_special_tokens=False) + [2] + tok.encode(" bye", add_special_tokens=False)
    pieces, detok = _stream(tok, ids, 1, skip_special_tokens=skip)
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) == (not skip)


def test_each_step_decodes_a_small_window():
    tok = _windows_only(_byte_level_tokenizer())
    ids = tok.encode(MIXED * 20)
    spans = _DecodeSpans(tok)
    pieces, detok = _stream(tok, ids, 1)
    assert "".join(pieces) == MIXED * 20
    assert spans.longest <= 8


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer, smollm2_tokenizer],
                         ids=["byte-level", "sentencepiece", "smollm2"])
@pytest.mark.parametrize("skip", [True, False])
def test_decode_equals_transformers_decode_on_random_ids(make, skip):
    """Tokenizer.decode calls the Rust tokenizer straight (engine/tokenizer.py _backend): on random ids,
    special tokens included, it gives what transformers' decode gives without its clean-up of spaces."""
    import random

    tok = make()
    assert tok._backend is not None
    rng = random.Random(7)
    specials = sorted(tok.hf.all_special_ids)
    for length in (1, 2, 5, 17, 64):
        for _ in range(20):
            ids = [rng.choice(specials) if specials and rng.random() < 0.1 else rng.randrange(tok.vocab_size)
                   for _ in range(length)]
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), ids


@pytest.mark.parametrize("make", [_byte_level_tokenizer, _sentencepiece_tokenizer, smollm2_tokenizer],
                         ids=["byte-level", "sentencepiece", "smollm2"])
@pytest.mark.parametrize("skip", [True, False])
def test_rust_stream_and_python_windows_give_the_same_pieces_on_random_ids(make, skip):
    """The Rust tokenizer's streaming decoder (one call a token) against the windows decoded in Python, on random
    ids with special tokens and ids past the vocabulary (a model's rows can outnumber its tokenizer's): the same
    piece at every step, adding up to the full decode where that is valid text (random bytes need not be: a
    window's text then need not begin with its context's, where the stream gives way to windows)."""
    import random

    tok, reference = make(), _windows_only(make())
    assert tok.decode_stream() is not None
    rng = random.Random(11)
    specials = sorted(tok.hf.all_special_ids)
    for length in (1, 3, 17, 64):
        for _ in range(15):
            ids = [rng.choice(specials) if specials and rng.random() < 0.1
                   else rng.randrange(tok.vocab_size + (8 if rng.random() < 0.05 else 0)) for _ in range(length)]
            chunk = rng.choice([1, 1, 2, 5])
            pieces, detok = _stream(tok, ids, chunk, skip_special_tokens=skip)
            expected, _ = _stream(reference, ids, chunk, skip_special_tokens=skip)
            assert pieces == expected, ids
            assert "".join(pieces) == detok.text
            full = tok.decode(ids, skip_special_tokens=skip)
            if "\ufffd" not in full:
                assert detok.text == full, ids


@pytest.mark.parametrize("windows", [False, True], ids=["stream", "windows"])
@pytest.mark.parametrize("stray", ["byte", "special"])
def test_a_run_that_never_completes_a_character_costs_a_bounded_window_per_token(windows, stray):
    """A model made to emit a lone continuation byte, or a skipped special token, over and over (logit_bias) never
    completes a character or adds text: the held run goes out every few dozen tokens (engine/detokenizer.py
    MAX_HELD_TOKENS) as decode() has it, so every decode stays short however long the output grows (it was the whole
    run, every step)."""
    tok = _byte_level_tokenizer() if stray == "byte" else smollm2_tokenizer()
    tok = _windows_only(tok) if windows else Tokenizer(tok.hf, tok.eos_token_ids)
    token = tok.encode("é")[1] if stray == "byte" else 2  # 0xA9 alone; SmolLM2's <|im_end|>
    ids = tok.encode("ok ", add_special_tokens=False) + [token] * 2000 + tok.encode(" done", add_special_tokens=False)
    spans = _DecodeSpans(tok)
    held, most_held = 0, 0  # ids the Rust stream holds (it decodes them all at every step)
    make_stream = tok.decode_stream

    def counting_stream(skip_special_tokens=True):
        step = make_stream(skip_special_tokens)
        if step is None:
            return None

        def counted(token_ids):
            nonlocal held, most_held
            held += 1 if isinstance(token_ids, int) else len(token_ids)
            most_held = max(most_held, held)
            piece = step(token_ids)
            held = held if piece is None else 0
            return piece
        return counted

    tok.decode_stream = counting_stream  # type: ignore[method-assign]
    pieces, detok = _stream(tok, ids, 1)
    assert spans.longest <= 100 and most_held <= 100
    assert "".join(pieces) == detok.text == spans.decode(ids)
    assert detok.text.startswith("ok") and detok.text.endswith(" done")
    if stray == "byte":
        assert sum(1 for piece in pieces if piece) >= 20
