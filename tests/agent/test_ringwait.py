"""agents/ringwait.c, preloaded by the agent into the ring ranks that share a host: which ranks get it, its
build, and what the demo says without it. (bench/ringwait.py measures what it is for.)"""

from __future__ import annotations

import ctypes
import socket
from pathlib import Path

import pytest

from agents import ringwait

ONE_HOST = {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["127.0.0.1"]}, {"ssh": "b", "ips": ["127.0.0.1"]}]}
TWO_HOSTS = {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]}
MIXED = {"backend": "ring", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "a", "ips": ["10.0.0.1"]},
                                      {"ssh": "b", "ips": ["10.0.0.2"]}]}
JACCL = {"backend": "jaccl", "hosts": [{"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en1"]},
                                      {"ssh": "a", "ips": ["10.0.0.1"], "rdma": ["rdma_en1", None]}]}
LIB = Path("/venv/ringwait.so")


@pytest.mark.parametrize("hostfile,rank,preloaded,lib,expected", [
    (ONE_HOST, 1, None, LIB, str(LIB)),
    (ONE_HOST, 0, "/usr/lib/libopenblas.so.0", LIB, f"{LIB}:/usr/lib/libopenblas.so.0"),
    (ONE_HOST, 0, "/tmp/ringwait.so", LIB, None),  # a test run preloads its own into every process
    (ONE_HOST, 0, None, None, None),  # not built
    (TWO_HOSTS, 0, None, LIB, None),  # each rank has its host to itself
    (MIXED, 1, None, LIB, str(LIB)),
    (MIXED, 2, None, LIB, None),
    ({"hosts": ONE_HOST["hosts"]}, 0, None, LIB, str(LIB)),  # ring when the hostfile names no backend
    (JACCL, 0, None, LIB, None),
], ids=["one host", "in front of another preload", "one there", "not built", "a host each", "two of three on a host",
        "the third", "no backend named", "jaccl"])
def test_ring_ranks_that_share_a_host_preload_it(hostfile, rank, preloaded, lib, expected):
    assert ringwait.preload(hostfile, rank, preloaded, lib) == expected


def test_it_builds_and_a_recv_with_nothing_to_read_still_says_eagain(tmp_path):
    lib = tmp_path / "ringwait.so"
    assert ringwait.build(lib) is None
    recv = ctypes.CDLL(str(lib), use_errno=True).recv
    a, b = socket.socketpair()
    a.setblocking(False)
    buf = ctypes.create_string_buffer(8)
    assert recv(a.fileno(), buf, 8, 0) == -1 and ctypes.get_errno() == 11  # EAGAIN, after its wait
    b.send(b"hi")
    assert recv(a.fileno(), buf, 8, 0) == 2 and buf.raw[:2] == b"hi"


def test_the_demo_says_how_much_faster_it_would_be_and_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setattr(ringwait, "library", lambda prefix="": tmp_path / "ringwait.so")
    said = ringwait.unbuilt("linux")
    assert "spin" in said and "about 30 times faster" in said and "-m agents.ringwait" in said
    assert ringwait.unbuilt("darwin") is None
    (tmp_path / "ringwait.so").touch()
    assert ringwait.unbuilt("linux") is None
