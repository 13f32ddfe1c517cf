"""Process titles name the mesh as well as the node: two meshes' ranks and standbys on one host look different in
ps, and the agent's sweep still knows them by their titles."""

from __future__ import annotations

import pytest

from agents.orphans import ProcInfo, marked_standby, marker_generation
from common import proctitle


@pytest.mark.parametrize("title,shown", [
    (proctitle.rank(3, 1, 4, "node1", "left"), "meshd-rank gen=3 rank=1/4 node=node1 mesh=left"),
    (proctitle.rank(3, 1, 4, "node1", "right"), "meshd-rank gen=3 rank=1/4 node=node1 mesh=right"),
    (proctitle.rank(3, 1, None, "node1", ""), "meshd-rank gen=3 rank=1 node=node1"),  # started by no controller
    (proctitle.rank(3, 0, None, "", ""), "meshd-rank gen=3 rank=0"),  # started by hand
    (proctitle.standby("node1", "left"), "meshd-standby node=node1 mesh=left"),
    (proctitle.standby("", ""), "meshd-standby"),
])
def test_titles(title, shown):
    assert title == shown


def test_a_title_without_a_mesh_given_is_the_one_its_agent_set(monkeypatch):
    monkeypatch.setenv("MESHD_MESH", "left")
    assert proctitle.rank(3, 1, 4, "node1") == "meshd-rank gen=3 rank=1/4 node=node1 mesh=left"
    assert proctitle.standby("node1") == "meshd-standby node=node1 mesh=left"


def test_the_sweep_knows_titles_with_a_mesh():
    rank = ProcInfo(20, "meshd-rank gen=", (proctitle.rank(3, 1, 4, "node1", "left"),), 0.0)
    assert marker_generation(rank) == 3
    assert marked_standby((proctitle.standby("node1", "left"),)) and not marked_standby(rank.cmdline)
