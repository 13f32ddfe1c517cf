"""Which mesh an attempt goes to, when meshd-proxy fronts several: pure, over what the proxy sees of
each mesh now.

By model name and alias first. Among the meshes of that name that serve: the one whose tape holds the
conversation's prefix (affinity), else the one with the fewest requests waiting and running (queue).
An attempt after a failed one goes only to a mesh with the same weights (fingerprint, as each mesh's
controller read it for the generation it serves now), never back to the generation that failed, nor to
the same mesh's next generation once that serves other weights (failover). Meshes that give their
models one name but serve other weights are reported (conflicts) and never take each other's streams. With no mesh of the model serving, the opt-in fallback model's
mesh answers (fallback); without one, the request waits for a mesh of its model, unless none can
come back by waiting.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

REASONS = ("model", "affinity", "queue", "failover", "fallback")


@dataclass(frozen=True)
class MeshSeen:
    """One mesh as the proxy sees it now."""

    name: str
    names: tuple[str, ...]  # what clients may call its model: the served name, then the aliases
    fingerprint: str  # of its weights, from its controller; "" unknown (never another mesh's twin)
    ready: bool
    gone: bool  # failed, stopped or draining: no generation comes back by waiting
    generation: int
    load: int = 0  # requests waiting for it and running on it
    full: bool = False  # its queue takes no more


@dataclass(frozen=True)
class Failed:
    """The attempt that failed: where it went, on which generation, with which weights."""

    mesh: str
    generation: int
    fingerprint: str = ""  # none read: the failed mesh is its own only twin


@dataclass(frozen=True)
class Route:
    """`send`: to `mesh`, for `reason`; `wait`: for a change, queued at `mesh`; `gone`: nothing comes by
    waiting; `full`: every mesh that could take it has a full queue."""

    kind: str
    mesh: str = ""
    reason: str = ""


def route(meshes: list[MeshSeen], model: str, *, affinity: tuple[str, int] | None = None,
          failed: Failed | None = None, fallback: str = "") -> Route:
    """Where an attempt for `model` goes now. `affinity`: the mesh and generation that served this
    conversation's prefix (another generation's tape does not hold it)."""
    if failed is not None:
        twins = [m for m in meshes if _twin(m, failed)]
        up = [m for m in twins if m.ready and not (m.name == failed.mesh and m.generation <= failed.generation)]
        return _send(up, "failover") or _hold(twins)
    named = [m for m in meshes if model in m.names]
    up = [m for m in named if m.ready]
    if affinity is not None:
        if chosen := [m for m in up if (m.name, m.generation) == affinity and not m.full]:
            return Route("send", chosen[0].name, "affinity")
    if up:
        return _send(up, "model" if len(named) == 1 else "queue") or Route("full")
    if fallback and fallback != model:
        if sent := _send([m for m in meshes if fallback in m.names and m.ready], "fallback"):
            return sent
    return _hold(named)


def _twin(m: MeshSeen, failed: Failed) -> bool:
    """Whether an attempt cut on `failed` may go on at `m`: a mesh with the same weights; the failed mesh
    itself also while its next generation's weights are not known yet (it starts), or never were."""
    if m.name == failed.mesh:
        return m.fingerprint == failed.fingerprint or (not m.ready and not m.fingerprint)
    return bool(failed.fingerprint) and m.fingerprint == failed.fingerprint


def conflicts(meshes: list[MeshSeen]) -> list[str]:
    """Each pair of meshes that give their models a name in common and serve other weights, in words."""
    found = []
    for i, a in enumerate(meshes):
        for b in meshes[i + 1:]:
            shared = [n for n in a.names if n in b.names]
            if shared and a.fingerprint and b.fingerprint and a.fingerprint != b.fingerprint:
                found.append(f"meshes {a.name} and {b.name} both serve {shared[0]!r} with different weights "
                             f"(fingerprints {a.fingerprint} and {b.fingerprint}): a stream cut on one is never "
                             "resumed on the other; give one of them another runtime.args.model_name, or the "
                             "same model")
    return found


def _send(up: list[MeshSeen], reason: str) -> Route | None:
    """The least loaded of `up` with room (the first named on a tie), or None."""
    room = [m for m in up if not m.full]
    if not room:
        return None
    return Route("send", min(room, key=lambda m: m.load).name, reason)


def _hold(candidates: list[MeshSeen]) -> Route:
    """Wait, queued at the least loaded candidate that may come back, or gone when none may."""
    coming = [m for m in candidates if not m.gone and not m.full]
    if coming:
        return Route("wait", min(coming, key=lambda m: m.load).name)
    return Route("full") if any(not m.gone for m in candidates) else Route("gone")


def prefix_keys(messages: list) -> list[str]:
    """A key for each leading run of a conversation's messages, the whole conversation's first: a
    follow-up (the conversation so far, the answer, a new question) shares its shorter keys with the
    requests before it."""
    keys, h = [], hashlib.sha256()
    for message in messages:
        h.update(json.dumps(message, sort_keys=True).encode() + b"\0")
        keys.append(h.copy().hexdigest()[:32])
    return keys[::-1]


class PrefixMemory:
    """Which mesh (and generation) served which conversation prefix, the `size` most recent."""

    def __init__(self, size: int):
        self.size = size
        self._mesh: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def find(self, keys: list[str]) -> tuple[str, int] | None:
        """The mesh and generation that served the longest of `keys` (longest first), or None."""
        for key in keys:
            if (mesh := self._mesh.get(key)) is not None:
                self._mesh.move_to_end(key)
                return mesh
        return None

    def remember(self, key: str, mesh: str, generation: int) -> None:
        self._mesh[key] = (mesh, generation)
        self._mesh.move_to_end(key)
        while len(self._mesh) > self.size:
            self._mesh.popitem(last=False)
