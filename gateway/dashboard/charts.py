"""Geometry of the server-rendered SVG bar chart (templates/_chart.html draws it): bars, y-axis
ticks at round values, and a few x labels. No JavaScript and nothing fetched."""

from __future__ import annotations

import math
from dataclasses import dataclass

WIDTH, HEIGHT = 760, 260
LEFT, RIGHT, TOP, BOTTOM = 70, 12, 12, 34


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    label: str
    value: float


@dataclass(frozen=True)
class Tick:
    pos: float
    label: str


@dataclass(frozen=True)
class BarChart:
    width: int
    height: int
    plot_left: int
    plot_right: int
    plot_top: int
    plot_bottom: int
    bars: list[Bar]
    y_ticks: list[Tick]
    x_ticks: list[Tick]


def nice_step(top: float, ticks: int = 4) -> float:
    """A 1, 2 or 5 × 10^n step so that `ticks` steps reach at least `top`."""
    if top <= 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _money(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"${value:,.{decimals}f}"


def bar_chart(labels: list[str], values: list[float], *, label_every: int = 0) -> BarChart:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = nice_step(max(values, default=0.0))
    y_max = step * max(1, math.ceil(max(values, default=0.0) / step))
    slot = plot_w / max(1, len(values))
    bars = []
    for i, (label, value) in enumerate(zip(labels, values)):
        h = plot_h * max(0.0, value) / y_max
        bars.append(Bar(LEFT + i * slot + slot * 0.15, TOP + plot_h - h, slot * 0.7, h, label, value))
    y_ticks = [Tick(TOP + plot_h - plot_h * k * step / y_max, _money(k * step, step))
               for k in range(int(round(y_max / step)) + 1)]
    every = label_every or max(1, math.ceil(len(labels) / 8))
    last = len(labels) - 1  # labelled, and so every `every`-th before it
    x_ticks = [Tick(LEFT + (i + 0.5) * slot, label) for i, label in enumerate(labels) if (last - i) % every == 0]
    return BarChart(WIDTH, HEIGHT, LEFT, WIDTH - RIGHT, TOP, TOP + plot_h, bars, y_ticks, x_ticks)
