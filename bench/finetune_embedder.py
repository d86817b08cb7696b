"""Fine-tune all-MiniLM-L6-v2 with low-rank adapters jointly with the verifier head, on QQP.

    python bench/finetune_embedder.py [--device cuda] [--dev]

Writes cache/embedder_lora.npz (the adapters' factors) and cache/verifier.npz (the head over
cache.features, with its threshold). Same split, exclusions and seed as bench/train_verifier.py:
the dev pairs and every pair sharing a question with them are never seen. Pair classification
(BCE) on [cos, |a-b|, a*b, lexical] trains the adapters and the head together; the threshold is
then set on the calibration split with the serving code path (numpy Verifier, hard rules).
A GPU makes this a few minutes; on CPU it takes hours.
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

from bench.train_verifier import SEED, load_pairs, rates, split, threshold_at  # noqa: E402
from cache.features import lexical_features  # noqa: E402
from cache.lora import DEFAULT_LORA  # noqa: E402
from cache.verifier import DEFAULT_ARTIFACT, Verifier  # noqa: E402
from tollgate import envs  # noqa: E402

TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")


def add_adapters(model, rank: int, alpha: float):
    import torch

    class LoRALinear(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.A = torch.nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
            self.B = torch.nn.Parameter(torch.zeros(base.out_features, rank))
            self.scale = alpha / rank

        def forward(self, x):
            return self.base(x) + (x @ self.A.T @ self.B.T) * self.scale

    adapted = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and full.endswith(TARGETS):
                wrapper = LoRALinear(child)
                setattr(module, child_name, wrapper)
                adapted[full] = wrapper
    for p in model.parameters():
        p.requires_grad_(False)
    for w in adapted.values():
        w.A.requires_grad_(True)
        w.B.requires_grad_(True)
    return adapted


def main(argv: list[str] | None = None) -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    from cache.embedder import ensure_model_dir

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--target-fpr", type=float, default=0.008)
    ap.add_argument("--lora-out", type=Path, default=DEFAULT_LORA)
    ap.add_argument("--verifier-out", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--emb-out", type=Path, default=None, help="also save the QQP embeddings (int8) here")
    ap.add_argument("--dev", action="store_true")
    ap.add_argument("--limit", type=int, default=0, help="smoke test: use only this many pairs of each split")
    ap.add_argument("--calibrate-only", action="store_true", help="reuse --lora-out and --verifier-out as they are")
    args = ap.parse_args(argv)
    if args.calibrate_only:
        qqp, dev = load_pairs()
        _, calib, _ = split(qqp, dev, 0.2)
        calib = calib[: args.limit] if args.limit else calib
        calibrate(args, str(envs.get("TOLLGATE_MINILM_DIR") or ensure_model_dir()), calib, dev, time.time())
        return
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    t0 = time.time()
    qqp, dev = load_pairs()
    train, calib, dropped = split(qqp, dev, 0.2)
    if args.limit:
        train, calib = train[: args.limit], calib[: args.limit]
    model_dir = str(envs.get("TOLLGATE_MINILM_DIR") or ensure_model_dir())
    st = SentenceTransformer(model_dir, device=args.device).float()
    bert = st[0].auto_model
    adapted = add_adapters(bert, args.rank, 2.0 * args.rank)
    st.to(args.device)

    def embed(texts: list[str], grad: bool):
        feats = st.tokenize(texts)
        feats = {k: v.to(args.device) for k, v in feats.items() if isinstance(v, torch.Tensor)}
        with torch.set_grad_enabled(grad):
            out = st(feats)["sentence_embedding"]
        return torch.nn.functional.normalize(out, dim=-1)

    def pair_tensor(ea, eb, lex):
        cos = (ea * eb).sum(-1, keepdim=True)
        return torch.cat([cos, (ea - eb).abs(), ea * eb, lex], dim=-1)

    lex_train = torch.from_numpy(np.stack([lexical_features(p["text_a"], p["text_b"]) for p in train])).to(args.device)
    y_train = torch.tensor([float(p["label"]) for p in train], device=args.device)
    # Fixed input normalisation from the base model's features on a sample.
    st.eval()
    sample = np.random.default_rng(SEED).choice(len(train), min(4000, len(train)), replace=False)
    with torch.no_grad():
        fs = pair_tensor(embed([train[i]["text_a"] for i in sample], False),
                         embed([train[i]["text_b"] for i in sample], False), lex_train[sample])
    mean, scale = fs.mean(0), fs.std(0) + 1e-6
    dim = fs.shape[1]
    head = torch.nn.Sequential(torch.nn.Linear(dim, args.hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(args.hidden, 1)).to(args.device)
    lora_params = [p for w in adapted.values() for p in (w.A, w.B)]
    opt = torch.optim.AdamW([{"params": lora_params, "lr": args.lr}, {"params": head.parameters(), "lr": 1e-3}],
                            weight_decay=1e-2)
    steps = args.epochs * ((len(train) + args.batch - 1) // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[args.lr, 1e-3], total_steps=steps, pct_start=0.1)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    gen = torch.Generator().manual_seed(SEED)
    for epoch in range(args.epochs):
        st.train()
        head.train()
        perm = torch.randperm(len(train), generator=gen).tolist()
        total = 0.0
        for i in range(0, len(perm), args.batch):
            idx = perm[i : i + args.batch]
            ea = embed([train[j]["text_a"] for j in idx], True)
            eb = embed([train[j]["text_b"] for j in idx], True)
            x = (pair_tensor(ea, eb, lex_train[idx]) - mean) / scale
            loss = loss_fn(head(x)[:, 0], y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        print(f"epoch {epoch}: loss {total / len(train):.4f} ({time.time() - t0:.0f}s)", flush=True)

    arrays = {"scale": np.array(2.0)}
    for name, w in adapted.items():
        arrays[f"{name}.A"] = w.A.detach().cpu().numpy().astype(np.float16)
        arrays[f"{name}.B"] = w.B.detach().cpu().numpy().astype(np.float16)
    np.savez_compressed(args.lora_out, **arrays)
    linears = [m for m in head if isinstance(m, torch.nn.Linear)]
    layers = [(m.weight.detach().cpu().numpy().T.copy(), m.bias.detach().cpu().numpy().copy()) for m in linears]
    meta = {"seed": SEED, "hidden": args.hidden, "epochs": args.epochs, "rank": args.rank, "lr": args.lr,
            "target_fpr": args.target_fpr, "train_pairs": len(train), "calib_pairs": len(calib),
            "excluded_pairs": dropped, "embedder": "all-MiniLM-L6-v2 + cache/embedder_lora.npz"}
    verifier = Verifier(layers, mean.cpu().numpy(), scale.cpu().numpy(), 0.5, 0.5, meta)

    verifier.save(args.verifier_out)
    calibrate(args, model_dir, calib, dev, t0)


def calibrate(args, model_dir: str, calib: list[dict], dev: list[dict], t0: float) -> None:
    """Serving path from here: merged weights, numpy verifier."""
    from cache.embedder import Embedder

    verifier = Verifier.load(args.verifier_out)
    meta = verifier.meta
    emb = Embedder(Path(model_dir), device=args.device, lora=args.lora_out)
    ca = [p["text_a"] for p in calib]
    cb = [p["text_b"] for p in calib]
    va, vb = emb.encode(ca, batch_size=256), emb.encode(cb, batch_size=256)
    cy = np.array([p["label"] for p in calib])
    probs = verifier.score_pairs(ca, cb, va, vb)
    verifier.threshold = threshold_at(probs[cy == 0], args.target_fpr)
    ccos = np.sum(va * vb, axis=1)
    meta["threshold"] = verifier.threshold
    meta["calib"] = rates(probs, cy, verifier.threshold)
    meta["calib_tuned_cosine_at_same_fpr"] = rates(ccos, cy, threshold_at(ccos[cy == 0], args.target_fpr))
    verifier.meta = meta
    verifier.save(args.verifier_out)
    report = dict(meta)
    if args.dev:
        da, db = [p["a"] for p in dev], [p["b"] for p in dev]
        dp = verifier.score_pairs(da, db, emb.encode(da), emb.encode(db))
        report["dev"] = rates(dp, np.array([int(p["duplicate"]) for p in dev]), verifier.threshold)
    if args.emb_out is not None:
        from bench.qqp_embeddings import qqp_sentences

        v = emb.encode(qqp_sentences(), batch_size=512)
        sc = np.abs(v).max(axis=1, keepdims=True) / 127.0
        np.save(args.emb_out / "qqp_scale.npy", sc.astype(np.float32))
        for i, part in enumerate(np.array_split(np.round(v / sc).astype(np.int8), 3)):
            np.save(args.emb_out / f"qqp_int8_{i}.npy", part)
    report["seconds"] = round(time.time() - t0, 1)
    report["artifact_bytes"] = {"lora": args.lora_out.stat().st_size, "verifier": args.verifier_out.stat().st_size}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
