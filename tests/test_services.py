"""Service definitions for this machine, and the sd_notify protocol on a real
NOTIFY_SOCKET."""

import plistlib
import signal
import socket
import subprocess
import sys

import pytest

from kit.agents import make_agents
from meshd import service

MESH = '[[nodes]]\nname = "a"\nagent = "http://127.0.0.1:7701"\ntoken_file = "t"\n[runtime]\nmodel = "/m"\n'


@pytest.fixture
def configs(tmp_path):
    (tmp_path / "mesh.toml").write_text(MESH)
    (tmp_path / "agent.toml").write_text('node = "n"\ntoken_file = "t"\n')
    return tmp_path


def verify(path) -> str:
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    return (r.stdout + r.stderr).strip() + ("" if r.returncode == 0 else f" (exit {r.returncode})")


@pytest.mark.parametrize("kind,config,name", [("controller", "mesh.toml", "meshd.service"),
                                              ("agent", "agent.toml", "meshd-agent.service")])
def test_rendered_units_pass_systemd_analyze_verify(configs, kind, config, name):
    out = subprocess.run([sys.executable, "-m", "meshd.cli", "service", "install", kind, str(configs / config),
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


def test_plists_load_and_carry_the_launchd_keys(configs):
    ctl = plistlib.loads(service.render("controller", configs / "mesh.toml", system="macos")
                         ["com.meshd.controller.plist"].encode())
    files = service.render("agent", configs / "agent.toml", system="macos", wired_limit_mb=253952)
    agent = plistlib.loads(files["com.meshd.agent.plist"].encode())
    wired = plistlib.loads(files["com.meshd.wired-limit.plist"].encode())
    for p in (ctl, agent):
        assert p["KeepAlive"] is True and p["RunAtLoad"] is True
        assert p["ThrottleInterval"] > 0 and p["ExitTimeOut"] > 0
        assert p["StandardOutPath"].endswith(".log") and p["ProgramArguments"][0] == sys.executable
    assert agent["AbandonProcessGroup"] is True and "AbandonProcessGroup" not in ctl
    assert agent["ProgramArguments"][-1] == str((configs / "agent.toml").resolve())
    assert wired["ProgramArguments"] == ["/usr/sbin/sysctl", "iogpu.wired_limit_mb=253952"]
    assert wired["RunAtLoad"] is True and "KeepAlive" not in wired


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
