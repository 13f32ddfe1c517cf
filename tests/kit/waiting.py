"""Wait on what a process reports, never on a sleep."""

from __future__ import annotations

import time

# A poll waits at least this many times as long as the predicate took: a predicate that spawns a process (a
# `meshctl status`, half a CPU-second) then takes a quarter of one core, not all of it, from the ranks the test
# waits on, while an HTTP poll of a few milliseconds still looks every `interval`. Never longer than
# LONGEST_NAP, so that a predicate that timed out is soon asked again.
PATIENCE, LONGEST_NAP = 3, 1.0


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until it returns a truthy value; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        began = time.monotonic()
        value = predicate()
        if value:
            return value
        time.sleep(max(interval, min(LONGEST_NAP, PATIENCE * (time.monotonic() - began))))
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
