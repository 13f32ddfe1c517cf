"""The controller's execute loop with fakes: what `feed` makes of each event the fleet decides on (the
agents it asks, what it writes to the store, what it counts), scenario by scenario, without processes.
A fake agent client answers as the agent would; a fake store records what is written; rank 0's
readiness is answered by the test."""

import asyncio
from types import SimpleNamespace

import pytest

from common.protocol import StopResult
from common.states import Phase, StopMode
from kit.configs import write_mesh
from meshd.config import load
from meshd.control import fleet
from meshd.control.controller import Controller
from meshd.metrics import Metrics
from meshd.nodes.agentclient import AgentError, Ranks
from meshd.seam import FleetRecord

NODES = ("n0", "n1")
FACTS = {"python": "3.11", "mlx": "0.1", "mlx_lm": "0.1",
         "model": {"present": True, "fingerprint": "f00d", "bytes": 1 << 20, "weight_files": 1},
         "launch": {"profiles": {"meshd-rank": []}, "env_allowlist": []}}


class FakeAgent:
    """One node's agent, as the controller's client sees it: every call recorded; `refuse` maps a call's
    name to the status the agent refuses it with; `survivors` the pids its stop leaves."""

    def __init__(self, node: str, refuse: dict[str, int] | None = None, survivors: tuple[int, ...] = ()):
        self.node, self.refuse, self.survivors = node, refuse or {}, survivors
        self.calls: list[tuple] = []
        self.specs: list = []
        self.boots = 0

    def _answer(self, name: str, *args):
        self.calls.append((name, *args))
        if name in self.refuse:
            raise AgentError(f"{self.node}: {name} -> {self.refuse[name]}: refused", self.refuse[name])

    async def node_facts(self, model=None, package=None, timeout=10.0) -> dict:
        self._answer("node_facts")
        return {**FACTS, "boot_id": f"boot {self.boots}"}

    async def start_rank(self, spec, timeout=30.0) -> bool:
        self.specs.append(spec)
        self._answer("start_rank", spec.generation)
        return True

    async def ranks(self, timeout=5.0) -> Ranks:
        """What runs, as the controller reads rank 0's weights from it: no rank's status yet."""
        return Ranks(self.node, None, (), (), None, False)

    async def stop_generation(self, generation, mode, grace=None, timeout=10.0) -> StopResult:
        self._answer("stop_generation", generation, mode, grace)
        return StopResult(generation, survivors=self.survivors)

    async def sweep(self, grace, generation, timeout=60.0):
        self._answer("sweep", generation)

    async def reboot(self, timeout=40.0) -> None:
        self._answer("reboot")
        self.boots += 1


class FakeStore:
    """The store's calls the controller makes, recorded; values kept in a dict."""

    def __init__(self):
        self.values: dict = {}
        self.writes: list[tuple] = []

    def get(self, key, default=None):
        return self.values.get(key, default)

    def put(self, key, value) -> None:
        self.values[key] = value
        self.writes.append(("put", key, value))

    def open_incident_row(self):
        return None

    def open_incident(self, incident) -> None:
        self.writes.append(("open_incident", incident.cause, incident.generation))

    def update_incident(self, incident, serving_back_at=None) -> None:
        self.writes.append(("update_incident", incident.cause, serving_back_at is not None))

    def note_generation(self, generation, what, at, detail="") -> None:
        self.writes.append(("note_generation", generation, what))

    def prune(self, generations, incidents) -> None:
        self.writes.append(("prune",))


@pytest.fixture
def mesh(tmp_path):
    agents = [SimpleNamespace(node=n, url=f"http://127.0.0.1:{9 + i}", dir=tmp_path) for i, n in enumerate(NODES)]
    return load(write_mesh(tmp_path, agents, tmp_path / "model", recovery={"stop_grace": 5.0, "drain_grace": 20.0}))


def controller(cfg, state: fleet.FleetState, agents: dict[str, FakeAgent], ready: bool = True) -> Controller:
    ctl = Controller(cfg, FakeStore(), Metrics(cfg.name))
    ctl.agents, ctl.state = agents, state
    spawn, ctl.spawned = ctl._spawn, []

    def spawned(coro):
        ctl.spawned.append(spawn(coro))
        return ctl.spawned[-1]

    async def readiness():
        return ready, None, "f1ngerprint" if ready else None

    ctl._spawn, ctl.readiness = spawned, readiness
    return ctl


async def feed(ctl: Controller, *events) -> None:
    """Each event, then every task the controller spawned for it, to the end (a task's error fails the test)."""
    for event in events:
        await ctl.feed(event)
        while not all(task.done() for task in ctl.spawned):
            await asyncio.wait(ctl.spawned)
        for task in ctl.spawned:
            task.result()


def restarts(ctl: Controller, reason: str) -> float:
    return ctl.metrics.registry.get_sample_value("meshd_restarts_total", {"reason": reason}) or 0.0


def kept(ctl: Controller) -> tuple[list, list, list]:
    """What the controller wrote to its store: the fleet records, the generations' notes (and prunes), the
    incidents' writes."""
    writes = ctl.store.writes
    return ([(r.phase, r.generation) for op, key, value in (w for w in writes if w[0] == "put")
             if key == FleetRecord.KEY and (r := FleetRecord.from_wire(value))],
            [w[1:] or w for w in writes if w[0] in ("note_generation", "prune")],
            [w for w in writes if w[0] in ("open_incident", "update_incident")])


READY = fleet.FleetState(phase=Phase.READY, generation=1, ready_since=0.0)
STOPPED = fleet.FleetState()
DIED = fleet.RankDied("n1", 1, 1, fleet.Cause.EXIT, "exit code 1")
STARTED = [("node_facts",), ("start_rank", 1)]
KILLED, DRAINED = [("stop_generation", 1, StopMode.KILL, 5.0), ("sweep", None)], \
    [("stop_generation", 1, StopMode.DRAIN, 20.0), ("sweep", None)]


@pytest.mark.parametrize("state, events, refuse, phase, calls, records, notes, incidents", [
    pytest.param(STOPPED, [fleet.UpRequested()], {}, Phase.READY, STARTED,
                 [("starting", 1), ("ready", 1)], [(1, "started"), ("prune",), (1, "ready")], [],
                 id="up: each agent's facts, then its rank of generation 1; ready once rank 0 answers"),
    pytest.param(STOPPED, [fleet.UpRequested()], {"start_rank": 400}, Phase.FAILED, STARTED + KILLED,
                 [("starting", 1), ("failed", 1)], [(1, "started"), ("prune",), (1, "ended")],
                 [("open_incident", "launch", 1), ("update_incident", "launch", False)],
                 id="an agent that refuses the spec (4xx): failed at once, the generation killed everywhere"),
    pytest.param(STOPPED, [fleet.UpRequested()], {"start_rank": 409}, Phase.RECOVERING, STARTED + KILLED,
                 [("starting", 1), ("recovering", 1)], [(1, "started"), ("prune",), (1, "ended")],
                 [("open_incident", "launch", 1)] + [("update_incident", "launch", False)] * 3,
                 id="an agent still running another generation (409): killed everywhere, then the ladder"),
    pytest.param(READY, [DIED, fleet.Tick()], {}, Phase.READY, KILLED + [("node_facts",), ("start_rank", 2)],
                 [("recovering", 1), ("starting", 2), ("ready", 2)],
                 [(1, "ended"), (2, "started"), ("prune",), (2, "ready")],
                 [("open_incident", "exit", 1)] + [("update_incident", "exit", False)] * 4
                 + [("update_incident", "exit", True)],
                 id="a death: killed and swept everywhere, the next generation at the tick, the incident closed"),
    pytest.param(READY, [fleet.DownRequested()], {}, Phase.STOPPED, DRAINED,
                 [("draining", 1), ("stopped", 1)], [(1, "ended")], [],
                 id="down: drained within drain_grace, swept, stopped"),
    pytest.param(READY, [fleet.DownRequested()], {"stop_generation": 503}, Phase.STOPPED, DRAINED,
                 [("draining", 1), ("stopped", 1)], [(1, "ended")], [],
                 id="an agent that cannot stop its generation: the sweep still runs, the fleet stops"),
])
def test_what_the_controller_carries_out(mesh, state, events, refuse, phase, calls, records, notes, incidents):
    agents = {"n0": FakeAgent("n0"), "n1": FakeAgent("n1", refuse)}
    ctl = controller(mesh, state, agents)
    asyncio.run(feed(ctl, *events))
    assert ctl.state.phase == phase
    assert [agents[n].calls for n in NODES] == [calls, calls]
    assert [[s.rank for s in agents[n].specs] for n in NODES] == [[0] * len(agents["n0"].specs),
                                                                  [1] * len(agents["n1"].specs)]
    assert kept(ctl) == (records, notes, incidents)


def test_the_node_where_processes_survived_the_stop_is_rebooted_alone_then_the_next_generation_starts(mesh):
    agents = {"n0": FakeAgent("n0"), "n1": FakeAgent("n1", survivors=(4242,))}
    ctl = controller(mesh, READY, agents)
    ctl.policy = fleet.Policy(nodes=NODES, ladder=("restart", "reboot"), stop_grace=5.0)
    asyncio.run(feed(ctl, DIED))
    assert (ctl.state.phase, ctl.state.generation, ctl.state.reboot_nodes) == (Phase.READY, 2, ())
    assert [("reboot",) in agents[n].calls for n in NODES] == [False, True]
    assert agents["n1"].boots == 1


@pytest.mark.parametrize("event, restarted, recycled", [
    (fleet.RankDied("n1", 1, 1, fleet.Cause.SIGNATURE, "cuda_error"), {"signature": 1.0}, 0.0),
    (fleet.RankDied("n1", 1, 1, fleet.Cause.STALL, "no progress", consequence=True), {}, 0.0),
    (fleet.RestartRequested(), {}, 1.0),
])
def test_a_failure_counts_one_restart_under_its_root_cause_and_a_planned_one_none(mesh, event, restarted, recycled):
    ctl = controller(mesh, READY, {n: FakeAgent(n) for n in NODES})
    asyncio.run(feed(ctl, event))
    assert {c: restarts(ctl, c) for c in fleet.Cause if restarts(ctl, c)} == restarted
    assert (ctl.metrics.registry.get_sample_value("meshd_recycles_total", {"reason": "restart"}) or 0.0) == recycled
