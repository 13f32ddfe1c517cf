"""What `meshctl up`, `restart --wait`, `status --watch` and `model pull` show
while things move: on a terminal, a block redrawn in place (a load bar per
rank, the incident's recovery steps as they happen, a copy's bytes); elsewhere,
plain lines. `frame` is pure; `Block` and `Display` only write."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from common.prefills import long_prefills

BAR = 24


def bar(done: int, total: int, width: int = BAR) -> str:
    filled = round(width * done / total) if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def rank_line(r: dict) -> str:
    state = r["state"]
    if state == "loading" and r.get("load_total"):
        done, total = r["load_done"], r["load_total"]
        return f"  {r['node']:<12} {state:<9} {bar(done, total)} {done}/{total}"
    return f"  {r['node']:<12} {state}"


def frame(status: dict, now: float) -> list[str]:
    """The block for one poll of the controller's status."""
    head = f"generation {status['generation']} {status['phase']}"
    if status.get("reason") and status["phase"] != "ready":
        head += f": {status['reason']}"
    lines = [head] + [rank_line(r) for r in status.get("load", [])]
    inc = status.get("last_incident")
    if inc and status["phase"] in ("recovering", "starting") and not inc.get("serving_back_at"):
        steps = "  ".join(f"{t['step']} +{t['after']:.2f}s" for t in inc.get("timeline", []))
        lines.append(f"  recovering from {inc['cause']} on {inc['node']} rank {inc['rank']} "
                     f"({now - inc['opened_at']:.1f}s): {steps or 'opened'}")
    return lines + [f"  {line}" for line in long_prefills(status)]


def summary(status: dict) -> str:
    """One line for a log or a pipe: what changed."""
    parts = []
    for r in status.get("load", []):
        state = r["state"]
        if state == "loading" and r.get("load_total"):
            state = f"loading {r['load_done']}/{r['load_total']}"
        parts.append(f"{r['node']}: {state}")
    return f"generation {status['generation']} {status['phase']}: " + ", ".join(parts)


class Block:
    """Lines redrawn in place on a terminal; elsewhere printed at most every `every` seconds."""

    def __init__(self, out: TextIO | None = None, every: float = 5.0):
        self.out = out or sys.stdout
        self.live = self.out.isatty()
        self.every, self.printed_at = every, float("-inf")
        self.drawn = 0

    def draw(self, lines: list[str]) -> None:
        if not self.live:
            if time.monotonic() - self.printed_at >= self.every:
                self.out.write("".join(line.strip() + "\n" for line in lines))
                self.out.flush()
                self.printed_at = time.monotonic()
            return
        up = f"\x1b[{self.drawn}F" if self.drawn else ""  # back to the block's first line
        self.out.write(up + "".join(f"\x1b[2K{line}\n" for line in lines) + "\x1b[J")
        self.out.flush()
        self.drawn = len(lines)

    def finish(self, line: str) -> None:
        """The block replaced by one line that stays."""
        if self.live and self.drawn:
            self.out.write(f"\x1b[{self.drawn}F\x1b[J")
        self.out.write(line + "\n")
        self.out.flush()
        self.drawn = 0


class Display:
    """Redraws `frame` in place on a terminal; prints `summary` when it changes elsewhere."""

    def __init__(self, out: TextIO | None = None):
        self.block = Block(out)
        self.last = ""

    def show(self, status: dict) -> None:
        if self.block.live:
            self.block.draw(frame(status, time.time()))
            return
        line = summary(status)
        if line != self.last:
            self.block.out.write(line + "\n")
            self.block.out.flush()
            self.last = line
