"""LoRA adapters served over one base model: PEFT adapters loaded from disk (adapter.py), kept in host memory
(registry.py) and in a pool of device slots (slot_pool.py), applied beside the base projections (projection.py) to
the tokens of each step that ask for them (batch.py); manager.py is what the engine holds."""
