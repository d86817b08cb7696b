import copy
import json
import os

import pytest

from engine.tokenizer import Tokenizer
from tests.engine.helpers import smollm2_tokenizer

SMOLLM2_CHAT_HI = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                   "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_round_trip_and_specials():
    tok = smollm2_tokenizer()
    text = "Hello, world! Crème brûlée in 東京 costs 5€ 🙂\n  indented"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids  # SmolLM2 adds no BOS
    assert tok.vocab_size == 49152
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2 and im_end in tok.eos_token_ids
    assert tok.bos_token_id == 1
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.decode([ids[0], im_end]) == tok.decode([ids[0]])
    assert tok.decode([ids[0], im_end], skip_special_tokens=False).endswith("<|im_end|>")


def test_smollm2_chat_template_matches_transformers():
    tok = smollm2_tokenizer()
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages)
    assert rendered == tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == SMOLLM2_CHAT_HI
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_a_speaker_name_is_written_before_the_content_when_the_template_has_no_place_for_it():
    tok = smollm2_tokenizer()
    named = tok.apply_chat_template([{"role": "user", "content": "Hi", "name": "bob"}])
    assert named == SMOLLM2_CHAT_HI.replace("user\nHi", "user\nbob: Hi")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi", "name": ""}]) == SMOLLM2_CHAT_HI


@pytest.mark.parametrize("reads_name", ["{{ message.name }}", "{{ message['name'] }}", '{{ msg["name"] }}'])
def test_a_template_that_reads_the_name_gets_it_unchanged(reads_name):
    loop = "msg" if "msg" in reads_name else "message"
    hf = copy.deepcopy(smollm2_tokenizer().hf)
    hf.chat_template = f"{{% for {loop} in messages %}}{reads_name}|{{{{ {loop}['content'] }}}};{{% endfor %}}"
    assert Tokenizer(hf).apply_chat_template([{"role": "user", "content": "Hi", "name": "bob"}]) == "bob|Hi;"


@pytest.mark.parametrize("messages", [[], "Hi", ["Hi"], [{"role": "user"}], [{"role": 1, "content": "x"}],
                                      [{"role": "user", "content": None}]])
def test_malformed_messages_raise(messages):
    with pytest.raises(ValueError, match="messages"):
        smollm2_tokenizer().apply_chat_template(messages)


def test_directory_tokenizer_reads_generation_eos(tmp_path):
    tok = smollm2_tokenizer()
    tok.hf.save_pretrained(str(tmp_path))
    with open(os.path.join(tmp_path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 0]}, f)
    loaded = Tokenizer.from_source(str(tmp_path))
    assert loaded is not None and loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.encode("café 🙂") == tok.encode("café 🙂")
    assert loaded.apply_chat_template([{"role": "user", "content": "Hi"}]) == SMOLLM2_CHAT_HI


def test_missing_tokenizer_and_missing_template(tmp_path):
    assert Tokenizer.from_source(str(tmp_path)) is None
    with pytest.raises(ValueError, match="nowhere"):
        Tokenizer.from_source(str(tmp_path / "nowhere"))
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    bare = Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw))
    with pytest.raises(ValueError, match="chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "a"}])
    assert bare.eos_token_ids == frozenset() and bare.bos_token_id is None


def test_gguf_tokenizer_conversion_is_kept_on_disk(tmp_path, monkeypatch):
    from engine import tokenizer as tokenizer_module
    from tests.engine.helpers import smollm2_gguf_path

    path = smollm2_gguf_path()
    monkeypatch.setenv("TOLLGATE_MODEL_CACHE_DIR", str(tmp_path))
    tokenizer_module._gguf_tokenizer.cache_clear()
    converted = Tokenizer.from_source(path)
    saved = list((tmp_path / "tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer.json").is_file()
    tokenizer_module._gguf_tokenizer.cache_clear()
    reloaded = Tokenizer.from_source(path)  # from the saved folder this time
    text = "日本語 🙂 café — the quick brown fox"
    messages = [{"role": "user", "content": "Hi"}]
    assert reloaded.encode(text) == converted.encode(text)
    assert reloaded.apply_chat_template(messages) == converted.apply_chat_template(messages)
    assert reloaded.eos_token_ids == converted.eos_token_ids and reloaded.bos_token_id == converted.bos_token_id
    tokenizer_module._gguf_tokenizer.cache_clear()
