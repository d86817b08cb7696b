"""The engine on a real model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers on the same file."""

import torch

from engine import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "def fibonacci(n):",
    "Here is a list of three fruits:",
    "The three laws of thermodynamics can be summarised as follows. First,",
    "Q: What is 12 times 12?\nA:",
    "In 1969, the Apollo 11 mission",
    "Photosynthesis is the process by which plants convert sunlight, water and carbon dioxide into glucose and oxygen. "
    "The light-dependent reactions take place in the thylakoid membranes, where",
    "My favourite recipe for a rainy day is",
]


def test_greedy_batch_equals_hf_generate(smollm2, smollm2_hf):
    tok = smollm2.tokenizer
    assert len({len(tok.encode(p)) for p in PROMPTS}) >= 8  # different lengths
    # max_num_batched_tokens=64 (fixture): the longer prompts are prefilled in chunks beside running decodes
    outs = smollm2.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32))
    assert smollm2.engine.metrics.num_steps > 32  # one continuous batch, not one request at a time
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = smollm2_hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False)
        ref_tokens = ref[0, ids.shape[1]:].tolist()
        got = out.outputs[0].token_ids
        if out.outputs[0].finish_reason == "stop":  # EOS: HF pads after it
            ref_tokens = ref_tokens[: len(got)]
        else:
            assert len(got) == 32
        assert got == ref_tokens, out.prompt
        assert out.outputs[0].text == tok.decode(got)


def test_chat_template_and_stop_string(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    stopped = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]))[0]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == "Paris"
    assert "Paris" not in stopped.outputs[0].text
    assert out.outputs[0].text.startswith(stopped.outputs[0].text)
