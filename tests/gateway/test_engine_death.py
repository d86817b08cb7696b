"""A model whose engine core process dies is unavailable (503 naming why), not a 500, and the gateway serves on."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine import SamplingParams
from gateway.backends import BackendUnavailable, GenerationRequest, LocalEngineBackend
from gateway.specs import ModelSpec


def test_a_dead_engine_core_makes_its_model_unavailable_with_the_reason():
    spec = ModelSpec.model_validate({"name": "tiny", "source": "random:llama-tiny", "size": "small", "tasks": ["chat"],
                                     "engine": {"device": "cpu", "engine_core": "process", "num_kv_blocks": 32}})
    backend = LocalEngineBackend(spec)

    async def main() -> None:
        await backend.start()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        chunks = [c async for c in backend.generate(GenerationRequest("ok", params, prompt=[1, 2, 3]))]
        assert chunks[-1].finished and chunks[-1].completion_tokens == 4
        os.kill(backend.engine.core._process.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)
        with pytest.raises(BackendUnavailable, match="engine stopped"):
            async for _ in backend.generate(GenerationRequest("after", params, prompt=[1, 2, 3])):
                pass
        info = backend.info()
        assert info.state == "unavailable" and "engine stopped" in (info.reason or "")

    try:
        asyncio.run(main())
    finally:
        backend.stop()
