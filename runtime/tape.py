"""The token tape: the batch engine's prefix cache, keyed by post-template token ids."""

from __future__ import annotations

import copy
from collections import deque

from mlx_lm.models.cache import trim_prompt_cache


class TokenTape:
    """Append-only tapes of post-template token ids with their KV caches.

    A follow-up turn whose prompt extends a stored tape prefills only the new
    tokens. Entries are kept in LRU order up to `capacity`."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: deque[tuple[tuple[int, ...], list]] = deque()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prompt: tuple[int, ...]) -> tuple[list | None, int]:
        """The cache for the longest stored prefix of `prompt` (a copy, trimmed
        to the shared prefix) and that prefix length; at least one prompt token
        is always left to process."""
        best, best_len = None, 0
        for i, (tape, _) in enumerate(self._entries):
            n = _common_prefix(tape, prompt)
            if n > best_len:
                best, best_len = i, n
        best_len = min(best_len, len(prompt) - 1)
        if best is None or best_len <= 0:
            return None, 0
        tape, cache = self._entries[best]
        del self._entries[best]
        self._entries.append((tape, cache))
        cache = copy.deepcopy(cache)
        trim_prompt_cache(cache, len(tape) - best_len)
        return cache, best_len

    def store(self, tape: tuple[int, ...], cache: list) -> None:
        self._entries = deque((t, c) for t, c in self._entries if _common_prefix(t, tape) < len(t))
        self._entries.append((tape, cache))
        while len(self._entries) > self.capacity:
            self._entries.popleft()


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
