"""The token tape: the batch engine's prefix cache, keyed by post-template token ids.

A cache is reused only where that is exact. A plain KV cache is cut back to
the prefix a prompt shares with its tape. Some caches cannot be cut back: a
sliding window (RotatingKVCache) once past its size, SSM state (ArraysCache)
always; such a cache serves only a prompt that extends its whole tape, and
any other prompt is prefilled afresh, so a tape that extends it does not
replace it. Each entry carries the id its snapshot was written or restored
under (runtime/prefix/snapshot.py), "" when it has none, and its tenant: a request
is served only from its own tenant's entries (the proxy scopes tenants by
API key), so neither its cached count nor its speed tells one tenant what
another sent.
"""

from __future__ import annotations

import copy
from collections import deque

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache


def reusable_prefix(shared: int, stored: int, prompt: int, trimmable: bool) -> int:
    """How many tokens of a stored tape of `stored` tokens a prompt of `prompt` tokens starts from, when
    they share `shared`: at most all but the prompt's last token (always left to process), and from a
    cache that cannot be cut back only its whole tape."""
    n = min(shared, prompt - 1)
    return n if trimmable or n == stored else 0


def replaces(shared: int, stored: int, new: int, trimmable: bool) -> bool:
    """Whether a new tape of `new` tokens, sharing `shared` with a stored one of `stored`, serves every prompt
    that one serves: it is the same tape, or it extends it and its cache (`trimmable`) can be cut back to it."""
    return shared == stored and (stored == new or trimmable)


class TokenTape:
    """Tapes of post-template token ids with their caches, kept in LRU order
    up to `capacity` (one dropped for a new one that `replaces` it); each
    `take` counts as a hit, a miss (no tape shares a prefix) or not reusable
    (one does, but its cache cannot be cut back to it); `hit_tokens` sums the
    prefixes the hits served."""

    def __init__(self, capacity: int = 8):
        self.capacity = capacity
        self._entries: deque[tuple[tuple[int, ...], list, str, str]] = deque()  # tokens, cache, sid, tenant
        self.hits = self.misses = self.not_reusable = self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _best(self, prompt: tuple[int, ...], tenant: str) -> tuple[int | None, int, bool]:
        """The entry of `tenant` that serves the longest reusable prefix of `prompt`, its length, and whether
        any of its entries shares a prefix with it at all (another tenant's never does)."""
        best, best_len, shared = None, 0, False
        for i, (tape, cache, _, owner) in enumerate(self._entries):
            if owner != tenant:
                continue
            n = common_prefix(tape, prompt)
            shared = shared or min(n, len(prompt) - 1) > 0
            n = reusable_prefix(n, len(tape), len(prompt), can_trim_prompt_cache(cache))
            if n > best_len:
                best, best_len = i, n
        return best, best_len, shared

    def served(self, prompt: tuple[int, ...], tenant: str = "") -> int:
        """How much of `prompt` a `take` would serve now (nothing counted)."""
        return self._best(prompt, tenant)[1]

    def take(self, prompt: tuple[int, ...], tenant: str = "") -> tuple[list | None, int, str]:
        """A copy of the cache of `tenant` that serves the longest reusable prefix of `prompt`, cut back to it,
        that prefix's length and the snapshot id of the entry it came from; (None, 0, "") when none does."""
        best, best_len, shared = self._best(prompt, tenant)
        if best is None:
            if shared:
                self.not_reusable += 1
            else:
                self.misses += 1
            return None, 0, ""
        tape, stored, sid, _ = entry = self._entries[best]
        cache = copy.deepcopy(stored)
        if trim_prompt_cache(cache, len(tape) - best_len) != len(tape) - best_len:
            self.not_reusable += 1
            return None, 0, ""
        del self._entries[best]
        self._entries.append(entry)
        self.hits += 1
        self.hit_tokens += best_len
        return cache, best_len, sid

    def store(self, tape: tuple[int, ...], cache: list, sid: str = "", tenant: str = "") -> None:
        trimmable = can_trim_prompt_cache(cache)
        self._entries = deque(e for e in self._entries if e[3] != tenant or
                              not replaces(common_prefix(e[0], tape), len(e[0]), len(tape), trimmable))
        self._entries.append((tape, cache, sid, tenant))
        while len(self._entries) > self.capacity:
            self._entries.popleft()

    def store_older(self, tape: tuple[int, ...], cache: list, sid: str, tenant: str = "") -> bool:
        """A tape older than every one held (restored while serving): kept as the least recently used while
        there is room and no entry of its tenant serves every prompt it serves; whether it was kept."""
        if len(self._entries) >= self.capacity or any(
                e[3] == tenant and replaces(common_prefix(e[0], tape), len(tape), len(e[0]),
                                            can_trim_prompt_cache(e[1])) for e in self._entries):
            return False
        self._entries.appendleft((tape, cache, sid, tenant))
        return True


def common_prefix(a, b) -> int:
    """How many tokens two sequences share from their start (one comparison in C when one extends the other)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])
