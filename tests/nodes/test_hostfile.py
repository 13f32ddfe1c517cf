"""The env the agent computes equals what mlx's own launcher builds, and bad
hostfiles are refused with a reason."""

import json
import os
import subprocess
import sys

import pytest
from mlx._distributed_utils import launch as mlx_launch

from common.hostfile import (BACKENDS, DISTRIBUTED_ENV, MLX_BACKEND, HostfileError, LaunchEnv, launch_env, rank0_host,
                             validate)

RING = {"backend": "ring", "envs": ["MLX_METAL_FAST_SYNCH=0"],
        "hosts": [{"ssh": f"h{i}", "ips": [f"10.0.0.{i + 1}"], "rdma": []} for i in range(4)]}
JACCL = {"backend": "jaccl", "envs": ["MLX_METAL_FAST_SYNCH=0"],
         "hosts": [{"ssh": f"h{i}", "ips": [f"192.168.{i}.1"],
                    "rdma": [None if j == i else f"rdma_en{j + 2}" for j in range(4)]} for i in range(4)]}
JACCL_RING = {**JACCL, "backend": "jaccl-ring"}
NCCL = {"backend": "nccl", "envs": [], "hosts": [{"ssh": f"gpu{i}", "ips": [f"10.1.0.{i + 1}"]} for i in range(2)]}


def mlx_would_set(hostfile: dict, tmp_path, monkeypatch, *flags: str) -> list[dict]:
    """Run mlx.launch's main() on the hostfile with its process spawner replaced
    by a recorder: returns, per rank, the env it would export and the contents
    of the files it would point variables at."""
    path = tmp_path / "hostfile.json"
    path.write_text(json.dumps(hostfile))
    captured = []

    def record(command_class, arguments, verbose):
        for (rank, host, python, cwd, files, env, command), _ in arguments:
            captured.append({"rank": rank, "env": list(env), "files": dict(files)})

    monkeypatch.setattr(mlx_launch, "_launch_with_io", record)
    monkeypatch.setattr(mlx_launch.shutil, "get_terminal_size", lambda *a: os.terminal_size((0, 0)))
    monkeypatch.setattr(sys, "argv", ["mlx.launch", "--hostfile", str(path), *flags, "--", "python", "x.py"])
    mlx_launch.main()
    return captured


@pytest.mark.parametrize("hostfile", [RING, JACCL, JACCL_RING, NCCL], ids=["ring", "jaccl", "jaccl-ring", "nccl"])
def test_launch_env_equals_mlx_launch(hostfile, tmp_path, monkeypatch):
    expected = mlx_would_set(hostfile, tmp_path, monkeypatch)
    assert len(expected) == len(hostfile["hosts"])
    for want in expected:
        got = launch_env(hostfile, want["rank"])
        env = dict(e.split("=", 1) for e in want["env"])
        env["MLX_RANK"] = str(want["rank"])
        assert {k: v for k, v in got.env.items()} == env
        assert got.files == want["files"]


@pytest.mark.parametrize("hostfile", [RING, JACCL, JACCL_RING, NCCL], ids=["ring", "jaccl", "jaccl-ring", "nccl"])
def test_every_rank_finds_rank_0s_address_in_its_launch_env(hostfile, tmp_path):
    for rank in range(len(hostfile["hosts"])):
        got = launch_env(hostfile, rank)
        env = dict(got.env)
        for var, content in got.files.items():
            (tmp_path / var).write_text(content)
            env[var] = str(tmp_path / var)
        assert rank0_host(env) == hostfile["hosts"][0]["ips"][0]


def test_nccl_ranks_sharing_a_host_get_their_own_gpus_as_mlx_launch_repeat_hosts_gives_them(tmp_path, monkeypatch):
    two_per_host = {"backend": "nccl", "envs": [],
                    "hosts": [{"ssh": f"gpu{i // 2}", "ips": [f"10.1.0.{i // 2 + 1}"]} for i in range(4)]}
    expected = mlx_would_set(two_per_host, tmp_path, monkeypatch, "--repeat-hosts", "2")
    got = [launch_env(two_per_host, rank).env["CUDA_VISIBLE_DEVICES"] for rank in range(4)]
    assert got == [dict(e.split("=", 1) for e in want["env"])["CUDA_VISIBLE_DEVICES"] for want in expected]
    assert got == ["0", "1", "0", "1"]


ONE_HOST = {"ring": {"backend": "ring", "hosts": [{"ssh": "solo", "ips": ["127.0.0.1"]}]},
            "jaccl": {"backend": "jaccl", "hosts": [{"ssh": "solo", "ips": ["192.168.0.1"], "rdma": [None]}]},
            "jaccl-ring": {"backend": "jaccl-ring", "hosts": [{"ssh": "solo", "ips": ["192.168.0.1"], "rdma": [None]}]},
            "nccl": {"backend": "nccl", "envs": ["NCCL_DEBUG=WARN"], "hosts": [{"ssh": "solo", "ips": ["10.1.0.1"]}]}}
TRANSPORT = {"MLX_JACCL_COORDINATOR", "MLX_JACCL_RING", "NCCL_HOST_IP", "NCCL_PORT", "MLX_WORLD_SIZE"}


def join(launch, backend: str, tmp_path) -> subprocess.CompletedProcess:
    """A process given `launch` as the agent gives it (each file's content and a newline, as mlx.launch
    writes it too) joins the mesh as a rank does: its rank, its world and an all_sum of 3 on stdout."""
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    env.update(launch.env, MESHD_BACKEND=MLX_BACKEND[backend])
    for var, content in launch.files.items():
        (tmp_path / var).write_text(content + "\n")
        env[var] = str(tmp_path / var)
    code = ("import mlx.core as mx; from runtime.join import join_mesh; g = join_mesh(); "
            "print(g.rank(), g.size(), mx.distributed.all_sum(mx.array([3]), group=g).item())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_host_mesh_is_mlx_launchs_env_without_the_transport(backend, tmp_path, monkeypatch):
    (want,) = mlx_would_set(ONE_HOST[backend], tmp_path, monkeypatch)
    env = dict(e.split("=", 1) for e in want["env"])
    env["MLX_RANK"] = "0"
    got = launch_env(ONE_HOST[backend], 0)
    assert got.env == {k: v for k, v in env.items() if k not in TRANSPORT}
    assert got.files == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_one_host_mesh_joins_as_rank_0_of_1_on_every_backend(backend, tmp_path):
    """No transport for a mesh of one (its host needs no address, nor RDMA devices): the rank is
    mx.distributed's one-rank group, whether or not the backend exists on this machine (jaccl and nccl
    do not here; strict, their init would fail)."""
    done = join(launch_env({"backend": backend, "hosts": [{"ssh": "solo"}]}, 0), backend, tmp_path)
    assert (done.returncode, done.stdout.split()) == (0, ["0", "1", "3"]), done.stderr


def test_mlx_launchs_own_one_host_ring_file_cannot_be_joined(tmp_path, monkeypatch):
    """Why a mesh of one gets no ring file: the empty one mlx.launch gives it fails mx.distributed.init
    (the one-node ring mesh of issue 27 died so twice). Once mlx parses it this fails, and launch_env may
    follow mlx.launch again."""
    (want,) = mlx_would_set(ONE_HOST["ring"], tmp_path, monkeypatch)
    assert want["files"] == {"MLX_HOSTFILE": ""}
    env = dict(e.split("=", 1) for e in want["env"])
    done = join(LaunchEnv({**env, "MLX_RANK": "0"}, want["files"]), "ring", tmp_path)
    assert done.returncode != 0 and "parse_error" in done.stderr



def test_ring_ports_on_loopback_are_distinct_per_rank():
    lo = {"backend": "ring", "hosts": [{"ssh": "lo", "ips": ["127.0.0.1"]} for _ in range(3)]}
    ring = json.loads(launch_env(lo, 1, starting_port=40000).files["MLX_HOSTFILE"])
    assert ring == [["127.0.0.1:40000"], ["127.0.0.1:40001"], ["127.0.0.1:40002"]]


def _jaccl(**host_overrides):
    hosts = [dict(h) for h in JACCL["hosts"]]
    for i, h in host_overrides.items():
        hosts[int(i[1:])] = {**hosts[int(i[1:])], **h}
    return {**JACCL, "hosts": hosts}


BAD = [
    ("no hosts list", {"backend": "ring"}, "hosts"),
    ("empty hosts", {"hosts": []}, "no hosts"),
    ("unknown backend", {"backend": "mpi-x", "hosts": [{"ssh": "a"}]}, "backend"),
    ("host without ssh", {"hosts": [{"ips": ["1.2.3.4"]}]}, "hosts[0]"),
    ("ring host without ip", {"hosts": [{"ssh": "a", "ips": ["1.1.1.1"]}, {"ssh": "b"}]}, "missing for b"),
    ("rdma wrong length", _jaccl(h1={"rdma": [None, None]}), "hosts[1].rdma must list 4"),
    ("rdma diagonal not null", _jaccl(h2={"rdma": ["a", "b", "c", "d"]}), "hosts[2].rdma[2] must be null"),
    ("missing rdma pair", _jaccl(h0={"rdma": [None, None, "x", "y"]}), "h0 to h1"),
    ("jaccl rank 0 without ip", _jaccl(h0={"ips": []}), "rank 0"),
    ("envs not NAME=value", {**RING, "envs": ["NOPE"]}, "envs"),
]


@pytest.mark.parametrize("name,hostfile,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_hostfiles_are_refused_with_the_reason(name, hostfile, needle):
    with pytest.raises(HostfileError) as e:
        validate(hostfile)
    assert needle in str(e.value)


def test_rank_outside_hostfile():
    with pytest.raises(HostfileError, match="rank 4 is outside"):
        launch_env(RING, 4)
