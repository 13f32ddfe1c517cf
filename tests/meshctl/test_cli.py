"""meshctl's conventions, as a user meets them: options before or after the command, where the mesh.toml
is found, --version, Ctrl-C, a control address another mesh's controller holds, and shell completion."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from kit.agents import make_agents
from kit.configs import write_mesh
from kit.meshctl import another_controller, mesh_up, meshctl
from kit.waiting import wait_for
from meshd.meshctl import background
from meshd.meshctl.cli import (CliError, Control, agents_down, log_generation, may_have_ranks, silent_controller,
                               stopped_line)
from meshd.config import Node, load
from meshd.meshctl import cache
from meshd.meshctl.progress import frame
from meshd.store import Store

MESHCTL = [sys.executable, "-m", "meshd.meshctl.cli"]


def run(*args, cwd=None, env=None):
    base = {k: v for k, v in os.environ.items() if k != "MESHD_CONFIG"}
    return subprocess.run([*MESHCTL, *args], cwd=cwd, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=60)


def test_config_goes_before_or_after_the_command(tmp_path, demo_model):
    mesh = write_mesh(tmp_path, make_agents(tmp_path, 2), demo_model)
    before, after = run("--config", str(mesh), "status"), run("status", "--config", str(mesh))
    assert before.returncode == after.returncode == 1 and before.stderr == after.stderr
    assert "no control token" in after.stderr and "usage:" not in after.stderr
    assert run("config", "check", f"--config={mesh}").returncode == 0


def test_the_mesh_toml_is_found_where_operators_put_it(tmp_path, demo_model):
    """./mesh.toml, then $XDG_CONFIG_HOME/meshd/mesh.toml; $MESHD_CONFIG and --config before both."""
    here, xdg, named = tmp_path / "here", tmp_path / "xdg", tmp_path / "named"
    for d in (here, xdg / "meshd", named):
        d.mkdir(parents=True)
        write_mesh(d, make_agents(d, 1), demo_model)
    env = {"XDG_CONFIG_HOME": str(xdg)}

    def checked(*args, **kw) -> str:
        r = run("config", "check", *args, cwd=here, **kw)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert checked(env=env).startswith("mesh.toml: ok")
    assert checked(env={**env, "MESHD_CONFIG": str(named / "mesh.toml")}).startswith(f"{named / 'mesh.toml'}: ok")
    assert checked("--config", str(named / "mesh.toml"), env=env).startswith(f"{named / 'mesh.toml'}: ok")
    (here / "mesh.toml").unlink()
    assert checked(env=env).startswith(f"{xdg / 'meshd' / 'mesh.toml'}: ok")
    (xdg / "meshd" / "mesh.toml").unlink()
    nothing = run("config", "check", cwd=here, env=env)
    assert nothing.returncode == 1 and "no mesh.toml in mesh.toml, " in nothing.stderr


def test_version_names_meshctl_mlx_and_mlx_lm():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.startswith("meshctl 0.") and "mlx " in r.stdout and "mlx-lm " in r.stdout


def test_ctrl_c_stops_meshctl_with_130_and_no_traceback(tmp_path, demo_model):
    """`up` waiting for the controller it started before, which neither answers nor exits (a stand-in process
    its pidfile names), so the wait lasts whatever the machine's load: one Ctrl-C ends it cleanly."""
    mesh = write_mesh(tmp_path, make_agents(tmp_path, 2), demo_model)
    run_dir = tmp_path / "state" / "run"
    run_dir.mkdir(parents=True)
    silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    (run_dir / "controller.pid").write_text(f"{silent.pid} {psutil.Process(silent.pid).create_time()}\n")
    proc = subprocess.Popen([*MESHCTL, "--config", str(mesh), "up", "--skip-preflight"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    said: list[str] = []
    threading.Thread(target=lambda: said.extend(proc.stdout), daemon=True).start()
    try:
        wait_for(lambda: any("waiting for it to answer or to exit" in line for line in said), 60, "up to wait")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, "".join(said) + proc.stderr.read()
        err = proc.stderr.read()
    finally:
        proc.kill()
        silent.kill()
        silent.wait()
    assert "interrupted" in err and "Traceback" not in err, err


def test_up_on_a_control_address_another_meshs_controller_holds_says_so(tmp_path, demo_model):
    with another_controller() as address:
        mesh = write_mesh(tmp_path, make_agents(tmp_path, 2), demo_model, control={"listen": address})
        r = meshctl(mesh, "up")
    assert r.returncode == 1 and "another mesh's controller holds that address" in r.stderr, r.stderr
    assert "[control] listen" in r.stderr
    assert background.pids_below(tmp_path) == []  # nothing started for a controller that is not this mesh's


INCIDENTS = [{"generation": 7, "opened_at": 1000.0, "cause": "exit", "node": "node2", "rank": 2},
             {"generation": 4, "opened_at": 100.0, "cause": "stall", "node": "node1", "rank": 1}]


@pytest.mark.parametrize("now,generation,incident,shown", [
    (1100.0, None, None, 7),    # an incident of the last ten minutes: the generation that died
    (1700.0, None, None, 8),    # older than that: the one serving
    (1100.0, 8, None, 8),       # -g
    (1100.0, None, 2, 4),       # --incident 2
])
def test_logs_show_the_generation_that_crashed_while_its_incident_is_recent(now, generation, incident, shown):
    assert log_generation(8, INCIDENTS, now, generation, incident)[0] == shown


def test_logs_without_incidents_show_the_serving_generation_and_a_missing_incident_is_named():
    assert log_generation(3, [], 0.0) == (3, "serving now")
    assert log_generation(7, INCIDENTS[:1], 1001.0)[0] == 7  # the incident's generation is the one serving
    with pytest.raises(CliError, match="there are 2 incidents"):
        log_generation(8, INCIDENTS, 0.0, incident=3)


def complete(script: Path, line: str, cwd: Path) -> list[str]:
    """What bash offers for `line` (the cursor at its end), through the real completion function."""
    words = line.split(" ")
    shim = cwd / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "meshctl").write_text(f"#!/bin/sh\nexec {sys.executable} -m meshd.meshctl.cli \"$@\"\n")
    (shim / "meshctl").chmod(0o755)
    program = (f"source {script}\nCOMP_WORDS=({' '.join(repr(w) for w in words)})\nCOMP_CWORD={len(words) - 1}\n"
               "_meshctl\nprintf '%s\\n' \"${COMPREPLY[@]}\"\n")
    r = subprocess.run(["bash", "-c", program], cwd=cwd, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "PYTHONPATH": os.pathsep.join(
                           sys.path)})
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_a_reader_that_stopped_reading_ends_meshctl_quietly():
    """`meshctl completion bash | head -1` where head is gone before meshctl writes: exit 141 as a writer
    killed by SIGPIPE, no traceback."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run([*MESHCTL, "completion", "bash"], stdout=write, stderr=subprocess.PIPE, text=True,
                           timeout=60)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


def test_bash_completes_commands_options_choices_and_node_names(tmp_path):
    script = tmp_path / "meshctl.bash"
    r = run("completion", "bash")
    assert r.returncode == 0
    script.write_text(r.stdout)
    (tmp_path / "mesh.toml").write_text('[[nodes]]\nname = "studio-1"\nagent = "https://a:7701"\ntoken_file = "t"\n'
                                        '[[nodes]]\nname = "studio-2"\nagent = "https://b:7701"\ntoken_file = "t"\n'
                                        '[runtime]\nmodel = "/m"\n')
    assert {"up", "down", "status", "logs", "completion"} <= set(complete(script, "meshctl ", tmp_path))
    assert complete(script, "meshctl st", tmp_path) == ["status"]
    assert complete(script, "meshctl status --j", tmp_path) == ["--json"]
    assert complete(script, "meshctl config ", tmp_path) == ["--help", "check", "schema", "nodes"]
    assert complete(script, "meshctl service install agent a.toml --system ", tmp_path) == ["linux", "macos"]
    assert complete(script, "meshctl logs studio", tmp_path) == ["studio-1", "studio-2"]  # from ./mesh.toml
    assert complete(script, "meshctl --config mesh.toml logs --ag", tmp_path) == ["--agent"]
    assert complete(script, "meshctl --config ", tmp_path) == []  # a file: readline's own completion
    zsh = run("completion", "zsh").stdout
    assert zsh.startswith("# meshctl completion for zsh") and "bashcompinit" in zsh and r.stdout in zsh


@pytest.mark.parametrize("status,shown", [
    ({"generation": 3, "phase": "starting", "load": [{"node": "n0", "state": "loading", "load_done": 6, "load_total": 12},
                                                     {"node": "n1", "state": "armed"}]},
     ["generation 3 starting", "  n0           loading   [############............] 6/12", "  n1           armed"]),
    ({"generation": 4, "phase": "recovering", "reason": "exit on n1", "load": [],
      "last_incident": {"cause": "exit", "node": "n1", "rank": 1, "opened_at": 100.0, "serving_back_at": None,
                        "timeline": [{"step": "stopped", "after": 0.12}, {"step": "swept", "after": 0.3}]}},
     ["generation 4 recovering: exit on n1", "  recovering from exit on n1 rank 1 (2.0s): stopped +0.12s  swept +0.30s"]),
    ({"generation": 4, "phase": "ready", "reason": "", "load": [{"node": "n0", "state": "ready"}],
      "last_incident": {"cause": "exit", "node": "n1", "rank": 1, "opened_at": 100.0, "serving_back_at": 101.0,
                        "timeline": []}},
     ["generation 4 ready", "  n0           ready"]),
], ids=["loading bars", "a recovery as it happens", "served again"])
def test_the_live_frame(status, shown):
    assert frame(status, now=102.0) == shown


@pytest.mark.parametrize("fleet, may", [(None, False), ({"phase": "stopped", "generation": 3}, False),
                                        ({"phase": "ready", "generation": 3}, True),
                                        ({"phase": "starting", "generation": 1}, True)])
def test_ranks_may_run_without_a_controller_unless_the_store_says_the_fleet_stopped(tmp_path, demo_model, fleet,
                                                                                     may):
    cfg = load(write_mesh(tmp_path, make_agents(tmp_path, 1), demo_model))
    store = Store(cfg.store_path)  # a controller that started and recorded nothing yet, or this fleet record
    if fleet is not None:
        store.put("fleet", fleet)
    assert may_have_ranks(cfg) is may


def test_down_on_a_mesh_that_never_ran_starts_no_controller(tmp_path, demo_model):
    mesh = write_mesh(tmp_path, make_agents(tmp_path, 2), demo_model)
    down = run("down", "--config", str(mesh))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "no rank to stop" in down.stdout and "starting the controller" not in down.stdout, down.stdout
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(mesh) in " ".join(p.info["cmdline"] or [])]


@pytest.mark.parametrize("daemons,strays,said", [
    ({"agent-node0": 11, "controller": 12, "proxy": 13}, [21, 22],
     "stopped node0's agent (pid 11), the controller (pid 12), meshd-proxy (pid 13), 2 rank or standby processes "
     "that agents left running (pid 21, 22)"),
    ({"controller": 12}, [], "stopped the controller (pid 12)"),
    ({}, [21], "stopped 1 rank or standby process that agents left running (pid 21)"),
    ({}, [], "no process that meshctl started was running"),
])
def test_down_says_what_it_stopped(daemons, strays, said):
    assert stopped_line(daemons, strays) == said


def test_the_agents_the_controller_does_not_reach_are_named_with_why():
    nodes = [{"node": "node0", "agent": "http://a:7701", "agent_ok": True},
             {"node": "node1", "agent": "http://b:7701", "agent_ok": False, "error": "connection refused"}]
    assert agents_down({"nodes": nodes}) == ["node1's agent (http://b:7701: connection refused)"]
    assert agents_down({"nodes": nodes[:1]}) == []


def named(mesh: Path) -> list[int]:
    """The processes whose command line (or title) names this mesh.toml: its controller's and proxy's."""
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if str(mesh) in " ".join(p.info["cmdline"] or [])]


def test_down_on_a_configured_mesh_stops_its_ranks_controller_and_proxy_and_says_so(tmp_path, demo_model):
    with mesh_up(tmp_path, demo_model) as (mesh, agents):
        ranks = [n["rank"]["pid"] for n in json.loads(meshctl(mesh, "status", "--json").stdout)["nodes"]]
        run = mesh.parent / "state" / "run"
        daemons = {name: background.pid_of(run / f"{name}.pid") for name in ("controller", "proxy")}
        assert None not in daemons.values() and set(daemons.values()) <= set(named(mesh))
        down = meshctl(mesh, "down")
        assert down.returncode == 0, down.stdout + down.stderr
        assert (f"stopped the controller (pid {daemons['controller']}), meshd-proxy (pid {daemons['proxy']})"
                in down.stdout), down.stdout
        assert not [p for p in [*ranks, *daemons.values()]
                    if background.process_state(p) not in (None, psutil.STATUS_ZOMBIE)]  # (init reaps none here)
        assert named(mesh) == [] and background.agents_children(tmp_path) == []
        assert all(a.proc.poll() is None for a in agents)  # the agents are the nodes' own, not meshctl's


@pytest.mark.parametrize("pid,state,says", [
    (41, "stopped", ["pid 41 is stopped (state T: SIGSTOP, or a debugger holds it)", "`kill -CONT 41` resumes it",
                     "`kill -KILL 41`, then `meshctl up`"]),
    (41, "tracing-stop", ["pid 41 is stopped", "`kill -CONT 41`"]),
    (41, "sleeping", ["pid 41 is sleeping, wedged or overloaded", "`kill 41`, then `meshctl up`"]),
    (41, None, ["pid 41 has just exited", "`meshctl up` starts one"]),
    (None, None, ["its process is not one meshctl can see"]),
], ids=["stopped", "under a debugger", "wedged", "just exited", "not visible"])
def test_a_controller_that_takes_connections_and_answers_none_is_named_by_its_process(pid, state, says):
    said = silent_controller("127.0.0.1:8001", pid, state)
    assert said.startswith("the controller at 127.0.0.1:8001 accepts connections but does not answer")
    assert all(s in said for s in says), said


def test_the_controllers_pid_is_the_listener_on_its_address_when_meshctl_did_not_start_it(tmp_path, demo_model):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        mesh = write_mesh(tmp_path, make_agents(tmp_path, 1), demo_model,
                          control={"listen": f"127.0.0.1:{s.getsockname()[1]}"})
        assert Control(load(mesh)).process() == (os.getpid(), "running")
    assert Control(load(mesh)).process() == (None, None)


def test_nodes_is_the_demo_meshs_and_takes_the_counts_its_model_divides_into(tmp_path, demo_model):
    three = run("up", "--nodes", "3")
    assert three.returncode == 2 and "the demo mesh has 1, 2, 4 or 8 nodes" in three.stderr
    mesh = write_mesh(tmp_path, make_agents(tmp_path, 2), demo_model)
    r = run("--config", str(mesh), "up", "--nodes", "1")
    assert r.returncode == 1 and f"--nodes is the demo mesh's; {mesh} lists this mesh's 2 nodes" in r.stderr


@pytest.mark.parametrize("status,says", [
    (None, ["not reached at https://a:7701 (refused)", "is its agent running? `meshctl doctor`"]),
    (401, ["refused the token in", "copy the token from that node's agent"]),
    (404, ["does not know DELETE /v1/snapshots (404)", "older meshd", "`meshctl agents install` updates it"]),
    (500, ["its agent answered 500: disk on fire"]),
], ids=["unreachable", "wrong token", "older agent", "agent error"])
def test_a_node_whose_snapshots_cache_clear_could_not_delete_is_named_with_the_fix(status, says):
    node = Node("studio-1", "https://a:7701", Path("/etc/meshd/studio-1.token"))
    said = cache.failure(node, status, "refused" if status is None else "disk on fire")
    assert all(s in said for s in says), said
