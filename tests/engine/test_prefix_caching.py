"""A request sharing a cached prefix prefills only its new tokens, and its output does not change."""

from engine import LLM, EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

SHARED = (
    "You are a careful assistant for a logistics company. Answer in one short sentence. The warehouse in Lyon "
    "ships parcels on weekdays before noon; the warehouse in Porto ships on Mondays and Thursdays; express parcels "
    "leave from Lyon only; parcels above twenty kilograms need a pallet and a booking made two days ahead. "
    "Customs papers for parcels leaving the European Union are printed by the sender and attached in a clear "
    "pouch; lithium batteries, perfume and aerosols travel by road only and never by air. Returns are accepted "
    "within thirty days when the parcel is unopened and the label from the original shipment is kept. "
)


def test_shared_prefix_is_not_recomputed(smollm2):
    engine = smollm2.engine
    params = SamplingParams(temperature=0, max_tokens=12)
    first = smollm2.generate(SHARED + "When does Porto ship?", params)[0]
    second = smollm2.generate(SHARED + "Can an express parcel leave from Porto?", params)[0]
    shared_len = len(smollm2.tokenizer.encode(SHARED))
    assert shared_len >= 100
    block = engine.config.block_size
    assert second.metrics.num_cached_tokens >= (shared_len // block - 1) * block
    assert second.metrics.num_cached_tokens % block == 0
    assert second.metrics.num_computed_prompt_tokens == len(second.prompt_token_ids) - second.metrics.num_cached_tokens
    assert first.metrics.num_computed_prompt_tokens == len(first.prompt_token_ids)

    engine.kv.enable_prefix_caching = False
    try:
        again = smollm2.generate(SHARED + "Can an express parcel leave from Porto?", params)[0]
    finally:
        engine.kv.enable_prefix_caching = True
    assert again.metrics.num_cached_tokens == 0
    assert again.metrics.num_computed_prompt_tokens == len(again.prompt_token_ids)
    assert again.outputs[0].token_ids == second.outputs[0].token_ids


def test_cached_blocks_are_reused_after_release_and_evicted_lru(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, num_kv_blocks=12, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 66))  # 4 full blocks + 1 token
    cold = llm.generate(prompt, params)[0]
    warm = llm.generate(prompt, params)[0]
    assert cold.metrics.num_cached_tokens == 0
    assert warm.metrics.num_cached_tokens == 64
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    # other prompts fill the pool; the least recently released blocks are evicted first
    for start in (100, 170):
        llm.generate(list(range(start, start + 65)), params)
    evicted = llm.generate(prompt, params)[0]
    assert evicted.metrics.num_cached_tokens < 64
    assert evicted.outputs[0].token_ids == cold.outputs[0].token_ids
    assert llm.engine.kv.num_used_blocks == 0


def test_a_salt_keeps_prefix_blocks_to_requests_with_the_same_salt(tiny_llama_dir):
    """vLLM's cache_salt: the gateway salts each tenant's requests, so one tenant never reuses (and so never
    learns about) blocks another tenant's prompt left in the cache; outputs are the same either way."""
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=32, block_size=16))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(1, 66))  # 4 full blocks + 1 token

    def run(request_id: str, salt: str | None):  # type: ignore[no-untyped-def]
        engine.add_request(request_id, prompt, params, stream=False, cache_salt=salt)
        while True:
            for out in engine.step():
                if out.finished and out.request_id == request_id:
                    return out

    a = run("a1", "tenant-a")
    assert a.metrics.num_cached_tokens == 0
    assert run("a2", "tenant-a").metrics.num_cached_tokens == 64  # within a tenant: a hit
    b = run("b1", "tenant-b")
    assert b.metrics.num_cached_tokens == 0  # another tenant: as if the prefix were new
    assert run("n1", None).metrics.num_cached_tokens == 0  # unsalted requests do not see salted blocks
    assert run("n2", None).metrics.num_cached_tokens == 64
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert engine.kv.num_used_blocks == 0
