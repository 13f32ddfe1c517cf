"""What an edited mesh.toml changes, and what each change needs (`meshctl apply`): pure, over two loaded configs.

A new generation applies the ranks' launch (runtime args, env, draft model, seed: the drafter, snapshots and limits
are runtime args); meshd-proxy reads its own keys, and the runtime args it serves by, as it starts (its handover
applies them); meshctl reads [ssh] at every command. What else changed needs the controller started again on it,
or more (nodes, ports, the model, the recovery policy): those changes are named with the command that applies
them, and nothing is applied while any is there. A config's digest names it (`meshctl status` shows the one each
generation runs)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import StrEnum

from meshd.config import MeshConfig

KEY = "configs"  # the store's record of the config digest each generation started with
KEPT = 100  # generations whose digest is kept


class Needs(StrEnum):
    GENERATION = "applies at the next generation"
    PROXY = "applies at meshd-proxy's handover (meshctl apply hands it over)"
    NOTHING = "applies at once (meshctl reads it at every command)"
    NODES = "needs `meshctl down`, then `meshctl up` (the controller starts with the new node list)"
    PORTS = "needs `meshctl down`, then `meshctl up` (the ranks, controller and proxy listen anew)"
    MODEL = ("needs `meshctl down`, then `meshctl up` (a new model loads from the start; `meshctl model pull` "
             "first for one not on the nodes)")
    CONTROLLER = "needs `meshctl down`, then `meshctl up` (the controller reads it as it starts)"

    @property
    def applies(self) -> bool:
        """Can `meshctl apply` apply it (else it names the command that does)?"""
        return self in (Needs.GENERATION, Needs.PROXY, Needs.NOTHING)


# The first of these prefixes a changed key starts with says what it needs (a key of none: CONTROLLER).
NEEDS = (
    ("runtime.args.", Needs.GENERATION), ("runtime.env.", Needs.GENERATION), ("runtime.draft_model", Needs.GENERATION),
    ("runtime.seed", Needs.GENERATION),
    ("runtime.port", Needs.PORTS), ("runtime.ring_port", Needs.PORTS), ("runtime.host", Needs.PORTS),
    ("control.", Needs.PORTS), ("proxy.listen", Needs.PORTS),
    ("runtime.", Needs.MODEL),  # model, model_package, profile, aliases
    ("proxy.", Needs.PROXY), ("ssh.", Needs.NOTHING),
    ("nodes", Needs.NODES), ("backend", Needs.NODES), ("hostfile", Needs.NODES),
)


@dataclass(frozen=True)
class Change:
    key: str
    before: object
    after: object
    needs: Needs

    def line(self) -> str:
        return f"{self.key}: {_shown(self.before)} -> {_shown(self.after)}: {self.needs.value}"

    def wire(self) -> dict:
        return {"key": self.key, "before": self.before, "after": self.after, "applies": self.needs.applies,
                "needs": self.needs.value}

    @classmethod
    def from_wire(cls, d: dict) -> "Change":
        return cls(d["key"], d["before"], d["after"], Needs(d["needs"]))


def _shown(value: object) -> str:
    return "(unset)" if value is None else json.dumps(value)


def flat(cfg: MeshConfig) -> dict[str, object]:
    """The config as dotted keys of JSON values (runtime.args.drafter, proxy.listen, nodes), its file's path aside."""
    raw = json.loads(json.dumps(asdict(cfg), default=str))
    raw.pop("path")
    nodes = raw.pop("nodes")
    out: dict[str, object] = {"nodes": [n["name"] for n in nodes]}  # in rank order
    out.update({f"nodes.{n['name']}.{k}": v for n in nodes for k, v in n.items() if k != "name"})

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict) and prefix.count(".") < 2:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", raw)
    return out


def needs(key: str) -> Needs:
    return next((n for prefix, n in NEEDS if key.startswith(prefix)), Needs.CONTROLLER)


def proxy_reads(key: str) -> bool:
    """Does meshd-proxy read this key as it starts (its own table, and what it serves by: the answer lengths and
    the served name in the runtime args)?"""
    return key.startswith(("proxy.", "runtime.args."))


def changes(running: MeshConfig, edited: MeshConfig) -> list[Change]:
    """Every key whose value differs, each with what it needs (a node added or removed: as the node list)."""
    old, new = flat(running), flat(edited)
    return [Change(k, old.get(k), new.get(k), needs(k)) for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k) and not (k.startswith("nodes.") and None in (old.get(k), new.get(k)))]


def digest(cfg: MeshConfig) -> str:
    """A config's name: the same for the same settings, whatever the file's comments, order or path."""
    return hashlib.sha256(json.dumps(flat(cfg), sort_keys=True).encode()).hexdigest()[:12]


def remember(kept: dict[str, str], generation: int, config: str) -> dict[str, str]:
    """The store's record with `generation`'s digest added, the newest KEPT generations kept."""
    out = {**kept, str(generation): config}
    return {g: out[g] for g in sorted(out, key=int)[-KEPT:]}


def view(cfg: MeshConfig, kept: dict[str, str], generation: int) -> dict:
    """What the status says of configs: the digest `generation` started with ("" unknown: it started before a
    controller kept one), the one the next generation starts with, and the newest generations' digests."""
    return {"running": kept.get(str(generation), ""), "next": digest(cfg),
            "generations": {g: kept[g] for g in sorted(kept, key=int)[-10:]}}
