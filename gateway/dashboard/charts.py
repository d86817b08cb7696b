"""Geometry of the server-rendered SVG charts (templates/_chart.html draws them): a bar chart, a stacked
bar chart (one color per series), horizontal stacked bars with labels, and a budget meter; axis ticks at
round values. No JavaScript and nothing fetched."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal

Number = float | Decimal | int

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


def _decimals(step: float) -> int:
    return max(0, -math.floor(math.log10(step))) if step < 1 else 0


def money_tick(value: float, step: float) -> str:
    return f"${value:,.{_decimals(step)}f}"


def seconds_tick(value: float, step: float) -> str:
    return f"{value:,.{_decimals(step)}f} s"


def bar_chart(labels: list[str], values: list[float], *, label_every: int = 0) -> BarChart:
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    step = nice_step(max(values, default=0.0))
    y_max = step * max(1, math.ceil(max(values, default=0.0) / step))
    slot = plot_w / max(1, len(values))
    bars = []
    for i, (label, value) in enumerate(zip(labels, values)):
        h = plot_h * max(0.0, value) / y_max
        bars.append(Bar(LEFT + i * slot + slot * 0.15, TOP + plot_h - h, slot * 0.7, h, label, value))
    y_ticks = [Tick(TOP + plot_h - plot_h * k * step / y_max, money_tick(k * step, step))
               for k in range(int(round(y_max / step)) + 1)]
    every = label_every or max(1, math.ceil(len(labels) / 8))
    last = len(labels) - 1  # labelled, and so every `every`-th before it
    x_ticks = [Tick(LEFT + (i + 0.5) * slot, label) for i, label in enumerate(labels) if (last - i) % every == 0]
    return BarChart(WIDTH, HEIGHT, LEFT, WIDTH - RIGHT, TOP, TOP + plot_h, bars, y_ticks, x_ticks)


PALETTE = ("#2f6fde", "#f28e2b", "#3a9b5b", "#d8453b", "#6bb7c0", "#c9a400", "#9b6bb5", "#ef86a0", "#8c6d53",
           "#4e79a7")
OTHERS_COLOR = "#b6bdc9"


@dataclass(frozen=True)
class Segment:
    x: float
    y: float
    width: float
    height: float
    color: str
    title: str  # the tooltip: what and how much


@dataclass(frozen=True)
class Swatch:
    label: str
    color: str


@dataclass(frozen=True)
class StackedChart:
    width: int
    height: int
    plot_left: int
    plot_right: int
    plot_top: int
    plot_bottom: int
    segments: list[Segment]
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    legend: list[Swatch]


def colors(count: int, others_last: bool = False) -> list[str]:
    """One color per series; a trailing "others" series in grey."""
    out = [PALETTE[i % len(PALETTE)] for i in range(count)]
    if others_last and out:
        out[-1] = OTHERS_COLOR
    return out


def _axis(top: float, length: float, fmt: Callable[[float, float], str]) -> tuple[float, list[tuple[float, str]]]:
    """The axis' top value and its ticks as (distance from the zero line, label)."""
    step = nice_step(top)
    high = step * max(1, math.ceil(top / step))
    return high, [(length * k * step / high, fmt(k * step, step)) for k in range(int(round(high / step)) + 1)]


def stacked_chart(x_labels: list[str], series: Sequence[tuple[str, Sequence[Number]]], colors_: list[str],
                  value_text: Callable[[Number], str], tick: Callable[[float, float], str] = money_tick
                  ) -> StackedChart:
    """One bar per x label; each series stacks its value on the bars below, in the order given."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    heights = [sum(float(values[i]) for _, values in series) for i in range(len(x_labels))]
    high, ticks = _axis(max(heights, default=0.0), plot_h, tick)
    slot = plot_w / max(1, len(x_labels))
    segments = []
    for i, x_label in enumerate(x_labels):
        base = TOP + plot_h
        for (name, values), color in zip(series, colors_):
            h = plot_h * max(0.0, float(values[i])) / high
            if h > 0:
                base -= h
                segments.append(Segment(LEFT + i * slot + slot * 0.15, base, slot * 0.7, h, color,
                                        f"{x_label} · {name}: {value_text(values[i])}"))
    every = max(1, math.ceil(len(x_labels) / 8))
    last = len(x_labels) - 1
    x_ticks = [Tick(LEFT + (i + 0.5) * slot, label) for i, label in enumerate(x_labels) if (last - i) % every == 0]
    return StackedChart(WIDTH, HEIGHT, LEFT, WIDTH - RIGHT, TOP, TOP + plot_h, segments,
                        [Tick(TOP + plot_h - pos, label) for pos, label in ticks], x_ticks,
                        [Swatch(name, color) for (name, _), color in zip(series, colors_)])


LABEL_W, VALUE_W, ROW_H, AXIS_H = 200, 120, 24, 22
MAX_LABEL_CHARS = 28


@dataclass(frozen=True)
class HRow:
    label: str  # whole, for the tooltip
    short: str  # as drawn
    text_y: float
    segments: list[Segment]
    value: str  # drawn after the bar
    value_x: float


@dataclass(frozen=True)
class HBarChart:
    width: int
    height: int
    bars_left: int
    bars_right: int
    plot_bottom: int
    rows: list[HRow]
    x_ticks: list[Tick]
    legend: list[Swatch]


def hbar_chart(labels: list[str], series: Sequence[tuple[str, Sequence[Number]]], colors_: list[str],
               value_text: Callable[[Number], str], totals: list[str],
               tick: Callable[[float, float], str] = money_tick) -> HBarChart:
    """One row per label, its series' values stacked left to right; `totals` written after each bar."""
    left, right = LABEL_W, WIDTH - VALUE_W
    lengths = [sum(float(values[i]) for _, values in series) for i in range(len(labels))]
    high, ticks = _axis(max(lengths, default=0.0), right - left, tick)
    rows = []
    for i, label in enumerate(labels):
        top = TOP + i * ROW_H
        x = float(left)
        segments = []
        for (name, values), color in zip(series, colors_):
            w = (right - left) * max(0.0, float(values[i])) / high
            if w > 0:
                segments.append(Segment(x, top + 4, w, ROW_H - 8, color, f"{label} · {name}: {value_text(values[i])}"))
                x += w
        short = label if len(label) <= MAX_LABEL_CHARS else label[:MAX_LABEL_CHARS - 1] + "…"
        rows.append(HRow(label, short, top + ROW_H / 2 + 4, segments, totals[i], x + 6))
    bottom = TOP + len(labels) * ROW_H
    return HBarChart(WIDTH, bottom + AXIS_H, left, right, bottom, rows,
                     [Tick(left + pos, label) for pos, label in ticks],
                     [Swatch(name, color) for (name, _), color in zip(series, colors_)])


@dataclass(frozen=True)
class Meter:
    """A budget's bar: spent, then reserved by requests in flight, on a track that is the whole budget; a soft
    budget's alert share as a tick."""

    width: int
    spent_w: float
    reserved_w: float
    over: bool  # spent + reserved past the budget
    alert_x: float | None = None  # a soft budget's alert share, marked on the track


def meter(spent: Decimal, reserved: Decimal, budget: Decimal, alert_at: float | None = None,
          width: int = 140) -> Meter:
    alert_x = None if alert_at is None else min(width - 1.0, width * alert_at)
    if budget <= 0:
        return Meter(width, float(width) if spent + reserved > 0 else 0.0, 0.0, spent + reserved > 0, alert_x)
    spent_w = min(float(width), width * float(spent / budget))
    reserved_w = min(float(width) - spent_w, width * float(reserved / budget))
    return Meter(width, spent_w, reserved_w, spent + reserved > budget, alert_x)
