"""`meshctl agents install` against a loopback sshd playing a Mac: meshd goes
into a venv on the node, the agent config and a 0600 token are written, the
launchd daemon is bootstrapped (launchctl is a stand-in: Linux has none) and
the agent that starts answers with the mesh's token, over TLS with a certificate
from the mesh CA."""

import os
import signal
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import requests

from kit.ps import shown
from kit.sshd import start_fleet
from meshd.meshctl.ports import free_ports


def test_agents_install_leaves_a_running_agent_that_answers(tmp_path):
    # The pretend Mac's Python already has mlx and meshd's other dependencies (on a Mac: Homebrew's
    # python with mlx installed, which --system-site-packages lets the venv use): its sessions see the
    # packages of this test run.
    fleet = start_fleet(tmp_path, 1, env={"PYTHONPATH": sysconfig.get_paths()["purelib"]})
    node = fleet.nodes[0]
    home = node.home
    (port,) = free_ports(1)
    token = tmp_path / "tokens" / "node0"
    known = fleet.known_hosts(tmp_path / "known_hosts")
    mesh = tmp_path / "mesh.toml"
    mesh.write_text(f'name = "inst"\n[[nodes]]\nname = "node0"\nagent = "https://127.0.0.1:{port}"\n'
                    f'token_file = "{token}"\nssh = "{node.ssh}"\n[runtime]\nmodel = "/models/x"\n'
                    f'[ssh]\nknown_hosts = "{known}"\nkey_file = "{fleet.client_key}"\ncommand_timeout = 60\n')
    services = tmp_path / "LaunchDaemons"
    services.mkdir()
    pidfile = node.state / "launchd-com.meshd.agent.pid"
    try:
        r = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "--config", str(mesh), "agents", "install", "node0",
                            "--system-site-packages", "--service-dir", str(services)],
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "node0: macos, installing into" in r.stdout
        assert "the agent answers at" in r.stdout

        base = home / ".meshd"
        assert (base / "venv" / "bin" / "python").exists()
        site = next((base / "venv" / "lib").glob("python3*/site-packages"))
        assert (site / "meshd-0.1.0.dist-info").is_dir() and (site / "agents" / "server.py").exists()
        assert shown(int(pidfile.read_text())) == f"meshd-agent node=node0 config={base / 'agent' / 'agent.toml'}"
        node_token = base / "agent" / "token"
        assert stat.S_IMODE(node_token.stat().st_mode) == 0o600
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert node_token.read_text().strip() == token.read_text().strip()
        assert (services / "com.meshd.agent.plist").exists()
        assert f"<string>{base / 'venv' / 'bin' / 'python'}</string>" in (services / "com.meshd.agent.plist").read_text()

        for name in ("agent.pem", "agent.key"):
            assert stat.S_IMODE((base / "agent" / "tls" / name).stat().st_mode) == 0o600
        ca = str(tmp_path / "state" / "tls" / "ca.pem")
        headers = {"Authorization": f"Bearer {token.read_text().strip()}"}
        facts = requests.get(f"https://127.0.0.1:{port}/v1/node", headers=headers, verify=ca, timeout=10)
        assert facts.status_code == 200 and facts.json()["node"] == "node0"
        assert requests.get(f"https://127.0.0.1:{port}/v1/node", verify=ca, timeout=10).status_code == 401
        with pytest.raises(requests.ConnectionError):  # plain HTTP: the TLS listener drops it
            requests.get(f"http://127.0.0.1:{port}/v1/node", headers=headers, timeout=10)

        again = subprocess.run([sys.executable, "-m", "meshd.meshctl.cli", "--config", str(mesh), "agents", "install",
                                "node0", "--system-site-packages", "--service-dir", str(services)],
                               capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, again.stdout + again.stderr  # re-install replaces the running service
    finally:
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            except ProcessLookupError:
                pass
        fleet.stop()
    assert Path(node.state / "commands.log").read_text().count("launchctl bootstrap system") == 2
