"""The status page's drawings, pure: data in, an inline SVG string out (no script, no external asset).
`throughput` draws the proxy's tokens/s over the last hour from the counter's samples; `incident`
draws one incident's timeline (its steps, and how long each stretch between them took)."""

from __future__ import annotations

import html
import math
import time
from dataclasses import dataclass

HOUR = 3600.0
WIDTH = 880
CHAR = 6.6  # px a character of the 12 px labels takes, near enough to keep labels apart


@dataclass(frozen=True)
class Sample:
    at: float
    tokens: float | None  # meshd-proxy's meshd_proxy_tokens_total; None: the proxy did not answer


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    tokens: float | None  # completion tokens served between the two samples; None: not known (a gap)

    @property
    def rate(self) -> float:
        return (self.tokens or 0.0) / (self.end - self.start)


def intervals(samples: list[Sample]) -> list[Interval]:
    """Each pair of neighbouring samples as an interval. A counter that went down is a new proxy
    (`meshctl proxy restart`): it counted from zero. A sample the proxy did not answer makes a gap."""
    out = []
    for a, b in zip(samples, samples[1:]):
        if b.at <= a.at:
            continue
        known = a.tokens is not None and b.tokens is not None
        out.append(Interval(a.at, b.at, (b.tokens - a.tokens if b.tokens >= a.tokens else b.tokens) if known else None))
    return out


def nice_ceiling(v: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above v (1 for nothing)."""
    if v <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(v))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= v * (1 - 1e-9))


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 10 else (f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min")


def throughput(samples: list[Sample], now: float, every: float, height: int = 180) -> str:
    """Tokens/s over the hour before `now`: a bar per interval between samples (its tooltip says how many
    tokens in how long), a grey band where the proxy did not answer; axes in minutes ago and tokens/s."""
    left, right, top, bottom = 64, 16, 12, 36
    pw, ph = WIDTH - left - right, height - top - bottom
    shown = [i for i in intervals(samples) if i.end > now - HOUR]
    peak = nice_ceiling(max((i.rate for i in shown if i.tokens is not None), default=0.0))

    def x(t: float) -> float:
        return left + max(0.0, t - (now - HOUR)) / HOUR * pw

    parts = [f'<svg class="throughput" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
             f'viewBox="0 0 {WIDTH} {height}" font-size="12" font-family="sans-serif">']
    for frac in (0, 0.5, 1):
        y = top + ph * (1 - frac)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#e2e8f0"/>'
                     f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#4a5568">{peak * frac:g}</text>')
    for minutes in (60, 45, 30, 15, 0):
        tx = left + pw * (1 - minutes / 60)
        parts.append(f'<text x="{tx:.1f}" y="{top + ph + 16}" text-anchor="middle" fill="#4a5568">'
                     f'{f"{minutes} min ago" if minutes else "now"}</text>')
    parts.append(f'<text transform="translate(14 {top + ph / 2:.0f}) rotate(-90)" text-anchor="middle" '
                 f'fill="#4a5568">tokens/s</text>')
    for i in shown:
        x0, x1 = x(i.start), x(i.end)
        span = f"{_clock(i.start)}–{_clock(i.end)}"
        if i.tokens is None:
            parts.append(f'<rect class="gap" x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 1):.1f}" height="{ph}" '
                         f'fill="#edf2f7"><title>{span}: meshd-proxy did not answer</title></rect>')
            continue
        h = ph * i.rate / peak
        parts.append(f'<rect class="rate" x="{x0:.1f}" y="{top + ph - h:.1f}" width="{max(x1 - x0 - 0.5, 0.5):.1f}" '
                     f'height="{h:.1f}" fill="#3182ce"><title>{span}: {i.tokens:.0f} tokens in '
                     f'{i.end - i.start:.0f} s, {i.rate:.1f} tokens/s</title></rect>')
    parts.append(f'<line x1="{left}" y1="{top + ph}" x2="{left + pw}" y2="{top + ph}" stroke="#718096"/>')
    if not shown:
        parts.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" fill="#718096">'
                     f'no samples yet: one every {every:g} s</text>')
    parts.append("</svg>")
    return "".join(parts)


# What happens between a step and the next, named by the step it starts at.
STRETCHES = {"detected": "stopping", "planned": "draining", "stopped": "sweeping", "swept": "restarting",
             "backoff": "backing off", "started": "loading", "loaded": "arming", "ready": "first request"}
STRETCH_COLOURS = {"stopping": "#dd6b20", "draining": "#718096", "sweeping": "#ed8936", "restarting": "#d69e2e",
                   "backing off": "#a0aec0", "loading": "#3182ce", "arming": "#805ad5", "first request": "#1f9d55"}


def label_rows(spans: list[tuple[float, float]], gap: float = 8) -> list[int]:
    """The row each label (its left and right x) goes in: the first row it does not overlap, in order."""
    ends: list[float] = []
    rows = []
    for x0, x1 in spans:
        row = next((r for r, end in enumerate(ends) if end + gap <= x0), len(ends))
        if row == len(ends):
            ends.append(x1)
        else:
            ends[row] = x1
        rows.append(row)
    return rows


def incident(timeline: list[tuple[str, float]], now: float, recovering: bool) -> str:
    """One incident's steps on a horizontal time axis: a coloured stretch between each step and the next
    (named for what happens in it, with its duration), a tick and a label (the time since the first step)
    per step. While it is recovering its last stretch runs to `now`."""
    steps = sorted(timeline, key=lambda s: s[1])
    if not steps:
        return ""
    first = steps[0][1]
    end = max(now, steps[-1][1]) if recovering else steps[-1][1]
    total = max(end - first, 1e-3)
    left, right, bar_y, bar_h = 8, 8, 6, 18
    pw = WIDTH - left - right

    def x(t: float) -> float:
        return left + (t - first) / total * pw

    ends = steps[1:] + ([("now", end)] if recovering and end > steps[-1][1] else [])
    stretches = []
    for (step, at), (then, until) in zip(steps, ends):
        name = STRETCHES.get(step, step)
        x0, x1 = x(at), x(until)
        text = f"{name} {_seconds(until - at)}"
        label = (f'<text x="{(x0 + x1) / 2:.1f}" y="{bar_y + 13}" text-anchor="middle" fill="white">'
                 f'{html.escape(text)}</text>') if x1 - x0 >= len(text) * CHAR + 6 else ""
        fading = ' opacity="0.5"' if then == "now" else ""
        stretches.append(f'<g class="stretch" data-stretch="{html.escape(name)}"><rect x="{x0:.1f}" y="{bar_y}" '
                         f'width="{max(x1 - x0, 1):.1f}" height="{bar_h}" fill="{STRETCH_COLOURS.get(name, "#a0aec0")}"'
                         f'{fading}><title>{html.escape(f"{text} ({step} → {then})")}</title></rect>{label}</g>')
    labels = [(step, at, f"{step} {_clock(at)}" if at == first else f"{step} +{_seconds(at - first)}")
              for step, at in steps]
    spans = []
    for _, at, text in labels:
        w = len(text) * CHAR
        x0 = min(max(x(at) - w / 2, 0), WIDTH - w)
        spans.append((x0, x0 + w))
    rows = label_rows(spans)
    ticks = []
    for (step, at, text), (x0, _), row in zip(labels, spans, rows):
        y = bar_y + bar_h + 16 + 15 * row
        ticks.append(f'<g class="step" data-step="{html.escape(step)}"><line x1="{x(at):.1f}" y1="{bar_y - 3}" '
                     f'x2="{x(at):.1f}" y2="{y - 11}" stroke="#2d3748"/><text x="{x0:.1f}" y="{y}" fill="#2d3748" '
                     f'stroke="white" stroke-width="3" paint-order="stroke">'
                     f'{html.escape(text)}</text></g>')
    height = bar_y + bar_h + 22 + 15 * max(rows)
    return (f'<svg class="incident" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" font-size="12" font-family="sans-serif">'
            f'{"".join(stretches)}{"".join(ticks)}</svg>')
