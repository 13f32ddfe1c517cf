"""`meshctl cache clear` on real agents and a real 2-rank mesh: the prefix snapshots its ranks wrote are gone
from every node's disk, the mesh goes on answering and writing snapshots, and a node whose agent is down is
named with the fix."""

from __future__ import annotations

import stat

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import meshctl
from kit.snapshots import Gen
from kit.waiting import wait_for
from runtime.prefix.snapshot import segment_files

CONVO = [{"role": "user", "content": "Tell me about the mesh and its ranks. " * 3}]
LATER = [{"role": "user", "content": "And now something else entirely, please."}]


def files_in(folder) -> int:
    return sum(1 for p in folder.rglob("*") if p.is_file())


def written(g: Gen, rank: int) -> dict:
    """Rank `rank`'s status once its writer has nothing left to write."""
    return wait_for(lambda: (s := g.settled(rank))["snapshots_written"] and not s["snapshots_pending"] and s, 60,
                    f"rank {rank}'s snapshots on disk")


def test_cache_clear_deletes_every_nodes_snapshots_while_the_mesh_serves_and_names_the_node_it_missed(
        tmp_path, demo_model):
    agents = make_agents(tmp_path, 3)  # node2's agent never starts
    for a in agents[:2]:
        a.start()
    mesh = write_mesh(tmp_path, agents, demo_model)
    roots = [a.dir / "state" / "snapshots" for a in agents[:2]]
    try:
        g = Gen(agents[:2], demo_model, 1)
        try:
            answer, _ = g.chat(CONVO)
            for rank in range(2):
                written(g, rank)
            held = [files_in(root) for root in roots]
            assert all(held), held

            r = meshctl(mesh, "cache", "clear")
            assert r.returncode == 1, r.stdout + r.stderr
            lines = r.stdout.splitlines()
            for rank, root in enumerate(roots):
                assert f"node{rank}: deleted {held[rank]} files (" in lines[rank] and str(root) in lines[rank], lines
            assert lines[2].startswith(f"node2: not reached at {agents[2].url}") and "meshctl doctor" in lines[2]
            assert "snapshots not all cleared on node2" in r.stderr
            for root in roots:
                assert files_in(root) == 0 and stat.S_IMODE(root.stat().st_mode) == 0o700

            assert g.chat(CONVO)[0] == answer  # the mesh answers on, from the tape it holds in memory
            g.chat(LATER)
            for rank, root in enumerate(roots):  # and its next snapshot makes the rank's folder again, private
                wait_for(lambda: [f for d in root.glob("*-w2-r*") for f in segment_files(d)], 60,
                         f"rank {rank}'s next snapshot")
                (folder,) = root.glob("*-w2-r*")
                assert stat.S_IMODE(folder.stat().st_mode) == 0o700
                assert not written(g, rank)["snapshot_writer_error"]
        finally:
            g.stop()
    finally:
        for a in agents:
            a.kill()
