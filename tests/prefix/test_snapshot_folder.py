"""What an operator does to a rank's snapshot folder while its mesh runs, on a real rank its agent starts:
the folder deleted under load (after doctor's space warning), and a folder grown to 60k tapes before a
start. Generation 1 serves while its folder is deleted before each request; generation 2 starts over the
60k one-token tapes made with generation 1's header."""

from __future__ import annotations

import os
import re
import shutil
import stat
import struct
import tempfile
from pathlib import Path

import mlx.core as mx
import psutil
import pytest

from kit.agents import make_agents, pid_of
from kit.snapshots import Gen, metric
from kit.waiting import wait_for
from runtime.prefix.snapshot import PROGRESS_EVERY, header_of, read_header, segment_files, tape_id

ROUNDS = 12  # requests, each after the folder was deleted
FULL = 8  # of them, after which the token tape is full (its capacity) and the rank's memory should stay flat
MANY = 60_000  # tapes in the folder at generation 2's start
SHM = "/dev/shm"


def prompt(i: int) -> list[dict]:
    """A long prompt of its own (about 1.4k tokens: a tape of MBs), so that a segment staged for no one
    would show in the rank's memory."""
    return [{"role": "user", "content": f"Conversation {i}: " + "the mesh keeps its prefixes on disk. " * 150}]


def idle(g: Gen) -> dict:
    """Rank 0's status once its writer has nothing staged or queued."""
    return wait_for(lambda: (s := g.settled(0))["snapshots_pending"] == 0 and s, 60, "the writer's queue empty")


@pytest.fixture(scope="module")
def story(demo_model, tmp_path_factory):
    # on a memory file system where there is one: the 60k files written and read at the speed of the rank's
    # own code, not of a disk other tests keep flushing
    base = Path(tempfile.mkdtemp(dir=SHM)) if os.access(SHM, os.W_OK) else tmp_path_factory.mktemp("folder")
    [agent] = make_agents(base, 1)
    root = agent.dir / "state" / "snapshots"
    out: dict = {}
    try:
        agent.start()
        g = Gen([agent], demo_model, 1)
        try:
            rss = psutil.Process(pid_of(agent, 1)).memory_info
            for i in range(ROUNDS):
                idle(g)
                if i == FULL:
                    out["rss_full"] = rss().rss
                shutil.rmtree(root)  # the whole snapshots folder, as `rm -rf` would
                out.setdefault("answers", []).append(g.chat(prompt(i))[0])
            out["status"] = idle(g)
            out["rss_end"] = rss().rss
            out["metric"] = metric(agent, "meshd_agent_rank_snapshots_skipped_total", reason="write_failed")
            (folder,) = root.iterdir()
            out["modes"] = {stat.S_IMODE(p.stat().st_mode) for p in (root, folder)}
            out["files"] = segment_files(folder)
            out["again"] = g.chat(prompt(ROUNDS - 1))[0]
        finally:
            g.stop()
        # 60k tapes of one token and no cache, named as no writer with the node's key would (the few the
        # restore reads are skipped; the rest held): generation 1's header for this rank, the token varied
        meta = {**read_header(out["files"][0]), "parent": "", "start": "0", "end": "1"}
        head = header_of({"tokens": mx.array([0], dtype=mx.uint32)}, meta)
        for i in range(MANY):
            fd = os.open(folder / f"{tape_id((i,))}.{'0' * 32}.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)
            os.write(fd, head + struct.pack("<I", i))
            os.close(fd)
        g2 = Gen([agent], demo_model, 2)  # ready within wait_mesh_ready's 120 s: the controller's start_timeout
        try:
            out["log"] = agent.get("/v1/ranks/2/0/log").text
            out["restored"] = g2.restored(0)
            out["after"] = g2.chat(prompt(0))[0]
        finally:
            g2.stop()
        yield out
    finally:
        agent.kill()
        shutil.rmtree(base, ignore_errors=True)


def test_a_folder_deleted_under_load_fails_one_write_a_time_and_comes_back_the_rank_serving_on_flat(story):
    s = story["status"]
    assert not s["snapshot_writer_error"] and s["snapshot_pending_bytes"] == 0
    # each request's first write found the folder gone: counted failed, in status and metrics
    assert s["snapshots_skipped"].get("write_failed") == ROUNDS == story["metric"]
    assert s["snapshots_written"] >= ROUNDS  # the rest of each answer written into the folder made again
    assert story["files"] and story["modes"] == {0o700}
    assert all(story["answers"]) and story["again"] == story["answers"][-1]
    # the rank's memory flat once its token tape is full: it grew less than the tapes of the requests since,
    # which a writer that stopped would hold staged
    headers = [(read_header(p), p.stat().st_size) for p in story["files"]]
    tape = max(int(h["end"]) for h, _ in headers) * max(n / (int(h["end"]) - int(h["start"])) for h, n in headers)
    queued = (ROUNDS - FULL) * tape
    assert story["rss_end"] - story["rss_full"] < queued, (story["rss_full"], story["rss_end"], queued)


def test_a_rank_over_60k_snapshot_files_says_how_far_its_scan_is_and_serves(story):
    total = MANY + len(story["files"])
    said = [int(m) for m in re.findall(rf"snapshots: (\d+) of {total} files read in ", story["log"])]
    assert said == list(range(PROGRESS_EVERY, total + 1, PROGRESS_EVERY))
    assert re.search(rf"snapshots: {total} file\(s\) read in [\d.]+s: {total} segment\(s\) of this rank's, 0 "
                     "unusable", story["log"]), story["log"][-3000:]
    skipped = story["restored"]["snapshots_skipped"]
    assert skipped.get("corrupt", 0) >= 1 and story["after"] == story["answers"][0]  # the forged ones skipped
