"""Real OpenSSH servers on loopback, one per pretend node, each with its own
host key, and the macOS stand-ins (tests/standins) first on the PATH of the
sessions they open. The node a server plays reaches the stand-ins through
sshd's own SetEnv, so the client sends nothing test-specific."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from kit.waiting import wait_for
from meshd.meshctl.ports import free_ports

STANDINS = Path(__file__).resolve().parents[1] / "standins"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


@dataclass
class Node:
    name: str
    port: int
    dir: Path
    proc: subprocess.Popen | None = None

    @property
    def ssh(self) -> str:
        return f"{os.environ.get('USER', 'root')}@127.0.0.1:{self.port}"

    @property
    def home(self) -> Path:
        """The $HOME of this node's sessions (no shell rc files: sessions start fast)."""
        return self.dir / "home"

    @property
    def state(self) -> Path:
        """Where the stand-ins keep this node's boot id, wired limit, commands and faults."""
        return self.dir.parent / "standin-state" / self.name

    def fault(self, name: str, on: bool = True) -> None:
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / name).touch() if on else (self.state / name).unlink(missing_ok=True)

    def host_key_line(self) -> str:
        kind, b64 = (self.dir / "host_key.pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {b64}"

    def new_host_key(self) -> None:
        """As a reinstalled node: a different host key on the same address."""
        self.stop()
        for f in (self.dir / "host_key", self.dir / "host_key.pub"):
            f.unlink()
        keygen(self.dir / "host_key")
        self.start()

    def start(self) -> "Node":
        log = open(self.dir / "sshd.log", "ab")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.dir / "sshd_config")], stdout=log,
                                     stderr=subprocess.STDOUT)
        def listening():
            if self.proc.poll() is not None:
                raise AssertionError(f"sshd for {self.name} exited: {(self.dir / 'sshd.log').read_text()[-2000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0
        wait_for(listening, 30, f"sshd of {self.name}")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass
class Fleet:
    nodes: list[Node]
    client_key: Path
    dir: Path

    def known_hosts(self, path: Path, nodes: list[Node] | None = None) -> Path:
        path.write_text("".join(n.host_key_line() + "\n" for n in (self.nodes if nodes is None else nodes)))
        return path

    def ssh_of(self, agents) -> dict[str, str]:
        """Each agent's node reached through the server of the same index."""
        return {a.node: n.ssh for a, n in zip(agents, self.nodes)}

    def ssh_settings(self, path: Path, **extra) -> dict:
        """mesh.toml's [ssh] for this fleet: its host keys pinned in path/known_hosts, the client key."""
        return {"known_hosts": str(self.known_hosts(path / "known_hosts")), "key_file": str(self.client_key), **extra}

    def stop(self) -> None:
        """Stop the servers, and whatever their sessions left running (a hung ibv_devinfo stays hung, as the
        real one does, until someone kills it)."""
        for n in self.nodes:
            n.stop()
        state = str(self.dir / "standin-state")
        for p in psutil.process_iter(["pid"]):
            try:
                if p.environ().get("MESHD_STANDIN_STATE") == state:
                    p.kill()
            except psutil.Error:
                pass


def start_fleet(tmp: Path, n: int = 4, path_extra: list[str] | None = None, env: dict[str, str] | None = None) -> Fleet:
    """`n` sshd servers; their sessions get the stand-ins first on PATH, then `path_extra`, plus `env`."""
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    client_key = keygen(tmp / "client_key")
    authorized = tmp / "authorized_keys"
    authorized.write_text((tmp / "client_key.pub").read_text())
    authorized.chmod(0o600)
    path = ":".join([str(STANDINS / "bin"), *(path_extra or []), str(Path(sys.executable).parent),
                     "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"])
    nodes = []
    for i, port in enumerate(free_ports(n)):
        d = tmp / f"sshd-node{i}"
        d.mkdir()
        keygen(d / "host_key")
        node = Node(f"node{i}", port, d)
        node.home.mkdir()
        (d / "sshd_config").write_text(
            f"Port {port}\nListenAddress 127.0.0.1\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {authorized}\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nPermitRootLogin prohibit-password\n"
            f"AllowUsers {os.environ.get('USER', 'root')}\nSubsystem sftp internal-sftp\n"
            f"SetEnv HOME={node.home} MESHD_STANDIN_NODE={node.name} MESHD_STANDIN_STATE={tmp / 'standin-state'} PATH={path}"
            + "".join(f" {k}={v}" for k, v in (env or {}).items()) + "\n")
        nodes.append(node.start())
    return Fleet(nodes, client_key, tmp)
