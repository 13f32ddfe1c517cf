"""Wait on what a process reports, never on a sleep."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll `predicate` until it returns a truthy value; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
