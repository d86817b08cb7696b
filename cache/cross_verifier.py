"""Second-stage verifier: all-MiniLM-L6-v2 read as a cross-encoder over the two prompts together.

A bi-encoder compares two independent vectors; reading both questions in one pass lets attention
see that "200" faces "300" or that one side says "not". Adapters and head: cache/cross_lora.npz,
trained by bench/finetune_cross.py. Same interface as cache.verifier.Verifier (score_pairs,
threshold, min_cosine) so SemanticCache can use either.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np


from cache.guards import different_question
from cache.lora import apply_lora

DEFAULT_CROSS = Path(__file__).with_name("cross_lora.npz")
MAX_PAIR_TOKENS = 128


class CrossVerifier:
    def __init__(self, path: Path | str = DEFAULT_CROSS, model_dir: Path | None = None, device: str = "cpu",
                 max_candidates: int = 2) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        from cache.embedder import ensure_model_dir

        directory = str(model_dir or ensure_model_dir())
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.model = AutoModel.from_pretrained(directory).float().to(device).eval()
        apply_lora(self.model, path)
        with np.load(path, allow_pickle=False) as z:
            self.head_w = torch.from_numpy(z["head_w"].astype(np.float32)).to(device)
            self.head_b = float(z["head_b"])
            self.threshold = float(z["threshold"]) if "threshold" in z.files else 0.5
            self.min_cosine = float(z["min_cosine"]) if "min_cosine" in z.files else 0.5
            self.meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
        self.device = device
        # Only the nearest few candidates are read by the cross-encoder; it costs a forward pass each.
        self.max_candidates = max_candidates
        self._lock = threading.Lock()

    def logits(self, texts_a: list[str], texts_b: list[str]) -> np.ndarray:
        import torch

        batch = self.tokenizer(texts_a, texts_b, padding=True, truncation=True, max_length=MAX_PAIR_TOKENS,
                               return_tensors="pt").to(self.device)
        with self._lock, torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            return (pooled @ self.head_w + self.head_b).float().cpu().numpy()

    def score_pairs(self, texts_a: list[str], texts_b: list[str], ea: np.ndarray, eb: np.ndarray) -> np.ndarray:
        cos = np.sum(np.atleast_2d(ea) * np.atleast_2d(eb), axis=1)
        probs = np.zeros(len(texts_a), dtype=np.float32)
        order = np.argsort(-cos)
        todo = [int(i) for i in order[: self.max_candidates]
                if cos[i] >= self.min_cosine and different_question(texts_a[i], texts_b[i]) is None]
        if todo:
            z = self.logits([texts_a[i] for i in todo], [texts_b[i] for i in todo])
            probs[todo] = 1.0 / (1.0 + np.exp(-z))
        return probs
