"""SSH to the nodes (paramiko): host keys verified against known_hosts, a
timeout on connecting and on every command, and the user's ~/.ssh/config
followed as OpenSSH follows it (Host aliases, HostName, User, Port,
IdentityFile, ProxyJump).

An unknown host key is refused with its fingerprint shown, unless the caller
asked to trust new hosts (`--trust-new-host`), which pins it in known_hosts.
A changed key is always refused. Nothing secret (keys, tokens) is logged.
"""

from __future__ import annotations

import base64
import hashlib
import os
import select
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import paramiko

from meshd.config import Ssh as Settings


class SshError(Exception):
    """Names the node, what failed and the fix."""


@dataclass(frozen=True)
class Target:
    node: str
    host: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()  # ~/.ssh/config's IdentityFile
    jump: "Target | None" = None  # ~/.ssh/config's ProxyJump: reach this one through that one

    @property
    def known_hosts_name(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.code == 0


def read_config(path: str) -> paramiko.SSHConfig | None:
    """The user's OpenSSH client config, or None when there is none."""
    if not path or not Path(path).is_file():
        return None
    try:
        return paramiko.SSHConfig.from_path(path)
    except (OSError, paramiko.ssh_exception.ConfigParseError) as e:
        raise SshError(f"cannot read {path} ({e}); fix it, or set [ssh] config = \"\" to ignore it") from None


def parse_target(node: str, spec: str, default_user: str, config: paramiko.SSHConfig | None = None,
                 hops: int = 0) -> Target:
    """`[user@]host[:port]` -> Target. What the spec leaves out comes from `config`'s Host entry (as
    OpenSSH does: HostName, User, Port, IdentityFile, ProxyJump), then `default_user`."""
    user, _, hostport = spec.rpartition("@")
    host, port = hostport, None
    if hostport.count(":") == 1:
        host, _, raw = hostport.partition(":")
        if not raw.isdigit():
            raise SshError(f"{node}: ssh = {spec!r}: the port must be a number, e.g. ssh = \"admin@10.0.0.2:22\"")
        port = int(raw)
    if not host:
        raise SshError(f"{node}: ssh = {spec!r} names no host, e.g. ssh = \"admin@studio-2.local\"")
    opts = config.lookup(host) if config else {}
    jump = None
    if opts.get("proxyjump") and opts["proxyjump"] != "none":
        if hops >= 4:
            raise SshError(f"{node}: ProxyJump for {host} goes more than 4 hops deep (a loop in ~/.ssh/config?)")
        first = opts["proxyjump"].split(",")[0].strip()  # each hop's own ProxyJump reaches the next
        jump = parse_target(f"{node} (through {first})", first, default_user, config, hops + 1)
    return Target(node, opts.get("hostname", host), port or int(opts.get("port", 22)),
                  user or opts.get("user") or default_user or os.environ.get("USER", "root"),
                  tuple(opts.get("identityfile", ())), jump)


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _Refuse(paramiko.MissingHostKeyPolicy):
    def __init__(self, target: Target, known_hosts: Path, trust_new: bool):
        self.target, self.known_hosts, self.trust_new = target, known_hosts, trust_new

    def missing_host_key(self, client, hostname, key):
        name = self.target.known_hosts_name
        if not self.trust_new:
            raise SshError(
                f"{self.target.node}: the host key of {name} is not in {self.known_hosts} "
                f"({key.get_name()} {fingerprint(key)}); check that fingerprint on the node "
                f"(`ssh-keygen -lf /etc/ssh/ssh_host_{key.get_name().removeprefix('ssh-')}_key.pub`) and pin it with "
                f"--trust-new-host")
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with self.known_hosts.open("a") as f:
            f.write(f"{name} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(name, key.get_name(), key)


class Session:
    """One SSH connection to one node; use as a context manager."""

    def __init__(self, target: Target, settings: Settings, *, trust_new: bool = False):
        self.target, self.settings, self.trust_new = target, settings, trust_new
        self.known_hosts = Path(settings.known_hosts).expanduser()
        self.client = paramiko.SSHClient()
        if self.known_hosts.exists():
            self.client.load_host_keys(str(self.known_hosts))
        self.client.set_missing_host_key_policy(_Refuse(target, self.known_hosts, trust_new))

    def __enter__(self) -> "Session":
        t, s = self.target, self.settings
        where = f"{t.node} ({t.user}@{t.host}:{t.port})"
        keys = [str(s.key_file)] if s.key_file else [k for k in t.key_files if Path(k).expanduser().is_file()]
        self.jump = Session(t.jump, s, trust_new=self.trust_new).__enter__() if t.jump else None
        try:
            sock = self.jump.client.get_transport().open_channel(
                "direct-tcpip", (t.host, t.port), ("127.0.0.1", 0), timeout=s.connect_timeout) if self.jump else None
            self.client.connect(t.host, port=t.port, username=t.user, timeout=s.connect_timeout,
                                banner_timeout=s.connect_timeout, auth_timeout=s.connect_timeout,
                                key_filename=keys or None, look_for_keys=not keys, allow_agent=True, sock=sock)
        except paramiko.BadHostKeyException as e:
            raise SshError(
                f"{t.node}: the host key of {t.known_hosts_name} CHANGED: {self.known_hosts} has "
                f"{fingerprint(e.expected_key)}, the node offers {fingerprint(e.key)}. If the node was reinstalled, "
                f"remove the old key (`ssh-keygen -R '{t.known_hosts_name}' -f {self.known_hosts}`) and pin the new "
                f"one with --trust-new-host; otherwise do not connect") from None
        except paramiko.AuthenticationException:
            key = s.key_file or "ssh-agent / ~/.ssh/id_*"
            raise SshError(f"{where}: the key was refused ({key}); add its public key to "
                           f"~{t.user}/.ssh/authorized_keys on the node") from None
        except SshError:
            raise
        except (OSError, paramiko.SSHException) as e:
            raise SshError(f"{where}: cannot connect ({type(e).__name__}: {e}); check that the node is up, "
                           f"that sshd runs (macOS: System Settings > Sharing > Remote Login) and the address in "
                           f"mesh.toml") from None
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()
        if self.jump:
            self.jump.__exit__(*exc)

    def run(self, command: str, *, timeout: float | None = None) -> Result:
        """Run `command` (a shell line) and wait for it, at most `timeout` seconds."""
        timeout = timeout or self.settings.command_timeout
        try:
            chan = self.client.get_transport().open_session(timeout=self.settings.connect_timeout)
            chan.exec_command(command)
        except (OSError, paramiko.SSHException) as e:
            raise SshError(f"{self.target.node}: the connection broke running `{command}` ({e}); "
                           "check that the node is still up") from None
        out, err = [], []
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SshError(f"{self.target.node}: `{command}` did not finish within {timeout:.0f}s; "
                                   f"a tool that hangs there (ibv_devinfo after a crash) means the node needs a "
                                   f"reboot: meshctl reboot {self.target.node}")
                select.select([chan], [], [], min(left, 0.5))
                while chan.recv_stderr_ready():
                    err.append(chan.recv_stderr(65536))
                while chan.recv_ready():
                    out.append(chan.recv(65536))
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
            return Result(chan.recv_exit_status(), b"".join(out).decode(errors="replace"),
                          b"".join(err).decode(errors="replace"))
        finally:
            chan.close()


def ssh_config(targets: list[Target], settings: Settings) -> str:
    """The same targets and host-key rules for OpenSSH's client (what mlx.distributed_config runs); a
    ProxyJump hop gets an entry of its own, under the same rules."""
    lines: list[str] = []

    def entry(t: Target, name: str) -> None:
        lines.extend([f"Host {name}", f"  HostName {t.host}", f"  Port {t.port}", f"  User {t.user}",
                      f"  UserKnownHostsFile {Path(settings.known_hosts).expanduser()}", "  StrictHostKeyChecking yes",
                      "  BatchMode yes", f"  ConnectTimeout {int(settings.connect_timeout)}"])
        keys = [str(settings.key_file)] if settings.key_file else list(t.key_files)
        lines.extend([f"  IdentityFile {k}" for k in keys] + (["  IdentitiesOnly yes"] if keys else []))
        if t.jump:
            lines.append(f"  ProxyJump {name}-jump")
            entry(t.jump, f"{name}-jump")

    for t in targets:
        entry(t, t.node)
    return "\n".join(lines) + "\n"


def openssh_shim(directory: Path, config: Path) -> Path:
    """A directory holding an `ssh` that is OpenSSH with `config`, to put first on a child's PATH."""
    real = shutil.which("ssh")
    if real is None:
        raise SshError("the OpenSSH client (ssh) is not installed here; mlx.distributed_config runs it "
                       "(Debian: apt-get install openssh-client)")
    directory.mkdir(parents=True, exist_ok=True)
    shim = directory / "ssh"
    shim.write_text(f'#!/bin/sh\nexec {real} -F {config} "$@"\n')
    shim.chmod(0o755)
    return directory
