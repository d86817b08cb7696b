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
    # HF greedy decoding picks argmax(logits) at every position given the tokens before it, so the engine's tokens
    # equal HF generate's exactly when HF's argmax at each position is the engine's next token: one teacher-forced
    # forward of every sequence at once (right-padded, so no real token attends to a pad or changes its position)
    seqs = [out.prompt_token_ids + out.outputs[0].token_ids for out in outs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        argmax = smollm2_hf(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    for out, row in zip(outs, argmax):
        n, got = len(out.prompt_token_ids), out.outputs[0].token_ids
        if out.outputs[0].finish_reason != "stop":  # a stop is the EOS token, the last of token_ids, checked below
            assert len(got) == 32
        assert got == row[n - 1:n - 1 + len(got)].tolist(), out.prompt
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
