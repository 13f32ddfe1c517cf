"""The fleet state machine, scenario by scenario, without I/O."""

from datetime import datetime

import pytest

from common.protocol import RankReport
from common.states import RankState
from meshd.config import Recycle
from meshd.control import fleet as f

NODES = ("n0", "n1")
P = f.Policy(nodes=NODES, ladder=("restart",), backoff_base=1.0, backoff_max=8.0, max_failures=3, window=100.0,
             healthy_reset=50.0, stop_grace=5.0, drain_grace=20.0, start_deadline=300.0)
LADDER = f.Policy(nodes=NODES, ladder=("restart", "reprovision", "reboot"), max_failures=10)


def run(events, policy=P, state=None):
    """Feed (time, event) pairs; returns the final state and every action."""
    state = state or f.FleetState()
    actions = []
    for now, ev in events:
        state, acts = f.step(state, ev, now, policy)
        actions += acts
    return state, actions


def kinds(actions):
    return [type(a).__name__ for a in actions]


def ready_at(g=1, t=10.0):
    return [(0, f.UpRequested()), (t, f.MeshReady(g))]


def death(g, t, node="n1", cause="exit", reboot=False):
    return (t, f.RankDied(node, 1, g, cause, "code 0", reboot=reboot))


def test_up_starts_generation_1_and_ready_when_the_mesh_says_so():
    s, a = run(ready_at())
    assert (s.phase, s.generation, s.ready_since) == ("ready", 1, 10.0)
    assert kinds(a) == ["StartGeneration", "NoteGeneration", "NoteGeneration"]


def test_every_ladder_step_is_recorded_on_the_incident():
    s, a = run(ready_at() + [death(1, 20), (21, f.GenerationStopped(1)), (21, f.Tick()), (30, f.MeshReady(2))])
    updates = [x.incident.steps for x in a if isinstance(x, f.IncidentUpdated)]
    close = [x for x in a if isinstance(x, f.CloseIncident)][0]
    assert sorted(set(updates)) == [(), ("restart",)] and close.steps == ("restart",)


def test_up_is_idempotent_while_running():
    s, a = run(ready_at() + [(11, f.UpRequested())])
    assert s.phase == "ready" and kinds(a).count("StartGeneration") == 1


def test_a_death_ends_the_generation_everywhere_then_the_next_starts_without_waiting():
    s, a = run(ready_at() + [death(1, 20)])
    assert s.phase == "recovering"
    assert a[-2] == f.StopGeneration(1, "kill", 5.0)
    assert isinstance(a[-3], f.OpenIncident) and a[-3].incident.cause == "exit"
    s, a = run([(21, f.GenerationStopped(1)), (21, f.Tick())], state=s)
    assert (s.phase, s.generation) == ("starting", 2)
    assert f.StartGeneration(2) in a


def test_recovery_closes_the_incident_when_serving_is_back():
    s, a = run(ready_at() + [death(1, 20), (21, f.GenerationStopped(1)), (21, f.Tick()), (30, f.MeshReady(2))])
    close = [x for x in a if isinstance(x, f.CloseIncident)]
    assert len(close) == 1 and close[0].serving_back_at == 30 and close[0].incident.opened_at == 20
    assert s.incident is None and s.phase == "ready"


def test_second_failure_waits_out_an_exponential_backoff():
    events = ready_at() + [death(1, 20), (21, f.GenerationStopped(1)), (21, f.Tick()), (25, f.MeshReady(2)),
                           death(2, 30), (31, f.GenerationStopped(2))]
    s, _ = run(events)
    assert s.backoff_until == 31 + 1.0
    s2, a = run([(31.5, f.Tick())], state=s)
    assert s2.phase == "recovering" and a == []
    s3, a = run([(32.0, f.Tick())], state=s)
    assert s3.phase == "starting" and s3.generation == 3


@pytest.mark.parametrize("n,wait", [(1, 0.0), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (9, 8.0)])
def test_backoff_table(n, wait):
    assert f.backoff(P, n) == wait


def test_too_many_failures_in_the_window_is_failed_and_up_tries_again():
    events, t, g = [(0, f.UpRequested())], 1.0, 1
    for _ in range(4):
        events += [death(g, t), (t, f.GenerationStopped(g)), (t + 10, f.Tick())]
        t += 11
        g += 1
    s, _ = run(events)
    assert s.phase == "failed" and "4 failures within 100s" in s.reason and "meshctl up" in s.reason
    s, a = run([(t, f.UpRequested())], state=s)
    assert s.phase == "starting" and s.failures == () and a[0] == f.StartGeneration(s.generation)


def test_failures_outside_the_window_do_not_count():
    events, t, g = [(0, f.UpRequested())], 1.0, 1
    for _ in range(6):
        events += [death(g, t), (t, f.GenerationStopped(g)), (t + 10, f.Tick())]
        t += 60
        g += 1
    s, _ = run(events)
    assert s.phase == "starting" and len(s.failures) == 2


def test_being_healthy_long_enough_resets_the_count():
    s, _ = run(ready_at() + [death(1, 20), (21, f.GenerationStopped(1)), (21, f.Tick()), (25, f.MeshReady(2)),
                             (74, f.Tick())])
    assert s.failures == (20,)
    s, _ = run([(75, f.Tick())], state=s)
    assert s.failures == () and s.ladder_step == 0


def test_events_about_an_older_generation_are_ignored():
    s, _ = run(ready_at() + [death(1, 20), (21, f.GenerationStopped(1)), (21, f.Tick()), (25, f.MeshReady(2))])
    s2, a = run([death(1, 26), (27, f.MeshReady(1)), (27, f.GenerationStopped(1))], state=s)
    assert s2 == s and a == []


def test_a_second_death_of_the_same_generation_is_one_incident():
    s, a = run(ready_at() + [death(1, 20), death(1, 20.1, node="n0")])
    assert kinds(a).count("OpenIncident") == 1 and kinds(a).count("StopGeneration") == 1


def test_down_drains_then_stops():
    s, a = run(ready_at() + [(20, f.DownRequested())])
    assert s.phase == "draining" and a[-1] == f.StopGeneration(1, "drain", 20.0)
    s, a = run([(25, f.GenerationStopped(1))], state=s)
    assert s.phase == "stopped" and s.ranks == ()


def test_forced_down_kills():
    s, a = run(ready_at() + [(20, f.DownRequested(force=True))])
    assert a[-1] == f.StopGeneration(1, "kill", 5.0)


def test_down_from_failed_is_stopped_at_once():
    s = f.FleetState(phase="failed", generation=4)
    s, a = run([(1, f.DownRequested())], state=s)
    assert s.phase == "stopped" and a == [f.StopGeneration(4, "kill", 0.0)]


def test_restart_requested_drains_and_starts_the_next_without_counting_a_failure():
    s, a = run(ready_at() + [(20, f.RestartRequested()), (22, f.GenerationStopped(1))])
    assert (s.phase, s.generation, s.failures) == ("starting", 2, ())
    assert f.StopGeneration(1, "drain", 20.0) in a


def test_a_mesh_not_ready_by_the_start_deadline_is_a_failure():
    s, a = run([(0, f.UpRequested()), (301, f.Tick())])
    assert s.phase == "recovering" and s.incident.cause == "start_timeout"


def test_rank_reports_update_load_progress():
    s, _ = run([(0, f.UpRequested()), (1, f.RankReported("n1", 1, "loading", 3, 10))])
    assert s.ranks == (f.RankView("n0", RankState.SPAWNED), f.RankView("n1", RankState.LOADING, 3, 10))


def test_adopting_a_running_generation_does_not_restart_it():
    s, a = run([(0, f.Adopted(7, ready=True))])
    assert (s.phase, s.generation) == ("ready", 7) and a == []


def test_an_incident_a_restarted_controller_inherited_closes_when_it_adopts_a_ready_mesh():
    inherited = f.Incident(5.0, "exit", "n1", 1, 6, "rank 1 exited", ("restart",))
    s, a = run([(9, f.Adopted(7, ready=True))], state=f.FleetState(generation=6, incident=inherited))
    assert s.phase == "ready" and s.incident is None
    assert a == [f.CloseIncident(inherited.at("ready", 9), 9, ("restart",))]
    s, a = run([(9, f.Adopted(7, ready=False))], state=f.FleetState(generation=6, incident=inherited))
    assert s.phase == "starting" and s.incident == inherited and a == [f.ProbeReadiness(7)]
    s, a = run([(12, f.MeshReady(7))], state=s)
    (close,) = [x for x in a if isinstance(x, f.CloseIncident)]
    assert s.incident is None and (close.incident.opened_at, close.serving_back_at, close.steps) == (5.0, 12, ("restart",))


def test_ladder_climbs_restart_then_reprovision_then_reboot():
    events = [(0, f.UpRequested()), (1, f.MeshReady(1)), death(1, 2), (2, f.GenerationStopped(1)), (2, f.Tick()),
              (3, f.MeshReady(2)), death(2, 4), (4, f.GenerationStopped(2))]
    s, a = run(events, LADDER)
    assert a[-1] == f.RunStep("reprovision", NODES)
    s, a = run([(5, f.StepDone("reprovision", True))], LADDER, s)
    assert s.phase == "starting" and s.generation == 3
    s, a = run([(6, f.MeshReady(3)), death(3, 7), (7, f.GenerationStopped(3))], LADDER, s)
    assert a[-1] == f.RunStep("reboot", NODES)
    s, a = run([(8, f.StepDone("reboot", True))], LADDER, s)
    assert a[-1] == f.RunStep("reprovision", NODES)
    assert s.incident.steps == ("reboot", "reprovision")
    s, a = run([(9, f.StepDone("reprovision", True))], LADDER, s)
    assert s.phase == "starting" and s.generation == 4


def test_reboot_evidence_skips_to_the_reboot_step_for_that_node():
    s, a = run([(0, f.UpRequested()), (1, f.MeshReady(1)), death(1, 2, node="n1", cause="signature", reboot=True),
                (3, f.GenerationStopped(1))], LADDER)
    assert a[-1] == f.RunStep("reboot", ("n1",))


def test_a_survivor_of_sigkill_means_reboot_that_node():
    s, a = run([(0, f.UpRequested()), (1, f.MeshReady(1)), death(1, 2), (3, f.GenerationStopped(1, ("n0",)))],
               LADDER)
    assert a[-1] == f.RunStep("reboot", ("n0",))


def test_a_failed_ladder_step_climbs_on_and_exhaustion_is_failed():
    s, a = run([(0, f.UpRequested()), (1, f.MeshReady(1)), death(1, 2, reboot=True), (3, f.GenerationStopped(1)),
                (4, f.StepDone("reboot", False, "n1 did not come back"))], LADDER)
    assert s.phase == "failed" and "n1 did not come back" in s.reason


def ranks(*gen_rank_state):
    return [RankReport.from_dict({"generation": g, "rank": r, "state": st}) for g, r, st in gen_rank_state]


def exited(g: int, r: int, expected=False, peer_lost=False, exit_code=None, exit_signal=None) -> RankReport:
    return RankReport.from_dict({"generation": g, "rank": r, "state": "exited", "expected": expected,
                                 "peer_lost": peer_lost, "exit_code": exit_code, "exit_signal": exit_signal})


@pytest.mark.parametrize("views,desired_up,ready,expected", [
    ({"n0": ranks((7, 0, "ready")), "n1": ranks((7, 1, "ready"))}, True, True, f.Adopted(7, True)),
    ({"n0": ranks((7, 0, "loading")), "n1": ranks((6, 1, "exited"), (7, 1, "loading"))}, False, False,
     f.Adopted(7, False)),
    ({"n0": ranks((6, 0, "exited")), "n1": []}, True, False, f.UpRequested()),
    ({"n0": [], "n1": []}, False, False, None),
    ({"n0": ranks((7, 0, "ready")), "n1": []}, True, False, f.LeftoversFound(7, True)),
    ({"n0": ranks((7, 0, "ready")), "n1": ranks((8, 1, "loading"))}, False, False, f.LeftoversFound(8, False)),
    ({"n0": ranks((7, 1, "ready")), "n1": ranks((7, 0, "ready"))}, True, True, f.LeftoversFound(7, True)),
    ({"n0": ranks((7, 0, "ready")), "n1": None}, True, True, f.Adopted(7, True)),
    ({"n0": ranks((7, 0, "ready")), "n1": None}, True, False, None),
    ({"n0": ranks((7, 1, "ready")), "n1": None}, True, True, None),
    ({"n0": None, "n1": []}, True, False, f.UpRequested()),
    ({"n0": [exited(7, 0, peer_lost=True, exit_code=1)], "n1": [exited(7, 1, exit_signal=9)]}, True, False,
     f.DiedUnwatched(f.RankDied("n1", 1, 7, "exit", "signal 9, while no controller watched"))),
    ({"n0": ranks((7, 0, "ready")), "n1": [exited(7, 1, exit_code=1)]}, True, True,
     f.DiedUnwatched(f.RankDied("n1", 1, 7, "exit", "exit code 1, while no controller watched"))),
    ({"n0": [exited(7, 0, peer_lost=True, exit_code=1)], "n1": [exited(7, 1, peer_lost=True, exit_code=1)]}, True,
     False, f.DiedUnwatched(f.RankDied("n0", 0, 7, "exit", "exit code 1, while no controller watched",
                                       consequence=True))),
    ({"n0": [exited(6, 0, exit_code=1)], "n1": [exited(7, 1, expected=True, exit_code=0)]}, True, False,
     f.UpRequested()),
    ({"n0": [exited(7, 0, exit_code=1)], "n1": []}, False, False, None),
], ids=["whole-ready", "whole-loading", "nothing-up", "nothing-down", "partial", "mixed", "swapped",
        "unanswered-serving", "unanswered-not-serving", "unanswered-wrong-rank", "unanswered-nothing-running",
        "died-unwatched", "died-unwatched-rank0-alive", "only-peers-lost", "stopped-on-purpose",
        "died-but-operator-down"])
def test_adoption_decision_table(views, desired_up, ready, expected):
    assert f.decide_adoption(views, NODES, desired_up=desired_up, rank0_ready=ready) == expected


def test_leftovers_are_stopped_then_the_next_generation_starts_above_them():
    s, a = run([(0, f.LeftoversFound(9, up=True))], state=f.FleetState(generation=4))
    assert (s.phase, s.generation) == ("recovering", 9) and a == [f.StopGeneration(9, "kill", 5.0)]
    s, a = run([(1, f.GenerationStopped(9))], state=s)
    assert (s.phase, s.generation, s.failures) == ("starting", 10, ()) and f.StartGeneration(10) in a


def test_a_death_no_controller_watched_is_an_incident_and_the_next_generation_starts():
    died = f.RankDied("n1", 1, 7, "exit", "signal 9, while no controller watched")
    s, a = run([(0, f.DiedUnwatched(died))], state=f.FleetState(generation=7))
    assert (s.phase, s.generation) == ("recovering", 7) and f.StopGeneration(7, "kill", 5.0) in a
    assert (s.incident.cause, s.incident.node, s.incident.generation) == ("exit", "n1", 7)
    s, a = run([(1, f.GenerationStopped(7)), (1, f.Tick())], state=s)
    assert (s.phase, s.generation) == ("starting", 8) and f.StartGeneration(8) in a


@pytest.mark.parametrize("stored,found,first", [(0, 0, 1), (0, 40, 41), (30, 40, 41), (50, 40, 51)],
                         ids=["fresh-mesh", "fresh-store-over-agents-of-another", "restored-backup", "store-ahead"])
def test_the_first_generation_is_numbered_above_the_stores_and_every_agents(stored, found, first):
    s, a = run([(0, f.GenerationsFound(found)), (1, f.UpRequested())], state=f.FleetState(generation=stored))
    assert (s.phase, s.generation) == ("starting", first) and f.StartGeneration(first) in a


def test_a_running_generation_of_another_store_is_adopted_under_its_own_number_and_the_next_is_above_all():
    s, a = run([(0, f.GenerationsFound(40)), (1, f.Adopted(2, ready=True))])
    assert (s.phase, s.generation, a) == ("ready", 2, [])
    s, a = run([death(2, 5), (6, f.GenerationStopped(2)), (6, f.Tick())], state=s)
    assert (s.phase, s.generation) == ("starting", 41) and f.StartGeneration(41) in a
    s, a = run([(0, f.GenerationsFound(40)), (1, f.LeftoversFound(9, up=True)), (2, f.GenerationStopped(9))])
    assert f.StopGeneration(9, "kill", 5.0) in a and (s.phase, s.generation) == ("starting", 41)


def test_leftovers_with_the_operator_down_are_stopped_and_stay_stopped():
    s, a = run([(0, f.LeftoversFound(3, up=False)), (1, f.GenerationStopped(3))])
    assert (s.phase, s.generation) == ("stopped", 3) and f.StopGeneration(3, "kill", 5.0) in a


# --- judgement -----------------------------------------------------------------------

def test_deterministic_evidence_is_failed_at_once_without_climbing_the_ladder():
    refused = f.RankDied("n0", 0, 1, "launch", "model path '/m' does not exist on node n0", deterministic=True)
    s, a = run([(0, f.UpRequested()), (1, refused), (2, f.GenerationStopped(1))], LADDER)
    assert s.phase == "failed" and "does not exist" in s.reason and "no restart can fix it" in s.reason
    assert not [x for x in a if isinstance(x, f.RunStep)] and kinds(a).count("StartGeneration") == 1
    assert s.incident.steps == ("failed",)


def test_the_same_fatal_line_at_load_twice_in_a_row_is_deterministic():
    line = "ValueError: Model type no_such_architecture not supported."
    s, a = run([(0, f.UpRequested()), (1, f.RankDied("n0", 0, 1, "exit", "exit code 1", load_line=line)),
                (2, f.GenerationStopped(1)), (2, f.Tick())], LADDER)
    assert (s.phase, s.generation) == ("starting", 2)
    s, a = run([(3, f.RankDied("n1", 1, 2, "exit", "exit code 1", load_line=line))], LADDER, s)
    assert s.phase == "failed" and "the same failure at load" in s.reason


def test_different_load_failures_or_a_served_generation_between_them_keep_climbing():
    s, _ = run([(0, f.UpRequested()), (1, f.RankDied("n0", 0, 1, "exit", "1", load_line="A")),
                (2, f.GenerationStopped(1)), (2, f.Tick()), (3, f.RankDied("n0", 0, 2, "exit", "1", load_line="B"))])
    assert s.phase == "recovering"
    s, _ = run([(0, f.UpRequested()), (1, f.RankDied("n0", 0, 1, "exit", "1", load_line="A")),
                (2, f.GenerationStopped(1)), (2, f.Tick()), (3, f.MeshReady(2)),
                (9, f.RankDied("n0", 0, 2, "signature", "jaccl_enomem")), (10, f.GenerationStopped(2)),
                (10, f.Tick()), (12, f.RankDied("n0", 0, 3, "exit", "1", load_line="A"))])
    assert s.phase == "recovering"


def test_a_refused_start_is_failed_with_the_preflight_words():
    s, a = run([(0, f.UpRequested()), (0.1, f.StartRefused(1, "model: no model at /m on n1"))], LADDER)
    assert s.phase == "failed" and "no model at /m on n1" in s.reason and f.StopGeneration(1, "kill", 10.0) in a


def test_the_rank_that_died_by_itself_is_the_cause_and_peers_that_lost_it_are_consequences():
    lost = f.RankDied("n0", 0, 1, "signature", "ring_send_failed: [ring] Sending to socket 5 failed", consequence=True)
    killed = f.RankDied("n1", 1, 1, "exit", "signal 9")
    s, a = run(ready_at() + [(20, lost), (20.05, killed), (20.1, f.RankDied("n0", 0, 1, "exit", "exit code 1",
                                                                           consequence=True))])
    i = s.incident
    assert (i.cause, i.node, i.rank, i.detail, i.primary) == ("exit", "n1", 1, "signal 9", True)
    assert [c.split(":")[0] for c in i.consequences] == ["n0 rank 0", "n0 rank 0"]
    assert "ring_send_failed" in i.consequences[0] and s.reason == "exit on n1 rank 1: signal 9"
    assert i.opened_at == 20 and kinds(a).count("OpenIncident") == 1 and kinds(a).count("StopGeneration") == 1


def test_evidence_after_the_death_window_is_not_the_incidents():
    s, _ = run(ready_at() + [death(1, 20), (25, f.RankDied("n0", 0, 1, "stall", "no progress"))])
    assert s.incident.consequences == () and s.incident.node == "n1"


@pytest.mark.parametrize("arrives,happened,stopped,takes_over", [
    (25, 19.9, [], True),     # died before the peers' lines, its agent's events arrived late (it reconnected)
    (25, 24.0, [], True),     # seen past the window, before the stop ended: slow to reap, or its agent starved
    (25, None, [], True),     # no time of its own: judged by its arrival, before the stop ended
    (25, 24.0, [(22, f.GenerationStopped(1, stopped_at=22))], False),  # after the stop: not this generation's death
    (25, None, [(22, f.GenerationStopped(1, stopped_at=22))], False),
])
def test_a_cause_is_judged_by_when_it_happened_not_when_it_arrived(arrives, happened, stopped, takes_over):
    lost = f.RankDied("n0", 0, 1, "signature", "ring_peer_lost", consequence=True, at=20)
    killed = f.RankDied("n1", 1, 1, "exit", "gone (not the agent's child)", at=happened)
    s, _ = run(ready_at() + [(20, lost)] + stopped + [(arrives, killed)])
    assert (s.incident.node == "n1") is takes_over


@pytest.mark.parametrize("meanwhile,open_as", [
    ([], "incident"),                                                              # still stopping
    ([(20.5, f.GenerationStopped(1)), (20.5, f.Tick())], "incident"),              # generation 2 starting
    ([(20.5, f.GenerationStopped(1)), (20.5, f.Tick()), (21, f.MeshReady(2))], "closing"),  # ready again
])
def test_a_cause_that_arrives_after_the_restart_began_still_takes_the_incident_over(meanwhile, open_as):
    lost = f.RankDied("n0", 0, 1, "signature", "ring_peer_lost", consequence=True, at=20)
    killed = f.RankDied("n1", 1, 1, "exit", "gone (not the agent's child)", at=20.01)
    s, a = run(ready_at() + [(20, lost)] + meanwhile + [(21.5, killed)])
    i = getattr(s, open_as)
    assert (i.node, i.cause, i.generation, i.primary) == ("n1", "exit", 1, True)
    assert i.consequences == ("n0 rank 0: signature: ring_peer_lost",) and a[-1] == f.IncidentUpdated(i)
    assert kinds(a).count("StopGeneration") == 1 and s.generation == (1 if not meanwhile else 2)


def test_evidence_about_an_older_generation_than_the_incidents_is_dropped():
    s, _ = run(ready_at() + [death(1, 20), (20.5, f.GenerationStopped(1)), (20.5, f.Tick()),
                             (21, f.MeshReady(2)), (30, f.RankDied("n0", 0, 2, "signature", "x", consequence=True)),
                             (30.5, f.RankDied("n0", 0, 1, "exit", "signal 9", at=20.1))])
    assert (s.incident.generation, s.incident.node, s.incident.consequences) == (2, "n0", ())


def test_a_cause_that_arrived_first_is_not_taken_over():
    s, _ = run(ready_at() + [death(1, 20), (20.1, f.RankDied("n0", 0, 1, "exit", "signal 9"))])
    assert (s.incident.node, s.incident.consequences) == ("n1", ("n0 rank 0: exit: signal 9",))


def test_the_timeline_runs_from_detection_to_the_first_request_served():
    P2 = f.Policy(nodes=NODES, backoff_base=1.0, max_failures=5)
    events = ready_at() + [death(1, 20), (20.5, f.GenerationStopped(1, stopped_at=20.4)), (20.5, f.Tick()),
                           (22, f.RankReported("n0", 2, "armed")), (22.5, f.RankReported("n1", 2, "ready")),
                           (23, f.MeshReady(2)), (24, f.RequestServed(2)),
                           death(2, 30), (31, f.GenerationStopped(2, stopped_at=30.6))]
    s, a = run(events, P2)
    served = [x.incident for x in a if isinstance(x, f.IncidentUpdated) and x.incident.timeline[-1][0] == "served"]
    assert served[0].timeline == (("detected", 20), ("stopped", 20.4), ("swept", 20.5), ("started", 20.5),
                                  ("loaded", 22.5), ("ready", 23), ("served", 24))
    assert [step for step, _ in s.incident.timeline] == ["detected", "stopped", "swept", "backoff"]


def test_a_last_rank_loaded_reported_after_ready_goes_into_the_closed_incidents_timeline():
    P2 = f.Policy(nodes=NODES, max_failures=5)
    events = ready_at() + [death(1, 20), (20.5, f.GenerationStopped(1, stopped_at=20.4)), (20.5, f.Tick()),
                           (22, f.RankReported("n0", 2, "ready", at=21.9)), (23, f.MeshReady(2)),
                           (23.01, f.RankReported("n1", 2, "ready", at=22.95)), (24, f.RequestServed(2))]
    s, a = run(events, P2)
    last = [x.incident for x in a if isinstance(x, f.IncidentUpdated)][-1]
    assert [step for step, _ in last.timeline] == ["detected", "stopped", "swept", "started", "loaded", "ready",
                                                   "served"]
    assert dict(last.timeline)["loaded"] == 22.95


# --- planned recycling -----------------------------------------------------------
AGED = f.Policy(nodes=NODES, recycle=Recycle(after=100.0, idle_for=10.0))


def busy(t, node="n0", state="busy"):
    return (t, f.RankReported(node, 1, state))


@pytest.mark.parametrize("events, recycled", [
    ([(105, f.Tick())], False),  # not yet its age
    ([(115, f.Tick())], True),  # its age, idle since ready
    ([busy(100), (115, f.Tick())], False),  # its age, a request in flight
    ([busy(100), busy(108, state="ready"), (115, f.Tick())], False),  # idle only 7s
    ([busy(100), busy(108, state="ready"), (118, f.Tick())], True),
    ([busy(100), busy(101, "n1"), busy(108, state="ready"), (120, f.Tick())], False),  # n1 still busy
])
def test_a_generation_is_recycled_at_its_age_only_once_idle_for_long_enough(events, recycled):
    s, a = run(ready_at() + events, AGED)
    opened = [x for x in a if isinstance(x, f.OpenIncident)]
    assert bool(opened) == recycled and (s.phase == "recovering") == recycled
    if recycled:
        assert opened[0].planned == "age" and opened[0].incident.cause == "recycle"
        assert f.StopGeneration(1, "drain", AGED.drain_grace) in a


BUSY_DUE = f.Policy(nodes=NODES, recycle=Recycle(after=100.0, idle_for=10.0, idle_deadline=60.0))


def back_to_back(start, end, every=5.0):
    """Streams back to back: rank 0 busy, a moment idle between two, busy again; a tick after each."""
    t, events = start, []
    while t < end:
        events += [busy(t), busy(t + 0.1, state="ready"), busy(t + 0.2), (t + 0.3, f.Tick())]
        t += every
    return events


@pytest.mark.parametrize("policy, until, recycled", [
    (BUSY_DUE, 150, False),  # due at 110 (its age, the first tick), waiting for idle: 40s of 60
    (BUSY_DUE, 175, True),  # busy 60s since it was due: recycled under load
    (f.Policy(nodes=NODES, recycle=Recycle(after=100.0, idle_for=10.0, idle_deadline=0.0)), 1000, False),
])
def test_a_generation_busy_back_to_back_is_recycled_once_it_waited_idle_deadline(policy, until, recycled):
    s, a = run(ready_at() + back_to_back(11, until), policy)
    opened = [x for x in a if isinstance(x, f.OpenIncident)]
    assert (s.phase == "recovering") == recycled and len(opened) == recycled
    if recycled:
        assert opened[0].planned == "age" and "recycle.idle_deadline 60s" in opened[0].incident.detail
        assert f.StopGeneration(1, "drain", policy.drain_grace) in a
    else:
        assert s.phase == "ready" and (s.due_since is not None) == (until > 110)


def test_the_wait_for_idle_counts_from_when_the_generation_was_due_and_starts_again_with_the_next():
    s, _ = run(ready_at() + back_to_back(11, 100), BUSY_DUE)
    assert s.due_since is None, "not due before its age, however busy"
    s, _ = run(back_to_back(100, 120), BUSY_DUE, s)
    assert s.due_since == 110.3, "due from the first tick past its age"
    s, _ = run([(170.3, f.Tick()), (172, f.GenerationStopped(1)), (180, f.MeshReady(2))], BUSY_DUE, s)
    assert (s.generation, s.phase, s.due_since) == (2, "ready", None)


@pytest.mark.parametrize("planned_restart", ["drain", "cut"])
def test_a_planned_restart_says_how_it_ends_until_the_next_generation_starts(planned_restart):
    policy = f.Policy(nodes=NODES, drain_grace=20.0, planned_restart=planned_restart,
                      recycle=Recycle(after=100.0, idle_for=10.0))
    for ending in ([(20, f.RestartRequested())], [busy(100), busy(105, state="ready"), (116, f.Tick())]):
        s, a = run(ready_at() + ending, policy)
        assert (s.phase, s.planned) == ("recovering", planned_restart)
        assert f.StopGeneration(1, "drain", 20.0) in a, "either way the generation drains (cut: nothing is left)"
        s, _ = run([(30 + ending[-1][0], f.GenerationStopped(1))], policy, s)
        assert (s.phase, s.generation, s.planned) == ("starting", 2, "")


def test_a_death_is_never_planned():
    s, _ = run(ready_at() + [death(1, 20)], f.Policy(nodes=NODES, planned_restart="drain"))
    assert (s.phase, s.planned) == ("recovering", "")


def test_recycling_is_off_by_default():
    s, a = run([(10 ** 6, f.Tick())], state=run(ready_at())[0])
    assert (s.phase, a) == ("ready", [])


def test_a_recycle_starts_the_next_generation_as_a_planned_incident_never_a_failure():
    s, a = run(ready_at() + [(115, f.Tick()), (117, f.GenerationStopped(1)), (118, f.Tick())], AGED)
    assert (s.phase, s.generation, s.failures, s.backoff_until, s.ladder_step) == ("starting", 2, (), None, 0)
    s, a = run([(125, f.MeshReady(2)), (126, f.RequestServed(2))], AGED, s)
    closed = next(x.incident for x in a if isinstance(x, f.CloseIncident))
    assert (closed.cause, closed.steps, closed.generation) == ("recycle", ("recycle",), 1)
    assert [step for step, _ in closed.timeline] == ["planned", "stopped", "swept", "started", "ready"]
    assert s.failures == () and s.phase == "ready" and s.idle_since == 125
    assert run([(200, f.Tick())], AGED, s)[0].phase == "ready", "the new generation's age counts from its ready"


def test_a_failure_while_a_recycle_starts_the_next_generation_is_an_incident_of_its_own():
    s, _ = run(ready_at() + [(115, f.Tick()), (117, f.GenerationStopped(1)), death(2, 120)], AGED)
    assert (s.incident.cause, s.incident.generation, len(s.failures)) == ("exit", 2, 1)


def local(hour, minute, day=1):
    return datetime(2026, 12, day, hour, minute).timestamp()


@pytest.mark.parametrize("window, ready, tick, recycled", [
    ("03:00-04:00", local(1, 0), local(3, 10), True),
    ("03:00-04:00", local(1, 0), local(4, 10), False),  # past the window
    ("03:00-04:00", local(3, 5), local(3, 30), False),  # started inside this window: recycled already
    ("03:00-04:00", local(3, 5, day=1), local(3, 30, day=2), True),  # the next day's window
    ("23:30-00:30", local(20, 0), local(0, 10, day=2), True),  # across midnight
    ("23:30-00:30", local(23, 40), local(0, 10, day=2), False),
    ("23:30-00:30", local(20, 0), local(23, 0), False),
])
def test_a_generation_is_recycled_once_in_the_daily_window(window, ready, tick, recycled):
    policy = f.Policy(nodes=NODES, recycle=Recycle(window=window, idle_for=60.0))
    s, a = run([(ready - 1, f.UpRequested()), (ready, f.MeshReady(1)), (tick, f.Tick())], policy)
    assert (s.phase == "recovering") == recycled
    assert [x.planned for x in a if isinstance(x, f.OpenIncident)] == (["window"] if recycled else [])


COUNTED = f.Policy(nodes=NODES, recycle=Recycle(steps=1000, idle_for=10.0))


@pytest.mark.parametrize("events, recycled", [
    ([(12, f.StepsCounted(1, 999)), (30, f.Tick())], False),  # not yet its count
    ([(12, f.StepsCounted(1, 1000)), (30, f.Tick())], True),
    ([(12, f.StepsCounted(1, 1000)), (15, f.Tick())], False),  # its count, but idle only 5s
    ([(12, f.StepsCounted(0, 5000)), (30, f.Tick())], False),  # an older generation's rank 0
    ([busy(11), (12, f.StepsCounted(1, 1000)), (30, f.Tick())], False),  # its count, a request in flight
])
def test_a_generation_is_recycled_at_its_count_of_rank_0s_steps_once_idle(events, recycled):
    s, a = run(ready_at() + events, COUNTED)
    assert [x.planned for x in a if isinstance(x, f.OpenIncident)] == (["steps"] if recycled else [])
    if recycled:
        assert "rank 0 made 1000 steps (recycle.steps 1000)" in s.incident.detail


def test_the_next_generations_steps_count_from_zero():
    s, _ = run(ready_at() + [(12, f.StepsCounted(1, 1000)), (30, f.Tick()), (31, f.GenerationStopped(1)),
                             (35, f.MeshReady(2)), (60, f.Tick())], COUNTED)
    assert (s.phase, s.generation, s.steps) == ("ready", 2, 0)


def test_meshctl_restart_is_a_planned_incident_like_a_recycle():
    s, a = run(ready_at() + [(20, f.RestartRequested())])
    opened = next(x for x in a if isinstance(x, f.OpenIncident))
    assert (opened.planned, opened.incident.cause, opened.incident.steps) == ("restart", "recycle", ("recycle",))
    assert f.StopGeneration(1, "drain", P.drain_grace) in a
    s, a = run([(22, f.GenerationStopped(1)), (30, f.MeshReady(2))], state=s)
    closed = next(x.incident for x in a if isinstance(x, f.CloseIncident))
    assert closed.generation == 1 and s.failures == () and s.ladder_step == 0


def test_a_restart_while_a_failure_recovers_keeps_the_failures_incident():
    s, a = run(ready_at() + [death(1, 20), (21, f.GenerationStopped(1)), (22, f.RestartRequested())])
    assert not [x for x in a if isinstance(x, f.OpenIncident) and x.planned]
    assert s.incident.cause == "exit"


@pytest.mark.parametrize("cause, primary, counted, closing, expect", [
    ("exit", True, False, False, True),  # the rank that failed by itself: counted at once, under its cause
    ("exit", True, True, False, False),  # once
    ("ring_peer_closed", False, False, False, False),  # a peer that only lost it: wait for the root cause
    ("ring_peer_closed", False, False, True, True),  # none came by the close: counted under what is known
    ("exit", True, True, True, False),
    (f.RECYCLE, True, False, True, False),  # a planned end is no failure
])
def test_a_restart_is_counted_once_under_its_root_cause(cause, primary, counted, closing, expect):
    incident = f.Incident(1.0, cause, "node1", 1, 3, "", primary=primary)
    assert f.counts_restart(incident, counted, closing) == expect


# --- what the fleet asks of the world: readiness probes, the sweep, step counts ----------------------

STARTING = f.FleetState(phase="starting", generation=3)
STEPS = f.Policy(nodes=NODES, recycle=Recycle(steps=1000))


@pytest.mark.parametrize("state, event, asked", [
    (STARTING, f.LaunchesSent(3), [f.ProbeReadiness(3, 0.0)]),
    (STARTING, f.NotReadyYet(3), [f.ProbeReadiness(3, f.READINESS_POLL)]),
    (STARTING, f.NotReadyYet(2), []),
    (f.FleetState(phase="recovering", generation=3), f.NotReadyYet(3), []),
    (f.FleetState(phase="ready", generation=3), f.LaunchesSent(3), []),
    (STARTING, f.MeshReady(3), [f.NoteGeneration(3, "ready")]),
    (f.FleetState(), f.Adopted(5, ready=False), [f.ProbeReadiness(5, 0.0)]),
    (f.FleetState(), f.Adopted(5, ready=True), []),
], ids=["launched: probed at once", "not ready: probed again", "an older generation's answer: no probe",
        "it died meanwhile: no probe", "ready already: no probe", "ready: probing ends",
        "adopted loading: probed", "adopted serving: none"])
def test_rank_0_is_probed_while_its_generation_starts_and_no_longer(state, event, asked):
    _, actions = f.step(state, event, 10.0, P)
    assert actions == asked


@pytest.mark.parametrize("phase, generation", [("recovering", 3), ("draining", 3), ("stopped", 3), ("ready", 9)],
                         ids=["recovering", "draining", "stopped", "another-generation"])
def test_every_stop_is_swept_with_what_it_found_and_the_sweep_ends_the_generation(phase, generation):
    state = f.FleetState(phase=phase, generation=generation)
    s, actions = f.step(state, f.StopsEnded(3, ("n1",), 20.0), 21.0, P)
    assert s == state and actions == [f.Sweep(3, ("n1",), 20.0)]


def test_the_timeline_has_the_stop_when_the_ladders_ended_and_the_sweep_when_it_ended():
    s, _ = run(ready_at() + [death(1, 20)])
    s, a = run([(24, f.StopsEnded(1, (), 23.0)), (26, f.GenerationStopped(1, (), 23.0))], state=s)
    assert kinds(a)[0] == "Sweep" and (s.phase, s.generation, s.backoff_until) == ("recovering", 1, 26)
    assert [(step, when) for step, when in s.incident.timeline if step in ("stopped", "swept")] == \
        [("stopped", 23.0), ("swept", 26)]


@pytest.mark.parametrize("policy, state, ticks, counted", [
    (STEPS, f.FleetState(phase="ready", generation=4), [10.0], [10.0]),
    (STEPS, f.FleetState(phase="ready", generation=4), [10.0, 10.25, 10.5, 10.75, 11.0, 11.25, 12.0],
     [10.0, 11.0, 12.0]),
    (STEPS, f.FleetState(phase="starting", generation=4), [10.0, 11.0], []),
    (STEPS, f.FleetState(phase="recovering", generation=4), [10.0, 11.0], []),
    (P, f.FleetState(phase="ready", generation=4), [10.0, 11.0], []),
], ids=["serving: counted", "once a second at most", "starting: not counted", "recovering: not counted",
        "no [recycle] steps: never counted"])
def test_rank_0s_steps_are_counted_every_second_while_it_serves_if_recycle_steps_asks(policy, state, ticks, counted):
    asked = []
    for now in ticks:
        state, actions = f.step(state, f.Tick(), now, policy)
        asked += [now for a in actions if a == f.CountSteps(4)]
    assert asked == counted
