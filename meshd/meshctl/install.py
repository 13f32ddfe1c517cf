"""`meshctl agents install`: over SSH, put meshd into a virtual environment
on a node, write its agent config and token (0600), install and start the
launchd daemon (macOS) or systemd unit (Linux), and confirm that the agent
answers with the token the mesh holds."""

from __future__ import annotations

import base64
import hashlib
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import paramiko

from common.secretfile import ensure_secret
from common.tls import ensure_ca, issue
from meshd.nodes import provision
from meshd.meshctl import service
from meshd.config import MeshConfig, Node
from meshd.share import CHECKOUT, in_checkout
from meshd.nodes.ssh import Session, SshError

DAEMONS = "/Library/LaunchDaemons"
UNITS = "/etc/systemd/system"


class InstallError(Exception):
    pass


def build_wheel(out: Path) -> Path:
    """This meshd as a wheel (no dependencies: the node's pip resolves them): built from the checkout, or
    packed again from the installed files when meshd was installed from a wheel."""
    if not in_checkout():
        return repack_installed(out)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(out), str(CHECKOUT)], capture_output=True, text=True, timeout=300)
    wheels = sorted(out.glob("meshd-*.whl"))
    if r.returncode != 0 or not wheels:
        raise InstallError(f"cannot build the meshd wheel here: {r.stderr.strip()[-500:]}")
    return wheels[-1]


def repack_installed(out: Path) -> Path:
    """The installed meshd distribution as a wheel again: its files as its RECORD lists them (scripts,
    which pip writes for each machine, and caches left out), with a RECORD of their hashes."""
    dist = metadata.distribution("meshd")
    info = f"meshd-{dist.version}.dist-info"
    skip = {f"{info}/{name}" for name in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    files = [f for f in dist.files or () if not str(f).startswith("..") and "__pycache__" not in f.parts
             and str(f) not in skip]
    out.mkdir(parents=True, exist_ok=True)
    wheel = out / f"meshd-{dist.version}-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        for f in files:
            data = Path(dist.locate_file(f)).read_bytes()
            z.writestr(str(f), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{f},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def node_token(node: Node, say: Callable[[str], None]) -> str:
    """The token the mesh holds for this node; a new random one (0600) when there is none yet."""
    if not node.token_file.exists():
        say(f"{node.name}: new agent token in {node.token_file}")
    return ensure_secret(node.token_file)


def agent_toml(node: Node, listen: str, *, allow_reboot: bool, wired_limit_mb: int, tls: bool) -> str:
    lines = [f'node = "{node.name}"', f'listen = "{listen}"', 'token_file = "token"', 'state_dir = "state"',
             f"allow_reboot = {'true' if allow_reboot else 'false'}"]
    if tls:
        lines += ['tls_cert_file = "tls/agent.pem"', 'tls_key_file = "tls/agent.key"']
    if wired_limit_mb:
        lines.append(f"wired_limit_mb = {wired_limit_mb}")
    return "\n".join(lines) + "\n"


def install_agent(cfg: MeshConfig, node: Node, wheel: Path, *, trust_new: bool = False,
                  system_site_packages: bool = False, allow_reboot: bool = False, wired_limit_mb: int = 0,
                  service_dir: str | None = None, say: Callable[[str], None] = print) -> None:
    target = provision.target_of(cfg, node.name)
    url = urlparse(node.agent)
    listen = f"{url.hostname}:{url.port or 7701}"
    token = node_token(node, say)
    tls_files = None
    if url.scheme == "https":
        ca = ensure_ca(cfg.tls_dir, cfg.name)
        tls_files = issue(ca, node.name, [url.hostname, node.address])
        say(f"{node.name}: certificate for {url.hostname} from the mesh CA ({ca.cert})")
    with Session(target, cfg.ssh, trust_new=trust_new) as s:
        def run(command: str, what: str, timeout: float = 120) -> str:
            r = s.run(command, timeout=timeout)
            if not r.ok:
                raise InstallError(f"{node.name}: {what} failed (`{command}` exited {r.code}): "
                                   f"{(r.stderr or r.stdout).strip()[-400:]}")
            return r.stdout.strip()

        system = "macos" if run("uname -s", "uname") == "Darwin" else "linux"
        home = run('printf %s "$HOME"', "finding the home directory")
        base = f"{home}/.meshd"
        venv = f"{base}/venv"
        say(f"{node.name}: {system}, installing into {venv}")
        run("python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'", "Python 3.11+ (install python@3.12 "
            "from Homebrew or python3.11 from your distribution)")
        run(f"mkdir -p {base}/dist {base}/agent/state/log {base}/service", "creating directories")
        run(f"python3 -m venv {'--system-site-packages ' if system_site_packages else ''}{venv}", "creating the venv")
        try:
            sftp = s.client.open_sftp()
        except paramiko.SSHException as e:
            raise InstallError(f"{node.name}: its sshd offers no SFTP ({e}); enable it (macOS has it on; elsewhere add "
                               f"`Subsystem sftp internal-sftp` to sshd_config)")
        try:
            sftp.put(str(wheel), f"{base}/dist/{wheel.name}")
            extra = "[cpu]" if system == "linux" else ""
            say(f"{node.name}: pip install {wheel.name}{extra} (its dependencies come from the node's index)")
            pip = f"{venv}/bin/python -m pip install -q"
            # meshd itself always replaced (a re-install of the same version), then what it needs.
            run(f"{pip} --force-reinstall --no-deps '{base}/dist/{wheel.name}' && {pip} '{base}/dist/{wheel.name}{extra}'",
                "pip install", 1800)
            private = {"token": (token + "\n").encode()}
            if tls_files:
                run(f"mkdir -p {base}/agent/tls", "creating the certificate directory")
                private.update({"tls/agent.pem": tls_files[0], "tls/agent.key": tls_files[1]})
            for name, data in private.items():
                with sftp.open(f"{base}/agent/{name}", "w") as f:
                    f.chmod(0o600)  # before anything is in it: never readable by others, not for an instant
                    f.write(data)
            with sftp.open(f"{base}/agent/agent.toml", "w") as f:
                f.write(agent_toml(node, listen, allow_reboot=allow_reboot, wired_limit_mb=wired_limit_mb,
                                   tls=tls_files is not None))
            values = {"python": f"{venv}/bin/python", "config": f"{base}/agent/agent.toml", "user": target.user,
                      "workdir": f"{base}/agent", "state_dir": f"{base}/agent/state",
                      "log_dir": f"{base}/agent/state/log"}
            files = service.render_with("agent", system, values, wired_limit_mb or None)
            for name, text in files.items():
                with sftp.open(f"{base}/service/{name}", "w") as f:
                    f.write(text)
        finally:
            sftp.close()
        dest = service_dir or (DAEMONS if system == "macos" else UNITS)
        for name in files:
            run(f"sudo -n cp {base}/service/{name} {dest}/{name}", f"installing {name} (passwordless sudo for cp)")
            if system == "macos":
                label = name.removesuffix(".plist")
                s.run(f"sudo -n launchctl bootout system/{label}", timeout=30)  # not loaded yet: fine
                run(f"sudo -n launchctl bootstrap system {dest}/{name}", f"starting {label}")
            else:
                unit = name.removesuffix(".service")
                run(f"sudo -n systemctl daemon-reload && sudo -n systemctl enable --now {unit}", f"starting {unit}")
        say(f"{node.name}: agent service started; waiting for {node.agent}/healthz")
    confirm(node, token, cfg.client_tls() if tls_files else None)
    say(f"{node.name}: the agent answers at {node.agent} and accepts the mesh's token")


def confirm(node: Node, token: str, tls: ssl.SSLContext | None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"{node.agent}/v1/node", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=10, context=tls) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as e:
            raise InstallError(f"{node.name}: the agent answers but refuses the token ({e.code}); "
                               f"{node.token_file} and the node's ~/.meshd/agent/token differ")
        except OSError as e:
            last = str(e)
        time.sleep(1)
    raise InstallError(f"{node.name}: the agent did not answer at {node.agent} within {timeout:.0f}s ({last}); "
                       f"see ~/.meshd/agent/state/log/meshd-agent.log on the node")


def install(cfg: MeshConfig, names: list[str], say: Callable[[str], None] = print, **options) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        say(f"built {wheel.name}")
        for name in names:
            try:
                install_agent(cfg, cfg.node(name), wheel, say=say, **options)
            except SshError as e:
                raise InstallError(str(e))
