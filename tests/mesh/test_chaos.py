"""A short chaos run (bench/chaos.py) in the suite: every fault kind lands on
a demo mesh of two nodes (the bench's four recover slower on a small machine)
under load from streaming and non-streaming openai clients; no
request is refused, hangs or ends malformed, no rank fault reaches a client as an error
(cut streams resume on the next generation), the mesh serves at the end, and
`meshctl down` leaves no process behind."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from chaos import FAULTS, Chaos  # noqa: E402


def test_every_fault_under_load_ends_clean(tmp_path):
    chaos = Chaos(tmp_path, seed=7, clients=3, stall_window=3.0, gap=(3, 5), nodes=2)
    result = chaos.run(duration=20, say=print)  # every kind once: 7 faults 3-5 s apart
    print(result)
    assert set(result["faults"]) == set(FAULTS), result["faults"]
    rank_faults = {k: n for k, n in result["faults"].items() if k.startswith("rank-")}
    assert result["replaced"] == rank_faults, ("a rank fault the mesh never recovered from", result)
    outcomes = result["outcomes"]
    assert outcomes.get("hung", 0) == 0, result["examples"]
    assert outcomes.get("refused", 0) == 0, result["examples"]  # the endpoint outlives controller and proxy restarts
    assert outcomes.get("malformed", 0) == 0, result["examples"]
    assert outcomes.get("clean error", 0) == 0, result["examples"]
    assert outcomes.get("completed", 0) > 0
    assert result["recovered"] >= 1 and result["ready_at_end"] and result["served_at_end"]
    assert result["left_after_down"] == []
