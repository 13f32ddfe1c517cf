"""Service definitions for this machine, and the sd_notify protocol on a real
NOTIFY_SOCKET."""

import os
import plistlib
import re
import signal
import socket
import stat
import subprocess
import sys

import pytest
import requests

from common.logfile import RotatingLog
from kit.agents import make_agents
from kit.waiting import wait_for
from meshd.meshctl import service
from meshd.meshctl.ports import free_ports

MESH = '[[nodes]]\nname = "a"\nagent = "http://127.0.0.1:7701"\ntoken_file = "t"\n[runtime]\nmodel = "/m"\n'


@pytest.fixture
def configs(tmp_path):
    (tmp_path / "mesh.toml").write_text(MESH)
    (tmp_path / "agent.toml").write_text('node = "n"\ntoken_file = "t"\n')
    return tmp_path


def verify(path) -> str:
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    return (r.stdout + r.stderr).strip() + ("" if r.returncode == 0 else f" (exit {r.returncode})")


def exposure(path) -> float:
    """What `systemd-analyze security` rates the unit (0 safest .. 10 unsafe)."""
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(path)],
                       capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(1))


@pytest.mark.parametrize("kind,config,name,most", [("controller", "mesh.toml", "meshd.service", 3.0),
                                                   ("proxy", "mesh.toml", "meshd-proxy.service", 3.0),
                                                   ("agent", "agent.toml", "meshd-agent.service", 5.0)])
def test_rendered_units_pass_systemd_analyze_verify_and_security(configs, kind, config, name, most):
    out = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "service", "install", kind, str(configs / config),
                          "--system", "linux", "--dest", str(configs / "out")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"sudo systemctl enable --now {name.removesuffix('.service')}" in out.stdout
    unit = (configs / "out" / name).read_text()
    assert verify(configs / "out" / name) == ""
    assert f"ExecStart={sys.executable} -m" in unit and str((configs / config).resolve()) in unit
    for line in ("Type=notify", "Restart=always", "StartLimitBurst=10", "WatchdogSec=30", "TimeoutStopSec="):
        assert line in unit
    assert ("KillMode=process" in unit) == (kind == "agent")
    broken = configs / "out" / f"broken-{name}"
    broken.write_text(unit.replace("Type=notify", "Type=bogus"))
    assert "Failed to parse service type" in verify(broken)  # the check bites
    assert exposure(configs / "out" / name) <= most
    open_door = configs / "out" / f"open-{name}"
    open_door.write_text("\n".join(line for line in unit.splitlines()
                                   if not line.startswith(("SystemCall", "Protect", "Restrict", "Private"))))
    assert exposure(open_door) > most  # the rating reads the sandbox


def test_the_proxy_takes_its_listener_from_a_socket_unit_and_reloads_by_handing_it_over(configs):
    out = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "service", "install", "proxy", str(configs / "mesh.toml"),
                          "--system", "linux", "--dest", str(configs / "out")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "sudo systemctl enable --now meshd-proxy.socket meshd-proxy" in out.stdout
    sock = (configs / "out" / "meshd-proxy.socket").read_text()
    assert "ListenStream=127.0.0.1:8000" in sock and verify(configs / "out" / "meshd-proxy.socket") == ""
    unit = (configs / "out" / "meshd-proxy.service").read_text()
    assert "Requires=meshd-proxy.socket" in unit and "ExecReload=/bin/kill -HUP $MAINPID" in unit
    assert "NotifyAccess=all" in unit  # a successor names itself the main process
    plist = plistlib.loads(service.render("proxy", configs / "mesh.toml", system="macos")["com.meshd.proxy.plist"]
                           .encode())
    assert plist["Sockets"]["Listeners"] == {"SockNodeName": "127.0.0.1", "SockServiceName": "8000",
                                             "SockType": "stream"}
    assert plist["ProgramArguments"][1:3] == ["-m", "meshd.dataplane.proxyd"] and plist["KeepAlive"] is True


def test_plists_load_and_carry_the_launchd_keys(configs):
    ctl = plistlib.loads(service.render("controller", configs / "mesh.toml", system="macos")
                         ["com.meshd.controller.plist"].encode())
    files = service.render("agent", configs / "agent.toml", system="macos", wired_limit_mb=253952)
    agent = plistlib.loads(files["com.meshd.agent.plist"].encode())
    wired = plistlib.loads(files["com.meshd.wired-limit.plist"].encode())
    for p in (ctl, agent):
        assert p["KeepAlive"] is True and p["RunAtLoad"] is True
        assert p["ThrottleInterval"] > 0 and p["ExitTimeOut"] > 0
        assert p["StandardErrorPath"].endswith(".log") and p["ProgramArguments"][0] == sys.executable
        assert p["ProgramArguments"][-2] == "--log-file" and p["ProgramArguments"][-1].endswith(".log")
        assert p["SoftResourceLimits"]["NumberOfFiles"] == p["HardResourceLimits"]["NumberOfFiles"] >= 65536
        assert p["Umask"] == 0o077 and p["UserName"]
    assert agent["AbandonProcessGroup"] is True and "AbandonProcessGroup" not in ctl
    assert agent["ProcessType"] == "Interactive"  # launchd throttles the CPU and I/O of jobs without one
    assert agent["ProgramArguments"][4] == str((configs / "agent.toml").resolve())
    out = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "service", "install", "agent", str(configs / "agent.toml"),
                          "--system", "macos", "--dest", str(configs / "out")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "sudo launchctl bootstrap system /Library/LaunchDaemons/com.meshd.agent.plist" in out.stdout
    assert "LaunchAgents" not in out.stdout and "load -w" not in out.stdout
    assert wired["ProgramArguments"] == ["/usr/sbin/sysctl", "iogpu.wired_limit_mb=253952"]
    assert wired["RunAtLoad"] is True and "KeepAlive" not in wired


def test_a_daemons_log_file_is_private_and_rotates_by_size(tmp_path):
    (agent,) = make_agents(tmp_path, 1)
    log = tmp_path / "log" / "meshd-agent.log"
    agent.proc = subprocess.Popen([sys.executable, "-m", "agents.server", "--config", str(agent.dir / "agent.toml"),
                                   "--log-file", str(log)], stderr=subprocess.PIPE)
    try:
        agent.wait_healthy()
        wait_for(lambda: "agent listening" in log.read_text(), 30, "the agent's first line in its log file")
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
    finally:
        agent.kill()
    rotating = RotatingLog(tmp_path / "r.log", max_bytes=100, keep=2)
    for i in range(13):  # three lines a file
        rotating.write(f"line {i:02d} " + "x" * 30 + "\n")
    names = sorted(p.name for p in tmp_path.glob("r.log*"))
    assert names == ["r.log", "r.log.1", "r.log.2"]
    assert "line 12" in (tmp_path / "r.log").read_text() and "line 00" not in "".join(
        p.read_text() for p in tmp_path.glob("r.log*"))  # the oldest is dropped, the newest kept


def test_sd_notify_ready_watchdog_and_stopping_on_a_real_socket(tmp_path):
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(30)
    (agent,) = make_agents(tmp_path, 1)
    agent.start(env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"})
    try:
        messages = [sock.recv(4096).decode() for _ in range(3)]
        assert messages[0].startswith("READY=1\nSTATUS=agent node0 on 127.0.0.1:")
        assert messages[1:] == ["WATCHDOG=1", "WATCHDOG=1"]
        agent.proc.send_signal(signal.SIGTERM)
        rest = []
        while "STOPPING=1" not in rest:
            rest.append(sock.recv(4096).decode())
        assert agent.proc.wait(10) == 0
    finally:
        agent.kill()
        sock.close()


def test_a_reloaded_proxy_hands_over_and_its_successor_tells_systemd_it_is_the_main_process(tmp_path):
    """What `systemctl reload meshd-proxy` does (ExecReload: SIGHUP), with no controller to follow: the
    successor takes the socket, says MAINPID=<its pid> and READY=1, and the old process leaves."""
    proxy_port, control_port = free_ports(2)
    (tmp_path / "mesh.toml").write_text(MESH + f'[proxy]\nlisten = "127.0.0.1:{proxy_port}"\n'
                                               f'[control]\nlisten = "127.0.0.1:{control_port}"\n')
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(30)
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    old = subprocess.Popen([sys.executable, "-m", "meshd.dataplane.proxyd", "--config", str(tmp_path / "mesh.toml")], env=env)
    successor = None
    try:
        assert sock.recv(4096).decode().startswith(f"MAINPID={old.pid}\nREADY=1\n")
        old.send_signal(signal.SIGHUP)
        said = sock.recv(4096).decode()
        successor = int(said.split("\n")[0].removeprefix("MAINPID="))
        assert successor != old.pid and "READY=1" in said
        assert old.wait(30) == 0
        r = requests.get(f"http://127.0.0.1:{proxy_port}/health", timeout=10)  # the socket lives on
        assert r.status_code == 503 and "has not reached the controller" in r.json()["error"]["message"]
    finally:
        for pid in filter(None, (old.pid, successor)):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        sock.close()
