"""LLM: offline batch generation, as in vLLM: `LLM(model, **config_fields).generate(prompts, params)`."""

from __future__ import annotations

import sys
from collections.abc import Sequence as SequenceOf
from typing import Any

from engine.config import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

Prompt = str | SequenceOf[int]


class LLM:
    def __init__(self, model: str, **config_fields: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **config_fields))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stops tensor-parallel worker processes; a single-process LLM holds nothing that needs closing."""
        self.engine.close()

    def sleep(self, level: int = 1) -> None:
        """LLMEngine.sleep: the device memory back (level 1 keeps the weights on the host, level 2 drops them)."""
        self.engine.sleep(level)

    def wake(self) -> float:
        """LLMEngine.wake; the seconds it took. generate() on a sleeping LLM wakes it first."""
        return self.engine.wake()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_lora(self, name: str, path: str) -> None:
        """Serves the PEFT adapter directory `path` as `name` (needs max_loras > 0)."""
        self.engine.add_lora(name, path)

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        priorities: SequenceOf[int] | None = None,
        use_tqdm: bool = False,
        lora_name: str | SequenceOf[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs all prompts in one continuous batch; returns their finished outputs in order. `lora_name`: the
        adapter (add_lora) of every prompt, or one per prompt (None: the base model).
        A bad prompt raises ValueError before anything runs."""
        batch = self._as_prompt_list(prompts)
        param_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(batch)
        if len(param_list) != len(batch):
            raise ValueError(f"params: {len(param_list)} given for {len(batch)} prompts")
        loras = list(lora_name) if isinstance(lora_name, (list, tuple)) else [lora_name] * len(batch)
        if len(loras) != len(batch):
            raise ValueError(f"lora_name: {len(loras)} given for {len(batch)} prompts")
        for prompt, name in zip(batch, loras):  # validate everything before queueing anything
            self.engine.encode_prompt(prompt)
            self.engine.resolve_lora(name)
        self.engine.wake()
        ids = []
        for i, (prompt, p) in enumerate(zip(batch, param_list)):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            self.engine.add_request(request_id, prompt, p, priority=priorities[i] if priorities else 0, stream=False,
                                    lora_name=loras[i])
            ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        progress = _Progress(len(ids)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if progress:
                        progress.update(sum(len(c.token_ids) for c in out.outputs))
        if progress:
            progress.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages_list: SequenceOf[SequenceOf[dict]] | SequenceOf[dict],
        params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if self.tokenizer is None:
            raise ValueError("messages: this model has no tokenizer or chat template")
        conversations = [messages_list] if messages_list and isinstance(messages_list[0], dict) else messages_list
        prompts = [self.tokenizer.apply_chat_template(list(m), add_generation_prompt=True) for m in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts: Prompt | SequenceOf[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        return prompts


class _Progress:
    """A one-line progress report on stderr: requests done and output tokens/s."""

    def __init__(self, total: int) -> None:
        import time

        self._time = time.perf_counter
        self.total, self.done, self.tokens, self.start = total, 0, 0, self._time()

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        elapsed = max(self._time() - self.start, 1e-9)
        sys.stderr.write(f"\rgenerate: {self.done}/{self.total} requests, {self.tokens / elapsed:,.0f} output tok/s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
