"""Draws benchmark results against their baselines and goals as one SVG of horizontal bars.

    python -m bench.chart RESULTS_DIR [--out docs/benchmarks.svg]

RESULTS_DIR holds the JSON files bench/gpu_suite.sh writes (throughput_1b.json, decode_8b.json,
kernels.json, gemv.json, engine_start_8b.json, quantization_8b.json, decode_8b_tp2.json, spec_decode_8b.json);
missing ones are left out. No plotting library: plain SVG."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from html import escape
from pathlib import Path

HF_BASELINE_TOK_S = 912.0  # HF transformers 5.17 generate on the same workload and H200 (issue 3)
LLAMA_8B_LAYERS = 32


@dataclass
class Row:
    title: str
    value: float
    goal: float
    baseline: float | None
    unit: str
    higher_is_better: bool = True


def rows_from(results: Path) -> list[Row]:
    def load(name: str) -> dict | None:
        path = results / name
        return json.loads(path.read_text()) if path.is_file() else None

    rows = []
    if r := load("throughput_1b.json"):
        rows.append(Row("1B throughput, 256 seqs (tok/s)", r["tok_s"], 20_000, HF_BASELINE_TOK_S, "tok/s"))
    if r := load("decode_8b.json"):
        rows.append(Row("8B batch-1 decode, bandwidth used", r["mbu"] * 100, 80, 72, "%"))
    if r := load("kernels.json"):
        rows.append(Row("decode kernel, KV read / copy bandwidth", r["triton_decode"]["fraction_of_copy_bandwidth"] * 100,
                        75, None, "%"))
    if (r := load("kernels.json")) and "graph_replay" in r:
        rows.append(Row("decode kernel vs SDPA, graph replays (x)", r["graph_replay"]["speedup_vs_sdpa"], 1.0, 1.0, "x"))
    if r := load("gemv.json"):
        layers = [x for x in r["results"] if x["dtype"] == "bf16" and x["m"] == 1 and "tp2" not in x["layer"]]
        if layers:  # one token's worth: each decoder-layer shape 32 times, the LM head once
            def per_token(key: str) -> float:
                return sum(x[key] * (1 if x["layer"] == "lm_head" else LLAMA_8B_LAYERS) for x in layers)
            rows.append(Row("8B linear layers of a token, GEMV vs cuBLAS (x)",
                            per_token("baseline_us") / per_token("gemv_us"), 1.0, 1.0, "x"))
    if r := load("engine_start_8b.json"):
        rows.append(Row("8B engine start to first token (s)", r["total_seconds"], 20, None, "s", higher_is_better=False))
    if r := load("quantization_8b.json"):
        rows.append(Row("8B decode, int8 weights vs bf16 (x)", r["int8_speedup"], 1.6, 1.0, "x"))
        rows.append(Row("8B decode, int4 weights vs bf16 (x)", r["int4_speedup"], 2.5, 1.0, "x"))
        rows.append(Row("KV blocks in the same memory, fp8 vs bf16 (x)", r["kv_fp8_block_ratio"], 2.0, 1.0, "x"))
    if (r := load("decode_8b_tp2.json")) and (one := load("decode_8b.json")):
        rows.append(Row("8B decode, 2 GPUs vs 1 (x)", r["decode_tok_s"] / one["decode_tok_s"], 1.6, 1.0, "x"))
    if (r := load("spec_decode_8b.json")) and r.get("upper_bound_speedup") is not None:
        rows.append(Row("8B speculative decode k=4, upper bound (x)", r["upper_bound_speedup"], 1.5, 1.0, "x"))
    return rows


def svg(rows: list[Row], width: int = 760) -> str:
    left, bar_w, row_h = 300, width - 300 - 90, 46
    height = 40 + row_h * len(rows)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           'font-size="12">',
           '<text x="10" y="20" font-size="14" font-weight="bold">Tollgate engine on H200s '
           '(bar: measured; black tick: goal; grey tick: baseline)</text>']
    for i, row in enumerate(rows):
        y = 36 + i * row_h
        scale = bar_w / max(row.value, row.goal, row.baseline or 0) / 1.05
        met = row.value >= row.goal if row.higher_is_better else row.value <= row.goal
        colour = "#2e7d32" if met else "#c62828"
        out.append(f'<text x="10" y="{y + 18}">{escape(row.title)}</text>')
        out.append(f'<rect x="{left}" y="{y + 6}" width="{row.value * scale:.1f}" height="18" fill="{colour}"/>')
        shown = f"{row.value:,.0f}" if row.value >= 100 else f"{row.value:.3f}" if row.unit == "x" else f"{row.value:.3g}"
        out.append(f'<text x="{left + row.value * scale + 6:.1f}" y="{y + 20}">{shown} {row.unit}</text>')
        out.append(f'<line x1="{left + row.goal * scale:.1f}" x2="{left + row.goal * scale:.1f}" y1="{y + 2}" '
                   f'y2="{y + 28}" stroke="black" stroke-width="2"/>')
        if row.baseline is not None:
            out.append(f'<line x1="{left + row.baseline * scale:.1f}" x2="{left + row.baseline * scale:.1f}" '
                       f'y1="{y + 2}" y2="{y + 28}" stroke="#888" stroke-width="2"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/benchmarks.svg"))
    args = p.parse_args(argv)
    rows = rows_from(args.results)
    if not rows:
        raise SystemExit(f"{args.results}: no benchmark JSON files found")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(svg(rows))
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
