"""The serving benchmark's figures, computed as `vllm bench serve` computes them, and its chart."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    """One request as its client saw it (times in seconds from when it was sent)."""

    ok: bool
    output_tokens: int = 0  # what the engine reported (usage), checked against the length asked
    expected_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between successive chunks after the first
    request_id: str | None = None
    error: str | None = None
    end_wall: float | None = None  # time.time() when it finished: the run lasts until the last one does


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))]


def distribution(values: list[float]) -> dict[str, float | None]:
    ms = [v * 1000 for v in values]
    return {"mean": statistics.fmean(ms) if ms else None, "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99)}


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done
             if r.e2e is not None and r.ttft is not None and r.output_tokens > 1]
    good = [r for r in done
            if (slo_ttft_ms is None or (r.ttft is not None and r.ttft * 1000 <= slo_ttft_ms))
            and (slo_tpot_ms is None or r.output_tokens <= 1
                 or (r.e2e - r.ttft) / (r.output_tokens - 1) * 1000 <= slo_tpot_ms)]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "short": sum(1 for r in done if r.output_tokens != r.expected_tokens),
        "duration_s": duration_s,
        "output_tokens": tokens,
        "request_throughput": len(done) / duration_s if duration_s else None,
        "output_tok_s": tokens / duration_s if duration_s else None,
        "goodput_req_s": len(good) / duration_s if duration_s and (slo_ttft_ms or slo_tpot_ms) else None,
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([gap for r in done for gap in r.itls]),
        "e2e_ms": distribution([r.e2e for r in done if r.e2e is not None]),
    }


class Progress:
    """One line on stderr, rewritten at most twice a second: requests done and output tokens/s so far."""

    def __init__(self, label: str, total: int, start: float | None = None) -> None:
        """`start`: the perf_counter time the run's clock starts (now when not given)."""
        self.label, self.total, self.done, self.tokens = label, total, 0, 0
        self._shown = time.perf_counter()
        self.start = self._shown if start is None else start

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.perf_counter()
        # a terminal gets the line rewritten; a log (not a terminal) only the finished line
        if (sys.stderr.isatty() and now - self._shown >= 0.5) or self.done == self.total:
            self._shown = now
            rate = self.tokens / max(now - self.start, 1e-9)
            bar = "#" * (30 * self.done // max(self.total, 1))
            print(f"\r{self.label:>24} [{bar:<30}] {self.done}/{self.total} {rate:,.0f} tok/s",
                  end="" if sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)
            if self.done == self.total and sys.stderr.isatty():
                print(file=sys.stderr)


COLORS = {"async": "#1f77b4", "http": "#d62728", "offline": "#2ca02c"}


def tick_label(value: float) -> str:
    """An axis value with the digits that tell ticks apart: 2.9 and 1.45, not 3 and 1; whole numbers from 100 up."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def latency_chart(runs: list[dict[str, Any]], width: int = 760) -> str:
    """SVG: TTFT and TPOT p50 (solid) and p99 (dashed) against request rate, one colour per target."""
    rates = sorted({r["rate"] for r in runs}, key=lambda x: float("inf") if x == "inf" else float(x))
    panels = [("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)")]
    panel_w, height, pad = (width - 60) // 2, 300, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 40}" '
             'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    for p, (key, title) in enumerate(panels):
        x0 = 40 + p * (panel_w + 20)
        values = [r[key][q] for r in runs for q in ("p50", "p99") if r.get(key) and r[key].get(q) is not None]
        top = max(values, default=1.0) * 1.1 or 1.0

        def xy(rate: Any, value: float) -> tuple[float, float]:
            i = rates.index(rate)
            x = x0 + pad / 2 + (panel_w - pad) * (i / max(len(rates) - 1, 1))
            return x, 20 + (height - 40) * (1 - value / top)

        parts.append(f'<text x="{x0 + panel_w / 2}" y="14" text-anchor="middle" font-weight="bold">{title}</text>')
        parts.append(f'<line x1="{x0}" y1="{height - 20}" x2="{x0 + panel_w}" y2="{height - 20}" stroke="#999"/>')
        for rate in rates:
            x, _ = xy(rate, 0)
            parts.append(f'<text x="{x}" y="{height - 5}" text-anchor="middle">{rate} req/s</text>')
        parts.append(f'<line x1="{x0}" y1="20" x2="{x0}" y2="{height - 20}" stroke="#999"/>')
        for frac in (0.0, 0.5, 1.0):
            y = 20 + (height - 40) * (1 - frac / 1.1)
            parts.append(f'<text x="{x0 - 2}" y="{y}" text-anchor="end">{tick_label(top / 1.1 * frac)}</text>')
        for target in sorted({r["target"] for r in runs}):
            for q, dash in (("p50", ""), ("p99", ' stroke-dasharray="4 3"')):
                pts = [xy(r["rate"], r[key][q]) for r in runs
                       if r["target"] == target and r.get(key) and r[key].get(q) is not None]
                if pts:
                    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
                    parts.append(f'<polyline points="{path}" fill="none" stroke="{COLORS.get(target, "#555")}" '
                                 f'stroke-width="2"{dash}/>')
    for i, target in enumerate(sorted({r["target"] for r in runs})):
        parts.append(f'<text x="{50 + i * 260}" y="{height + 30}" fill="{COLORS.get(target, "#555")}">'
                     f'{target} (solid p50, dashed p99)</text>')
    parts.append("</svg>")
    return "\n".join(parts)
