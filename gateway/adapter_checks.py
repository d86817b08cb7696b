"""Whether a model can serve a LoRA adapter directory, checked in the gateway before anything is recorded: on Ray
Serve the model may have no replica running to ask (scaled to zero), and a bad adapter must never leave a row that
every later replica would try to load."""

from __future__ import annotations

from gateway.specs import ModelSpec, engine_config


class AdapterRefused(ValueError):
    """`field` is the request field the problem is about (model or source)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_adapter(spec: ModelSpec, name: str, source: str) -> None:
    """Reads the adapter as the engine will (its config, every tensor's shape against the base model, its rank against
    max_lora_rank); AdapterRefused naming the field otherwise. Blocking: call it off the event loop."""
    import torch

    from engine.loader import read_model_config
    from engine.lora.adapter import load_adapter

    config = engine_config(spec)
    if config.max_loras == 0:
        raise AdapterRefused("model", f"model: `{spec.name}` takes no LoRA adapters: its spec sets no engine.max_loras "
                                      "(set it, e.g. `engine: {max_loras: 4}`, and deploy the spec again)")
    try:
        base = read_model_config(spec.source)
    except ValueError as e:
        raise AdapterRefused("model", f"model: `{spec.name}`'s weights cannot be read here ({e})") from None
    try:
        load_adapter(source, name, base, config.max_lora_rank, torch.float32)
    except ValueError as e:
        message = str(e).removeprefix("lora_path: ")  # the engine's name for what a spec calls `source`
        raise AdapterRefused("source", message if message.startswith("source") else f"source: {message}") from None
