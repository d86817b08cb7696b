"""bench/load.py's run as an SVG over time: completed requests/s (with 429/503 answers) above, latency
p50/p99 and streaming TTFT p50 below, in buckets by the time each request ended. Plain SVG, like
bench/chart.py."""

from __future__ import annotations

from html import escape
from typing import Any

WIDTH, PANEL_H, LEFT, RIGHT, TOP = 760, 170, 60, 20, 66


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def buckets(results: list[Any], duration_s: float, bucket_s: float) -> list[dict[str, Any]]:
    n = max(1, int(duration_s // bucket_s) + (duration_s % bucket_s > 0))
    out = [{"t": (i + 0.5) * bucket_s, "ok": [], "later": 0, "ttft": []} for i in range(n)]
    for r in results:
        b = out[min(n - 1, int(r.end // bucket_s))]
        if r.status == 200:
            b["ok"].append(r.latency_s)
            if r.ttft_s is not None:
                b["ttft"].append(r.ttft_s)
        elif r.status in (429, 503):
            b["later"] += 1
    return [{"t": b["t"], "rps": len(b["ok"]) / bucket_s, "later_rps": b["later"] / bucket_s,
             "p50": _pct(b["ok"], 0.5), "p99": _pct(b["ok"], 0.99), "ttft": _pct(b["ttft"], 0.5)} for b in out]


def load_svg(results: list[Any], duration_s: float, report: dict[str, Any], bucket_s: float = 5.0) -> str:
    rows = buckets(results, duration_s, bucket_s)
    span = len(rows) * bucket_s  # the x axis covers whole buckets
    plot_w = WIDTH - LEFT - RIGHT
    height = TOP + 2 * PANEL_H + 40 + 24
    x = lambda t: LEFT + plot_w * t / span  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" '
           'font-size="11">',
           f'<text x="10" y="18" font-size="14" font-weight="bold">Tollgate under load: '
           f'{report["requests_per_s"]:.2f} req/s, p50 {report["latency_p50_s"]} s, p99 {report["latency_p99_s"]} s, '
           f'TTFT p50 {report["ttft_p50_s"]} s</text>',
           f'<text x="10" y="34" fill="#555">{escape(_subtitle(report))}</text>']
    rps_max = max([r["rps"] + r["later_rps"] for r in rows] + [0.1])
    out += _panel(TOP, "requests/s (green: completed, orange: 429/503)", rps_max, span, x)
    for r in rows:
        y0 = TOP + PANEL_H
        w = plot_w * bucket_s / span * 0.8
        h_ok, h_later = PANEL_H * r["rps"] / rps_max, PANEL_H * r["later_rps"] / rps_max
        out.append(f'<rect x="{x(r["t"]) - w / 2:.1f}" y="{y0 - h_ok:.1f}" width="{w:.1f}" height="{h_ok:.1f}" '
                   'fill="#2e7d32"/>')
        if h_later:
            out.append(f'<rect x="{x(r["t"]) - w / 2:.1f}" y="{y0 - h_ok - h_later:.1f}" width="{w:.1f}" '
                       f'height="{h_later:.1f}" fill="#ef6c00"/>')
    top2 = TOP + PANEL_H + 40
    lat_max = max([v for r in rows for v in (r["p50"], r["p99"], r["ttft"]) if v is not None] + [0.1])
    out += _panel(top2, "seconds (blue: latency p50, red: p99, grey: stream TTFT p50)", lat_max, span, x)
    for key, colour in (("p50", "#1565c0"), ("p99", "#c62828"), ("ttft", "#777")):
        pts = [(x(r["t"]), top2 + PANEL_H - PANEL_H * r[key] / lat_max) for r in rows if r[key] is not None]
        if pts:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="'
                       + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _subtitle(report: dict[str, Any]) -> str:
    ledger = report.get("ledger", {})
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(report["statuses"].items()))
    return (f'{report["completed"]} completed in {report["duration_s"]} s ({statuses}); ledger: '
            f'{ledger.get("usage_events", "?")} events for {ledger.get("completed_requests", "?")} completed, '
            f'{"reconciled" if ledger.get("ok") else "NOT reconciled"}')


def _panel(top: float, label: str, y_max: float, duration_s: float, x: Any) -> list[str]:
    bottom = top + PANEL_H
    out = [f'<text x="{LEFT}" y="{top - 6}">{escape(label)}</text>',
           f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{bottom}" y2="{bottom}" stroke="black"/>',
           f'<line x1="{LEFT}" x2="{LEFT}" y1="{top}" y2="{bottom}" stroke="black"/>']
    for frac in (0.5, 1.0):
        y = bottom - PANEL_H * frac
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{y_max * frac:.2g}</text>')
    step = 15 if duration_s > 60 else 10
    t = 0
    while t <= duration_s + 1e-9:
        out.append(f'<text x="{x(t):.1f}" y="{bottom + 14}" text-anchor="middle">{t:g}s</text>')
        t += step
    return out
