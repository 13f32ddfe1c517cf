"""Fencing: the controller ballot this agent has promised and the mesh it
serves, kept in its state directory. A starting controller asks every agent for
its promise (`POST /v1/epoch`) with a ballot above any it found, naming its
mesh; an agent promises a ballot no lower than the one it holds, to a
controller of the mesh it serves (the first promise binds it to that mesh, an
operator releases it: `DELETE /v1/epoch?mesh=NAME`), and admits a command only
from the controller it promised. So a controller that was stopped and resumed
after another took over is refused, one that has not asked this agent yet (it
was away during the controller's round) asks before its first command, and a
controller of another mesh.toml that lists this node commands nothing here.
A promise kept is read with its reasons: an unreadable or out-of-range one is
not read as no promise; the agent promises and admits no controller until it is
fixed (it is read again at each ask)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping
from urllib.parse import quote, unquote

import structlog

from common.protocol import CONTROLLER_ID_FORM, CONTROLLER_MESH, EPOCH_MAX, EPOCH_ROUTE, Ballot, BallotError

log = structlog.get_logger("meshd.agent")

STALE = "stale_controller"
NOT_PROMISED = "epoch_not_promised"
OTHER_MESH = "other_mesh"
UNREADABLE = "promise_unreadable"
MESH_NAME_MAX = 200  # characters of a mesh's name on the wire


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str


@dataclass(frozen=True)
class Promise:
    """What this agent holds: the ballot it promised, when, and the mesh whose controller it promised (None:
    no mesh yet, or released by an operator)."""

    ballot: Ballot = Ballot(0)
    mesh: str | None = None
    at: float | None = None

    def view(self) -> dict:
        return {"epoch": self.ballot.epoch, "controller": self.ballot.controller, "promised_at": self.at,
                "mesh": self.mesh}


def mesh_header(name: str) -> dict[str, str]:
    """The header naming a controller's mesh (any name a mesh.toml may hold, percent-encoded)."""
    return {CONTROLLER_MESH: quote(name, safe="")}


def caller_mesh(headers: Mapping[str, str]) -> str | None:
    """The mesh a call names (None: it names none); BallotError for a malformed name."""
    raw = headers.get(CONTROLLER_MESH)
    if raw is None:
        return None
    try:
        name = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        name = ""
    if not name or len(name) > MESH_NAME_MAX:
        raise BallotError(CONTROLLER_MESH, f"{CONTROLLER_MESH} must be a mesh's name (1 to {MESH_NAME_MAX} "
                                           f"characters, percent-encoded UTF-8), got {raw[:40]!r}")
    return name


def parse_promise(text: str) -> Promise | str:
    """A promise file's text as the promise it keeps, or why it keeps none that can be trusted. A bare integer
    is an epoch kept before ballots had ids; a promise without a mesh, one kept before ballots were bound."""
    try:
        kept = json.loads(text)
    except ValueError as e:
        return f"it is not JSON ({e})"
    if isinstance(kept, int) and not isinstance(kept, bool):
        kept = {"epoch": kept, "controller": ""}
    if not isinstance(kept, dict):
        return f"it holds {_shown(kept)}, not a promise"
    epoch, controller, mesh, at = kept.get("epoch"), kept.get("controller"), kept.get("mesh"), kept.get("at")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch <= EPOCH_MAX:
        return f"its epoch {_shown(epoch)} is not an integer from 0 to {EPOCH_MAX}"
    if not isinstance(controller, str) or (controller and not CONTROLLER_ID_FORM.fullmatch(controller)):
        return f"its controller id {_shown(controller)} is not one a controller takes"
    if mesh is not None and (not isinstance(mesh, str) or not 0 < len(mesh) <= MESH_NAME_MAX):
        return f"its mesh {_shown(mesh)} is not a mesh's name"
    if at is not None and (isinstance(at, bool) or not isinstance(at, (int, float))):
        return f"its time {_shown(at)} is not a number"
    return Promise(Ballot(epoch, controller), mesh, at)


def _shown(value) -> str:
    return repr(value)[:40]


def mesh_refusal(held: Promise, mesh: str | None) -> Refusal | None:
    """May a controller of `mesh` (None: a caller that names none) be promised or commanded by this agent, which
    holds `held`? Only one of the mesh it serves, or any while it serves none."""
    if held.mesh is None or mesh is None or mesh == held.mesh:
        return None
    return Refusal(OTHER_MESH, f"this agent serves mesh {held.mesh!r} (it promised {held.ballot} to its "
                               f"controller); a controller of mesh {mesh!r} is refused: a node serves one mesh. If "
                               f"it belongs to mesh {mesh!r} now ({held.mesh!r} was renamed, or gave the node up), "
                               f"stop {held.mesh!r}'s controller and release the node (DELETE {EPOCH_ROUTE}?mesh="
                               f"{quote(held.mesh, safe='')} on this agent, with its token); otherwise remove the "
                               f"node from {mesh!r}'s mesh.toml")


def promise_refusal(held: Promise, asked: Ballot, mesh: str) -> Refusal | None:
    """May this agent, holding `held`, promise `asked` of a controller of `mesh`? The same ballot again is the
    same controller asking again (it lost the answer, or this agent was away)."""
    return mesh_refusal(held, mesh) or (None if asked >= held.ballot else _stale(held.ballot, asked))


def command_refusal(held: Promise, caller: Ballot, mesh: str | None) -> Refusal | None:
    """May the controller of `caller` (of `mesh`) command this agent, which promised `held`? Only the one it
    promised."""
    if refusal := mesh_refusal(held, mesh):
        return refusal
    if caller == held.ballot:
        return None
    if caller < held.ballot:
        return _stale(held.ballot, caller)
    return Refusal(NOT_PROMISED, f"controller {caller} has not asked this agent for its promise (it holds "
                                 f"{held.ballot}): a controller asks for it (POST {EPOCH_ROUTE}) before it commands")


def _stale(held: Ballot, caller: Ballot) -> Refusal:
    return Refusal(STALE, f"controller {caller} is older than {held}, which this agent has promised and which has "
                          "taken this mesh over: a stale controller is refused")


class Fencing:
    """The promise, as `controller_epoch` in the state directory (JSON). `problem` says why the file kept there
    cannot be trusted (garbled, out of range, unreadable): until it is fixed (deleted, or written right) this
    agent promises and admits no controller; it reads the file again at each `check`."""

    def __init__(self, path: Path):
        self.path = path
        self.held = Promise()
        self.problem: str | None = None
        self._read()

    def _read(self) -> None:
        try:
            kept = parse_promise(self.path.read_text())
        except FileNotFoundError:  # none kept yet: no promise
            kept = Promise()
        except (OSError, UnicodeDecodeError) as e:
            kept = f"it cannot be read ({e})"
        if isinstance(kept, Promise):
            self.held, self.problem = kept, None
            return
        if self.problem is None or kept not in self.problem:  # logged once a reason, not at every ask
            log.error("promise file cannot be trusted", path=str(self.path), reason=kept)
        self.problem = (f"the promise file {self.path} cannot be trusted: {kept}. This agent cannot tell which "
                        "controller it promised, so it promises and admits none until the file is fixed: delete it "
                        f"(`rm {self.path}`; this agent reads it again at the next ask), and the next controller to "
                        "start takes an epoch above the others' and is promised here")

    def check(self) -> Refusal | None:
        """Why no controller may be promised or admitted now (the promise file cannot be trusted), read again."""
        if self.problem is not None:
            self._read()
        return None if self.problem is None else Refusal(UNREADABLE, self.problem)

    def view(self) -> dict:
        return self.held.view()

    def promise(self, ballot: Ballot, mesh: str) -> None:
        """Hold `ballot` of a controller of `mesh` from now on, also across restarts (written and synced before
        the answer goes out)."""
        if (ballot, mesh) != (self.held.ballot, self.held.mesh):
            self._keep(Promise(ballot, mesh, time.time()))

    def release(self) -> None:
        """Serve no mesh from now on (an operator's call); the ballot stays promised."""
        self._keep(Promise(self.held.ballot, None, self.held.at))

    def _keep(self, promise: Promise) -> None:
        self.held = promise
        part = self.path.with_name(self.path.name + ".part")
        try:
            with part.open("w") as f:
                f.write(json.dumps({"epoch": promise.ballot.epoch, "controller": promise.ballot.controller,
                                    "mesh": promise.mesh, "at": promise.at}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, self.path)
        except OSError as e:  # a full disk: held in memory, written with the next promise
            log.error("controller promise not written", epoch=promise.ballot.epoch,
                      controller=promise.ballot.controller, mesh=promise.mesh, path=str(self.path), error=str(e))
