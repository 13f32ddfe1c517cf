"""The token tape: the engine's prefix cache, keyed by post-template token ids.

A cache is reused only where that is exact. A plain KV cache is cut back to
the prefix a prompt shares with its tape. Some caches cannot be trimmed: a
sliding window (RotatingKVCache) once past its size, SSM state (ArraysCache),
omlx's DeepSeek-V4 pools; such a cache serves a prompt that extends its whole
tape, or is cut back to the longest of its checkpoints (runtime/prefix/
checkpoints.py) that lies within what the prompt shares with it and where the
prompt's own prefill stops (`stops`: there a cut cache answers as a fresh
prefill does); its snapshot keeps the checkpoints, so a restored tape has them. A tape that extends such a tape does not replace it. A drafted tape also keeps the target's taps
at its last positions (`taps`, at most DSpark's stages' window of them; its snapshot keeps them too): a prompt it
serves gets those before the prefix served, so its stages draft its first block with their context
(runtime/models/dspark.py `context`). The
checkpoints' held bytes are bounded (`checkpoint_budget`): past it the least
recently used tapes lose theirs first (`_thin`). Each entry carries the id its snapshot was written or restored
under (runtime/prefix/snapshot.py), "" when it has none, and its tenant: a request
is served only from its own tenant's entries (the proxy scopes tenants by
API key), so neither its cached count nor its speed tells one tenant what
another sent.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from runtime.prefix.checkpoints import Checkpoint, cut


def reusable_prefix(shared: int, stored: int, prompt: int, trimmable: bool) -> int:
    """How many tokens of a stored tape of `stored` tokens a prompt of `prompt` tokens starts from, when
    they share `shared`: at most all but the prompt's last token (always left to process), and from a
    cache that cannot be cut back only its whole tape."""
    n = min(shared, prompt - 1)
    return n if trimmable or n == stored else 0


def best_checkpoint(at: list[int], shared: int, prompt: int, stops: tuple[int, ...]) -> int | None:
    """Of checkpoints `at`, the longest a prompt of `prompt` tokens that shares `shared` with their tape can start
    from: within the shared prefix, short of the prompt's last token, and where the prompt's prefill stops."""
    usable = [a for a in at if 0 < a <= min(shared, prompt - 1) and a in stops]
    return max(usable, default=None)


@dataclass
class Entry:
    tokens: tuple[int, ...]
    cache: list
    sid: str  # its snapshot's id ("" without)
    tenant: str
    checkpoints: tuple[Checkpoint, ...] = ()
    taps: object = None  # the target's taps at its last positions (mx.array [1, n, width]), or None


def taps_before(taps, stored: int, served: int):
    """Of the taps at the last positions of a tape of `stored` tokens, those before position `served`; None
    when none is."""
    if taps is None:
        return None
    n = taps.shape[1] - (stored - served)
    return taps[:, :n] if n > 0 else None


def within(checkpoints: tuple[Checkpoint, ...], tape: tuple[int, ...]) -> tuple[Checkpoint, ...]:
    """The checkpoints short of a tape's end (its cache itself serves the whole tape)."""
    return tuple(c for c in checkpoints if c.at < len(tape))


def replaces(shared: int, stored: int, new: int, trimmable: bool) -> bool:
    """Whether a new tape of `new` tokens, sharing `shared` with a stored one of `stored`, serves every prompt
    that one serves: it is the same tape, or it extends it and its cache (`trimmable`) can be cut back to it."""
    return shared == stored and (stored == new or trimmable)


class TokenTape:
    """Tapes of post-template token ids with their caches, kept in LRU order
    up to `capacity` (one dropped for a new one that `replaces` it); each
    `take` counts as a hit, a miss (no tape shares a prefix) or not reusable
    (one does, but no cut back of its cache reaches it); `hit_tokens` sums the
    prefixes the hits served, `checkpoint_hits` the hits a checkpoint served."""

    def __init__(self, capacity: int = 8, checkpoint_budget: int = 1 << 30):
        self.capacity = capacity
        self.checkpoint_budget = checkpoint_budget
        self._entries: deque[Entry] = deque()
        self.hits = self.misses = self.not_reusable = self.hit_tokens = self.checkpoint_hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint held, once (a tape cut from another shares its checkpoints up to the cut)."""
        return list({id(c): c for e in self._entries for c in e.checkpoints}.values())

    @property
    def checkpoint_bytes(self) -> int:
        return sum(c.nbytes for c in self._checkpoints())

    @property
    def taps_bytes(self) -> int:
        """Memory the tapes' kept taps hold (at most the stages' window of positions a tape)."""
        return sum(e.taps.nbytes for e in self._entries if e.taps is not None)

    @property
    def checkpoint_count(self) -> int:
        return len(self._checkpoints())

    def _best(self, prompt: tuple[int, ...], tenant: str, stops: tuple[int, ...]):
        """The entry of `tenant` that serves the longest reusable prefix of `prompt`, its length, the checkpoint
        that serves it (None: a trim, or the whole tape), and whether any of its entries shares a prefix with
        it at all (another tenant's never does)."""
        best, best_len, best_point, shared = None, 0, None, False
        for i, e in enumerate(self._entries):
            if e.tenant != tenant:
                continue
            n = common_prefix(e.tokens, prompt)
            shared = shared or min(n, len(prompt) - 1) > 0
            whole = reusable_prefix(n, len(e.tokens), len(prompt), can_trim_prompt_cache(e.cache))
            at = best_checkpoint([c.at for c in e.checkpoints], n, len(prompt), stops)
            if whole > best_len:
                best, best_len, best_point = i, whole, None
            if at is not None and at > max(whole, best_len):
                best, best_len, best_point = i, at, next(c for c in e.checkpoints if c.at == at)
        return best, best_len, best_point, shared

    def served(self, prompt: tuple[int, ...], tenant: str = "", stops: tuple[int, ...] = ()) -> int:
        """How much of `prompt` a `take` would serve now (nothing counted)."""
        return self._best(prompt, tenant, stops)[1]

    def take(self, prompt: tuple[int, ...], tenant: str = "",
             stops: tuple[int, ...] = ()) -> tuple[list | None, int, str, tuple[Checkpoint, ...], object]:
        """A copy of the cache of `tenant` that serves the longest reusable prefix of `prompt`, cut back to it,
        that prefix's length, the snapshot id of the entry it came from, the entry's checkpoints up to it
        (the copy went through them: they cut it back too) and its taps before it (`taps_before`);
        (None, 0, "", (), None) when none does. `stops`: where the prompt's own prefill stops
        (runtime/prefix/checkpoints.py `stops`)."""
        best, best_len, point, shared = self._best(prompt, tenant, stops)
        if best is None:
            if shared:
                self.not_reusable += 1
            else:
                self.misses += 1
            return None, 0, "", (), None
        entry = self._entries[best]
        cache = copy.deepcopy(entry.cache)
        if point is not None:
            cut(cache, point)
            self.checkpoint_hits += 1
        elif trim_prompt_cache(cache, len(entry.tokens) - best_len) != len(entry.tokens) - best_len:
            self.not_reusable += 1
            return None, 0, "", (), None
        del self._entries[best]
        self._entries.append(entry)
        self.hits += 1
        self.hit_tokens += best_len
        return (cache, best_len, entry.sid, tuple(c for c in entry.checkpoints if c.at <= best_len),
                taps_before(entry.taps, len(entry.tokens), best_len))

    def store(self, tape: tuple[int, ...], cache: list, sid: str = "", tenant: str = "",
              checkpoints: tuple[Checkpoint, ...] = (), taps=None) -> None:
        trimmable = can_trim_prompt_cache(cache)
        self._entries = deque(e for e in self._entries if e.tenant != tenant or
                              not replaces(common_prefix(e.tokens, tape), len(e.tokens), len(tape), trimmable))
        self._entries.append(Entry(tape, cache, sid, tenant, within(checkpoints, tape), taps))
        while len(self._entries) > self.capacity:
            self._entries.popleft()
        self._thin()

    def _thin(self) -> None:
        """Checkpoints dropped until they fit the budget: the least recently used tapes' first, oldest first, and
        of each tape its first two (a system prompt's end) and last eight (its last turns' ends) last."""
        for middle_only in (True, False):
            for e in self._entries:
                while self.checkpoint_bytes > self.checkpoint_budget:
                    n = len(e.checkpoints)
                    going = next((c for i, c in enumerate(e.checkpoints) if not middle_only or 2 <= i < n - 8), None)
                    if going is None:
                        break
                    e.checkpoints = tuple(c for c in e.checkpoints if c is not going)

    def store_older(self, tape: tuple[int, ...], cache: list, sid: str, tenant: str = "", taps=None,
                    checkpoints: tuple[Checkpoint, ...] = ()) -> bool:
        """A tape older than every one held (restored while serving): kept as the least recently used while
        there is room and no entry of its tenant serves every prompt it serves; whether it was kept."""
        if len(self._entries) >= self.capacity or any(
                e.tenant == tenant and replaces(common_prefix(e.tokens, tape), len(tape), len(e.tokens),
                                                can_trim_prompt_cache(e.cache)) for e in self._entries):
            return False
        self._entries.appendleft(Entry(tape, cache, sid, tenant, within(checkpoints, tape), taps))
        self._thin()
        return True


def common_prefix(a, b) -> int:
    """How many tokens two sequences share from their start (one comparison in C when one extends the other)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])
