"""Train the semantic cache's same-question verifier on QQP and write cache/verifier.npz.

    .venv/bin/python bench/train_verifier.py [--hidden 256] [--target-fpr 0.008] [--dev]

Reproducible: fixed seed, deterministic split. The dev pairs of paraphrase_dev.jsonl and every
pair that shares a question with them are excluded. The remaining pairs are split by connected
component of the question graph (so no calibration question was seen in training); the threshold
is the one that lets through `--target-fpr` of the calibration negatives. `--dev` also prints the
dev figures (use it only once the model is chosen).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Running `python bench/x.py` puts bench/ first on sys.path, where bench/cache.py would shadow
# the cache package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))

from cache.features import pair_features  # noqa: E402
from cache.verifier import DEFAULT_ARTIFACT, Verifier  # noqa: E402
from bench.qqp_embeddings import DATA, embed_texts, qqp_sentences  # noqa: E402
from bench.question_groups import question_groups  # noqa: E402

SEED = 20241129


def norm(text: str) -> str:
    return " ".join(text.lower().split())


def load_pairs() -> tuple[list[dict], list[dict]]:
    qqp = json.loads((DATA / "qqp_pairs.json").read_text())
    dev = [json.loads(line) for line in (DATA / "paraphrase_dev.jsonl").read_text().splitlines() if line]
    return qqp, dev


def split(qqp: list[dict], dev: list[dict], calib_fraction: float) -> tuple[list[dict], list[dict], int]:
    dev_questions = {norm(p["a"]) for p in dev} | {norm(p["b"]) for p in dev}
    kept = [p for p in qqp if norm(p["text_a"]) not in dev_questions and norm(p["text_b"]) not in dev_questions]
    root = question_groups(kept, key=norm)
    roots = sorted(set(root.values()))
    rng = np.random.default_rng(SEED)
    calib_roots = set(np.array(roots)[rng.random(len(roots)) < calib_fraction].tolist())
    train = [p for p in kept if root[norm(p["text_a"])] not in calib_roots]
    calib = [p for p in kept if root[norm(p["text_a"])] in calib_roots]
    return train, calib, len(qqp) - len(kept)


def featurize(pairs: list[dict], lookup: dict[str, int], vecs: np.ndarray, ka: str, kb: str):
    a = [p[ka] for p in pairs]
    b = [p[kb] for p in pairs]
    ea = vecs[[lookup[t] for t in a]]
    eb = vecs[[lookup[t] for t in b]]
    return a, b, ea, eb


def train_mlp(x: np.ndarray, y: np.ndarray, hidden: int, epochs: int) -> list[tuple[np.ndarray, np.ndarray]]:
    import torch

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    dims = [x.shape[1]] + ([hidden] if hidden else []) + [1]
    mods: list[torch.nn.Module] = []
    for i in range(len(dims) - 1):
        mods.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            mods += [torch.nn.ReLU(), torch.nn.Dropout(0.2)]
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y.astype(np.float32))
    gen = torch.Generator().manual_seed(SEED)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        for i in range(0, len(xt), 256):
            idx = perm[i : i + 256]
            opt.zero_grad()
            loss = loss_fn(model(xt[idx])[:, 0], yt[idx])
            loss.backward()
            opt.step()
        sched.step()
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()) for m in linears]


def threshold_at(neg_scores: np.ndarray, fpr: float) -> float:
    # Smallest threshold letting through at most `fpr` of the negatives.
    s = np.sort(neg_scores)[::-1]
    allowed = int(np.floor(fpr * len(s)))
    return float(np.nextafter(s[allowed], np.float32(2.0))) if allowed < len(s) else 0.0


def rates(probs: np.ndarray, labels: np.ndarray, threshold: float) -> dict[str, float]:
    hit = probs >= threshold
    return {
        "hit_rate": float(hit[labels == 1].mean()),
        "false_hit_rate": float(hit[labels == 0].mean()),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256, help="0: logistic regression")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--target-fpr", type=float, default=0.008)
    ap.add_argument("--calib-fraction", type=float, default=0.2)
    ap.add_argument("--out", type=Path, default=DEFAULT_ARTIFACT)
    ap.add_argument("--dev", action="store_true", help="also report the dev figures")
    args = ap.parse_args(argv)
    t0 = time.time()
    qqp, dev = load_pairs()
    train, calib, dropped = split(qqp, dev, args.calib_fraction)
    sentences = qqp_sentences()
    vecs = embed_texts(sentences, "qqp")
    lookup = {s: i for i, s in enumerate(sentences)}
    tr = featurize(train, lookup, vecs, "text_a", "text_b")
    # Both orders: the verifier must not care which prompt came first.
    x = np.concatenate([pair_features(*tr), pair_features(tr[1], tr[0], tr[3], tr[2])])
    y = np.array([p["label"] for p in train] * 2, dtype=np.int64)
    mean = x.mean(axis=0)
    scale = x.std(axis=0) + 1e-6
    layers = train_mlp((x - mean) / scale, y, args.hidden, args.epochs)
    meta = {
        "seed": SEED, "hidden": args.hidden, "epochs": args.epochs, "target_fpr": args.target_fpr,
        "train_pairs": len(train), "calib_pairs": len(calib), "excluded_pairs": dropped,
    }
    verifier = Verifier(layers, mean.astype(np.float32), scale.astype(np.float32), 0.5, 0.5, meta)
    ca = featurize(calib, lookup, vecs, "text_a", "text_b")
    cy = np.array([p["label"] for p in calib])
    cprobs = verifier.score_pairs(*ca)
    verifier.threshold = threshold_at(cprobs[cy == 0], args.target_fpr)
    ccos = np.sum(ca[2] * ca[3], axis=1)
    meta["calib"] = rates(cprobs, cy, verifier.threshold)
    meta["calib_cosine_at_same_fpr"] = rates(ccos, cy, threshold_at(ccos[cy == 0], args.target_fpr))
    meta["calib_cosine_0.8"] = rates(ccos, cy, 0.8)
    meta["threshold"] = verifier.threshold
    verifier.meta = meta
    verifier.save(args.out)
    report = dict(meta)
    if args.dev:
        dev_vecs = embed_texts([p["a"] for p in dev] + [p["b"] for p in dev], "dev")
        n = len(dev)
        dprobs = verifier.score_pairs([p["a"] for p in dev], [p["b"] for p in dev], dev_vecs[:n], dev_vecs[n:])
        report["dev"] = rates(dprobs, np.array([int(p["duplicate"]) for p in dev]), verifier.threshold)
    report["seconds"] = round(time.time() - t0, 1)
    report["artifact_bytes"] = args.out.stat().st_size
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
