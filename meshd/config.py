"""mesh.toml -> frozen dataclasses. Every mistake names the key, says what was
wrong and shows an example of right (`meshctl config check`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlparse

from common.hostfile import BACKENDS, local_index
from common.tomlcheck import ConfigError, loopback, read_toml, split_listen, table
from meshd.fleet import Recovery


@dataclass(frozen=True)
class Node:
    name: str
    agent: str  # https://host:port of its meshd-agent (http:// on loopback)
    token_file: Path
    address: str = "127.0.0.1"  # where the ring backend reaches it
    ssh: str = ""
    devices: str = ""  # nccl: its GPUs (CUDA_VISIBLE_DEVICES); default: its place among the nodes at its address


@dataclass(frozen=True)
class Runtime:
    profile: str = "meshd-rank"
    model: str = ""
    seed: int = 0
    host: str = "127.0.0.1"  # rank 0's internal listen address
    port: int = 8100
    ring_port: int = 32323
    env: dict = field(default_factory=dict)
    args: dict = field(default_factory=dict)
    draft_model: str = ""
    aliases: tuple[str, ...] = ()  # more names clients may use for the model (a Hugging Face id, say)


def rank0_body(profile: str, body: dict) -> dict:
    """A request body as rank 0 of `profile` takes it: stock mlx_lm.server loads whatever path "model"
    names (its own model is "default_model")."""
    return {**body, "model": "default_model"} if profile == "mlx-lm-server" else body


def ping_body(profile: str) -> dict:
    """One token asked of rank 0 (the readiness check and the idle probe)."""
    return rank0_body(profile, {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})


@dataclass(frozen=True)
class Proxy:
    listen: str = "127.0.0.1:8000"
    api_keys_file: Path | None = None
    concurrency: int = 8
    queue_limit: int = 64
    queue_wait: float = 120.0
    max_body_bytes: int = 4 << 20
    keepalive_interval: float = 10.0
    probe_idle: float = 60.0  # seconds without a request before the idle probe asks for one token
    probe_timeout: float = 120.0
    # Runtimes without a status file (the stock profile): the proxy judges hangs itself, waiting
    # token_stall seconds plus the prompt's prefill at min_prefill_rate tokens/s (and, for a whole
    # answer, max_tokens at min_decode_rate) for bytes from rank 0.
    token_stall: float = 300.0
    min_prefill_rate: float = 50.0
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the endpoint ("*": any)
    min_decode_rate: float = 1.0
    # A stream cut by a generation's death resumes on the next one, at most this many times; a
    # request in flight when poison_after generations died is refused (502, or an error event once
    # streaming) and quarantined for quarantine_seconds, whatever its migrations.
    migration_limit: int = 2
    poison_after: int = 2
    quarantine_seconds: float = 600.0
    allow_open: bool = False  # serve off loopback without api_keys_file, on purpose (warned at every start)

    @property
    def open_off_loopback(self) -> bool:
        return self.api_keys_file is None and not loopback(self.listen.rpartition(":")[0])


@dataclass(frozen=True)
class Ssh:
    """How meshctl reaches the nodes over SSH (provision, doctor, reboot, agents install)."""

    user: str = ""
    known_hosts: str = "~/.ssh/known_hosts"
    key_file: Path | None = None  # none: ssh-agent and the default keys
    connect_timeout: float = 10.0
    command_timeout: float = 120.0


@dataclass(frozen=True)
class Control:
    listen: str = "127.0.0.1:8001"

    @property
    def tls(self) -> bool:
        """Off loopback the control API speaks TLS only, with a certificate from the mesh CA."""
        return not loopback(self.listen.rpartition(":")[0])

    @property
    def url(self) -> str:
        host, _, port = self.listen.rpartition(":")
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = "127.0.0.1"  # where a client on this machine reaches a wildcard listener
        return f"{'https' if self.tls else 'http'}://{host}:{port}"


@dataclass(frozen=True)
class MeshConfig:
    name: str
    backend: str
    nodes: tuple[Node, ...]
    runtime: Runtime
    proxy: Proxy
    recovery: Recovery
    control: Control
    state_dir: Path
    hostfile: Path | None = None
    path: Path | None = None
    ssh: Ssh = field(default_factory=Ssh)

    @property
    def speculative(self) -> bool:
        return bool(self.runtime.draft_model)

    @property
    def tls_dir(self) -> Path:
        """The mesh CA (ca.pem, ca.key) and the control API's certificate."""
        return self.state_dir / "tls"

    @property
    def ca_file(self) -> Path:
        return self.tls_dir / "ca.pem"

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def parse(raw: dict, base: Path, path: Path | None = None) -> MeshConfig:
    name = raw.get("name", "mesh")
    if not isinstance(name, str) or not name:
        raise ConfigError(f'name: expected a non-empty string, got {name!r}; for example name = "studio-mesh"')
    backend = raw.get("backend", "ring")
    if backend not in BACKENDS:
        raise ConfigError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}; for example backend = \"jaccl\"")
    allowed = {"name", "backend", "nodes", "runtime", "proxy", "recovery", "control", "state_dir", "hostfile", "ssh"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown key; mesh.toml takes {', '.join(sorted(allowed))}")
    nodes_raw = raw.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ConfigError('nodes: at least one [[nodes]] table is needed; for example\n'
                          '  [[nodes]]\n  name = "studio-1"\n  agent = "https://10.0.0.1:7701"\n'
                          '  token_file = "tokens/studio-1"')
    nodes = []
    for i, n in enumerate(nodes_raw):
        where = f"nodes[{i}]"
        if not isinstance(n, dict):
            raise ConfigError(f"{where}: expected a table")
        for key, example in (("name", '"studio-1"'), ("agent", '"https://10.0.0.1:7701"'),
                             ("token_file", '"tokens/studio-1"')):
            if not isinstance(n.get(key), str) or not n[key]:
                raise ConfigError(f"{where}.{key}: missing or not a string; for example {key} = {example}")
        if not n["agent"].startswith(("http://", "https://")):
            raise ConfigError(f'{where}.agent: expected a URL, got {n["agent"]!r}; for example agent = '
                              '"https://10.0.0.1:7701"')
        url = urlparse(n["agent"])
        if url.scheme == "http" and not loopback(url.hostname):
            raise ConfigError(f"{where}.agent: {n['agent']} is plain HTTP off loopback, where the agent's token "
                              "would cross the network in clear; use https:// (`meshctl agents install` issues "
                              "the node's certificate from the mesh CA)")
        extra = sorted(set(n) - {"name", "agent", "token_file", "address", "ssh", "devices"})
        if extra:
            raise ConfigError(f"{where}.{extra[0]}: unknown key; a node takes name, agent, token_file, address, ssh, "
                              "devices")
        for key in ("address", "ssh", "devices"):
            if not isinstance(n.get(key, ""), str):
                raise ConfigError(f'{where}.{key}: expected a string, got {n[key]!r}; for example devices = "1"')
        nodes.append(Node(n["name"], n["agent"].rstrip("/"), base / n["token_file"], n.get("address", "127.0.0.1"),
                          n.get("ssh", ""), n.get("devices", "")))
    names = [n.name for n in nodes]
    dupes = sorted({x for x in names if names.count(x) > 1})
    if dupes:
        raise ConfigError(f"nodes: the name {dupes[0]!r} is used twice; node names must be unique")
    if backend == "nccl":
        _check_devices(nodes)
    runtime = table(Runtime, raw.get("runtime"), "runtime", base,
                     {"model": '"/Volumes/models/DeepSeek-V4"', "profile": '"meshd-rank"'})
    if not runtime.model:
        raise ConfigError('runtime.model: missing; the model directory on every node, for example '
                          'model = "/Volumes/models/DeepSeek-V4"')
    proxy = table(Proxy, raw.get("proxy"), "proxy", base, {"listen": '"127.0.0.1:8000"'})
    split_listen("proxy.listen", proxy.listen)
    if proxy.open_off_loopback and not proxy.allow_open:
        raise ConfigError(f"proxy.listen: {proxy.listen} is off loopback and proxy.api_keys_file is not set, so "
                          "anyone who reaches it may use the mesh; set api_keys_file = \"api-keys\" (one key per "
                          "line), or allow_open = true to serve it open on purpose")
    if proxy.concurrency < 1:
        raise ConfigError("proxy.concurrency: must be at least 1")
    recovery = table(Recovery, raw.get("recovery"), "recovery", base, {"ladder": '["restart", "reprovision", "reboot"]'})
    bad_steps = [s for s in recovery.ladder if s not in ("restart", "reprovision", "reboot")]
    if bad_steps or not recovery.ladder or recovery.ladder[0] != "restart":
        raise ConfigError('recovery.ladder: must start with "restart" and use only restart, reprovision, reboot; '
                          'for example ladder = ["restart", "reprovision", "reboot"]')
    control = table(Control, raw.get("control"), "control", base, {"listen": '"127.0.0.1:8001"'})
    split_listen("control.listen", control.listen)
    state_dir = raw.get("state_dir", "state")
    if not isinstance(state_dir, str):
        raise ConfigError(f'state_dir: expected a path, got {state_dir!r}; for example state_dir = "/var/lib/meshd"')
    hostfile = raw.get("hostfile")
    if hostfile is not None and not isinstance(hostfile, str):
        raise ConfigError(f'hostfile: expected a path, got {hostfile!r}; for example hostfile = "hostfile.json"')
    if backend in ("jaccl", "jaccl-ring") and not hostfile:
        hostfile = str(Path(state_dir) / "hostfile.json")  # where `meshctl provision` writes it
    return MeshConfig(name, backend, tuple(nodes), runtime, proxy, recovery, control, base / state_dir,
                      base / hostfile if hostfile else None, path, _ssh(raw.get("ssh"), base))


def gpu_of(nodes: tuple[Node, ...] | list[Node], i: int) -> str:
    """The GPUs node i's rank uses: its `devices`, else its place among the nodes at its address."""
    return nodes[i].devices or str(local_index([{"ips": [n.address]} for n in nodes], i))


def _check_devices(nodes: list[Node]) -> None:
    """Two NCCL ranks on one GPU fail with `invalid usage` at every start: refuse it here."""
    seen: dict[tuple[str, str], str] = {}
    for i, n in enumerate(nodes):
        for gpu in gpu_of(nodes, i).split(","):
            other = seen.setdefault((n.address, gpu.strip()), n.name)
            if other != n.name:
                raise ConfigError(f"nodes.{n.name}.devices: GPU {gpu.strip()} of {n.address} is {other}'s too; two "
                                  f"ranks on one GPU fail (NCCL invalid usage). Give each node its own, e.g. "
                                  f'devices = "{i}"')


def _ssh(raw, base: Path) -> Ssh:
    if isinstance(raw, dict):
        raw = {k: os.path.expanduser(v) if k in ("known_hosts", "key_file") and isinstance(v, str) else v
               for k, v in raw.items()}
    ssh = table(Ssh, raw, "ssh", base, {"user": '"admin"', "known_hosts": '"~/.ssh/known_hosts"',
                                         "key_file": '"~/.ssh/id_ed25519"'})
    return replace(ssh, known_hosts=str(base / os.path.expanduser(ssh.known_hosts)))


def load(path: str | Path) -> MeshConfig:
    path = Path(path).resolve()
    return parse(read_toml(path, "pass --config with your mesh.toml"), path.parent, path)


def hostfile_for(cfg: MeshConfig) -> dict:
    """The mlx hostfile of the mesh: the provisioned file, or for ring one
    built from the nodes' addresses."""
    if cfg.hostfile is not None:
        try:
            return json.loads(cfg.hostfile.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"hostfile: cannot read {cfg.hostfile} ({e}); run `meshctl provision`")
    return address_hostfile(cfg)


def address_hostfile(cfg: MeshConfig) -> dict:
    """A hostfile built from the nodes' addresses (ring over Ethernet)."""
    return {"backend": cfg.backend, "envs": [],
            "hosts": [{"ssh": n.name, "ips": [n.address], "rdma": []} for n in cfg.nodes]}
