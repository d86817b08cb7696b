"""Train the cross-encoder verifier (cache/cross_lora.npz): MiniLM adapters + a linear head.

    python bench/finetune_cross.py [--epochs 3] [--dev]

Same split, exclusions and seed as bench/train_verifier.py (dev pairs and every pair sharing a
question with them are never seen). Pairs are read in a random order each time so the score does
not depend on which prompt came first. The threshold is set on the calibration split with the
serving rules: only pairs whose (fine-tuned bi-encoder) cosine reaches min_cosine and whose
numbers agree are read; the rest count as misses. A GPU makes this minutes; CPU takes hours.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from bench.finetune_embedder import add_adapters  # noqa: E402
from bench.train_verifier import SEED, load_pairs, rates, split, threshold_at  # noqa: E402
from cache.cross_verifier import DEFAULT_CROSS, MAX_PAIR_TOKENS, CrossVerifier  # noqa: E402
from cache.features import numbers_differ  # noqa: E402
from tollgate import envs  # noqa: E402


def eligible_probs(cv: CrossVerifier, a: list[str], b: list[str], cos: np.ndarray, batch: int = 256) -> np.ndarray:
    probs = np.zeros(len(a), dtype=np.float32)
    idx = [i for i in range(len(a)) if cos[i] >= cv.min_cosine and not numbers_differ(a[i], b[i])]
    for s in range(0, len(idx), batch):
        part = idx[s : s + batch]
        z = cv.logits([a[i] for i in part], [b[i] for i in part])
        probs[part] = 1.0 / (1.0 + np.exp(-z))
    return probs


def main(argv: list[str] | None = None) -> None:
    import torch
    from transformers import AutoModel, AutoTokenizer

    from cache.embedder import Embedder, ensure_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--min-cosine", type=float, default=0.6)
    ap.add_argument("--target-fpr", type=float, default=0.008)
    ap.add_argument("--out", type=Path, default=DEFAULT_CROSS)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--dev", action="store_true")
    args = ap.parse_args(argv)
    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    t0 = time.time()
    qqp, dev = load_pairs()
    train, calib, dropped = split(qqp, dev, 0.2)
    if args.limit:
        train, calib = train[: args.limit], calib[: args.limit]
    model_dir = str(envs.get("TOLLGATE_MINILM_DIR") or ensure_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    bert = AutoModel.from_pretrained(model_dir).float()
    adapted = add_adapters(bert, args.rank, 2.0 * args.rank)
    bert.to(args.device)
    head = torch.nn.Linear(bert.config.hidden_size, 1).to(args.device)
    lora_params = [p for w in adapted.values() for p in (w.A, w.B)]
    opt = torch.optim.AdamW([{"params": lora_params, "lr": args.lr}, {"params": head.parameters(), "lr": 1e-3}],
                            weight_decay=1e-2)
    steps = args.epochs * ((len(train) + args.batch - 1) // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr, 1e-3], total_steps=steps, pct_start=0.1)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    labels = torch.tensor([float(p["label"]) for p in train], device=args.device)
    for epoch in range(args.epochs):
        bert.train()
        perm = rng.permutation(len(train))
        swap = rng.random(len(train)) < 0.5
        total = 0.0
        for s in range(0, len(perm), args.batch):
            idx = perm[s : s + args.batch]
            a = [train[i]["text_b" if swap[i] else "text_a"] for i in idx]
            b = [train[i]["text_a" if swap[i] else "text_b"] for i in idx]
            batch = tok(a, b, padding=True, truncation=True, max_length=MAX_PAIR_TOKENS, return_tensors="pt").to(args.device)
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=args.device == "cuda"):
                hidden = bert(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden.float() * mask).sum(1) / mask.sum(1)
            loss = loss_fn(head(pooled)[:, 0], labels[torch.as_tensor(idx, device=args.device)])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        print(f"epoch {epoch}: loss {total / len(train):.4f} ({time.time() - t0:.0f}s)", flush=True)

    arrays: dict[str, np.ndarray] = {"scale": np.array(2.0)}
    for name, w in adapted.items():
        arrays[f"{name}.A"] = w.A.detach().cpu().numpy().astype(np.float16)
        arrays[f"{name}.B"] = w.B.detach().cpu().numpy().astype(np.float16)
    arrays["head_w"] = head.weight.detach().cpu().numpy()[0].astype(np.float32)
    arrays["head_b"] = np.array(float(head.bias.detach().cpu().numpy()[0]))
    arrays["min_cosine"] = np.array(args.min_cosine)
    meta = {"seed": SEED, "epochs": args.epochs, "rank": args.rank, "lr": args.lr, "target_fpr": args.target_fpr,
            "min_cosine": args.min_cosine, "train_pairs": len(train), "calib_pairs": len(calib),
            "excluded_pairs": dropped}
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(args.out, **arrays)

    # Calibration through the serving code (merged adapters, CrossVerifier.logits).
    emb = Embedder(Path(model_dir), device=args.device)
    cv = CrossVerifier(args.out, Path(model_dir), device=args.device)
    ca, cb = [p["text_a"] for p in calib], [p["text_b"] for p in calib]
    cos = np.sum(emb.encode(ca, batch_size=256) * emb.encode(cb, batch_size=256), axis=1)
    cy = np.array([p["label"] for p in calib])
    probs = eligible_probs(cv, ca, cb, cos)
    threshold = threshold_at(probs[cy == 0], args.target_fpr)
    meta["threshold"] = threshold
    meta["calib"] = rates(probs, cy, threshold)
    meta["calib_positives_below_min_cosine"] = float((cos[cy == 1] < args.min_cosine).mean())
    report = dict(meta)
    if args.dev:
        da, db = [p["a"] for p in dev], [p["b"] for p in dev]
        dcos = np.sum(emb.encode(da) * emb.encode(db), axis=1)
        report["dev"] = rates(eligible_probs(cv, da, db, dcos), np.array([int(p["duplicate"]) for p in dev]), threshold)
    arrays["threshold"] = np.array(threshold)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(args.out, **arrays)
    report["seconds"] = round(time.time() - t0, 1)
    report["artifact_bytes"] = args.out.stat().st_size
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
