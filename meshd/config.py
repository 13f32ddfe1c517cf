"""mesh.toml -> frozen dataclasses. Every mistake names the key, says what was
wrong and shows an example of right (`meshctl config check`)."""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from urllib.parse import urlparse

from common.hostfile import BACKENDS, local_index
from common.modelref import is_repo_id
from common.states import LadderStep, Profile
from common.tomlcheck import (ConfigError, Problems, listen_host, loopback, port_in_range, read_toml, split_listen,
                              table, wildcard)


PLANNED_RESTARTS = ("drain", "cut")  # what a planned restart does with the streams in flight


@dataclass(frozen=True)
class Recovery:
    """The recovery knobs ([recovery] in mesh.toml)."""

    ladder: tuple[str, ...] = ("restart",)
    backoff_base: float = 1.0
    backoff_max: float = 60.0
    max_failures: int = 5
    window: float = 600.0
    healthy_reset: float = 300.0
    stop_grace: float = 10.0
    drain_grace: float = 30.0
    # A planned restart (`meshctl restart`, [recycle]): "drain" lets the streams in flight finish on the ending
    # generation (up to drain_grace) while new requests wait for the next; "cut" resumes them on the next at once.
    planned_restart: str = "drain"
    start_deadline: float = 900.0
    death_window: float = 2.0  # evidence this soon after an incident belongs to it
    adopt_wait: float = 10.0  # a restarted controller waits this long for every agent to answer


@dataclass(frozen=True)
class Recycle:
    """Planned recycling ([recycle] in mesh.toml): the next generation starts on purpose before a
    long-lived one wears out, once the mesh has had no request in flight for `idle_for` seconds, or
    `idle_deadline` seconds after it was due when it never has. Off unless `after`, `steps` or `window` is set."""

    after: float = 0.0  # seconds since the generation became ready (0: never by age)
    window: str = ""  # "HH:MM-HH:MM", local time: once a day inside it ("": never by the clock)
    idle_for: float = 60.0
    steps: int = 0  # rank 0's lockstep steps, each collectives over the transport (0: never by count)
    idle_deadline: float = 600.0  # a due recycle waits at most this long for idle_for, then recycles under load
    #                               (0: waits for idle however long)

    @property
    def enabled(self) -> bool:
        return self.after > 0 or self.steps > 0 or bool(self.window)

    @property
    def minutes(self) -> tuple[int, int]:
        """The window's start and end in minutes after local midnight (the end may come before the start:
        a window across midnight)."""
        start, _, end = self.window.partition("-")
        return _minute_of_day(start), _minute_of_day(end)


def _minute_of_day(text: str) -> int:
    hours, _, minutes = text.strip().partition(":")
    if not (hours.isdigit() and minutes.isdigit() and int(hours) < 24 and int(minutes) < 60):
        raise ValueError(text)
    return int(hours) * 60 + int(minutes)


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
    profile: str = Profile.MESHD_RANK  # or another of the agents' profiles, by name
    model: str = ""
    seed: int = 0
    host: str = "127.0.0.1"  # rank 0's internal listen address
    port: int = 8100
    ring_port: int = 32323
    env: dict = field(default_factory=dict)
    args: dict = field(default_factory=dict)
    draft_model: str = ""
    model_package: str = ""  # a model overlay: a package each rank imports first, registering its model type
    aliases: tuple[str, ...] = ()  # more names clients may use for the model (a Hugging Face id, say)

    def launch_args(self) -> dict:
        """The profile parameters every rank is started with: `args`, and what other keys imply."""
        args = dict(self.args)
        if self.draft_model:
            args["draft_model"] = self.draft_model
        if self.model_package:
            args["model_package"] = self.model_package
        if self.profile == Profile.MESHD_RANK and is_repo_id(self.model):
            args.setdefault("model_name", self.model)  # the repo id, not its cache snapshot's directory
        return args


def reach(listen: str) -> str:
    """host:port where a client on this machine reaches a listener (a wildcard one at 127.0.0.1)."""
    host, _, port = listen.rpartition(":")
    return f"{'127.0.0.1' if wildcard(host) else host}:{port}"


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
    # meshd-proxy, stopping or handing its socket to its successor, stops accepting and gives the requests
    # it holds this long to finish (the streams in flight end on the old process).
    drain_timeout: float = 300.0
    access_log: bool = False  # log every request; without it only those that did not end 200 (metrics count all)
    # What a client may hold of the endpoint (common.http.ListenerLimits): seconds for a request's headers,
    # seconds for its whole body, connections open at once (0: 1000, or half the descriptors where fewer).
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    max_connections: int = 0

    @property
    def url(self) -> str:
        return f"http://{reach(self.listen)}"

    @property
    def open_off_loopback(self) -> bool:
        return self.api_keys_file is None and not loopback(listen_host(self.listen))


@dataclass(frozen=True)
class Ssh:
    """How meshctl reaches the nodes over SSH (provision, doctor, reboot, agents install)."""

    user: str = ""
    known_hosts: str = "~/.ssh/known_hosts"
    key_file: Path | None = None  # none: ~/.ssh/config's IdentityFile, ssh-agent and the default keys
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    config: str = "~/.ssh/config"  # OpenSSH's client config: Host aliases, HostName, User, Port, IdentityFile,
    #                                ProxyJump, as `ssh` reads them ("": none)


@dataclass(frozen=True)
class Control:
    listen: str = "127.0.0.1:8001"

    @property
    def tls(self) -> bool:
        """Off loopback the control API speaks TLS only, with a certificate from the mesh CA."""
        return not loopback(listen_host(self.listen))

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{reach(self.listen)}"


@dataclass(frozen=True)
class Retention:
    """What the store keeps: the events and generation rows of the newest `generations`, the newest
    `incidents` (each agent prunes its own generation directories: its keep_generations)."""

    generations: int = 100
    incidents: int = 1000


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
    retention: Retention = field(default_factory=Retention)
    recycle: Recycle = field(default_factory=Recycle)

    @property
    def rank0_url(self) -> str:
        """Where the data plane reaches rank 0 (node 0's address when the rank listens on all)."""
        host = self.runtime.host
        return f"http://{self.nodes[0].address if wildcard(host) else host}:{self.runtime.port}"

    @property
    def store_path(self) -> Path:
        return self.state_dir / "meshd.sqlite"

    @property
    def tls_dir(self) -> Path:
        """The mesh CA (ca.pem, ca.key) and the control API's certificate."""
        return self.state_dir / "tls"

    @property
    def ca_file(self) -> Path:
        return self.tls_dir / "ca.pem"

    @property
    def agents_over_tls(self) -> bool:
        return any(n.agent.startswith("https://") for n in self.nodes)

    def client_tls(self):
        """An ssl context that trusts the mesh CA and nothing else (for https agents and a control API off
        loopback); ConfigError when there is no mesh CA yet."""
        if not self.ca_file.exists():
            raise ConfigError(f"no mesh CA at {self.ca_file}: https agents and an off-loopback control API need "
                              "it; `meshctl agents install` creates it, the controller does at its first start, or "
                              "copy the mesh's ca.pem there")
        from common.tls import client_context  # cryptography: only when TLS is in play (meshctl starts fast)

        return client_context(self.ca_file)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


TOP_KEYS = ("name", "backend", "nodes", "runtime", "proxy", "recovery", "control", "state_dir", "hostfile", "ssh",
            "retention", "recycle")
NODE_KEYS = ("name", "agent", "token_file", "address", "ssh", "devices")


def parse(raw: dict, base: Path, path: Path | None = None) -> MeshConfig:
    """The config, or one ConfigError with every mistake in it (each names its key, the problem and a fix)."""
    problems = Problems()
    name = problems.check(_name, raw, default="mesh")
    backend = problems.check(_backend, raw, default="ring")
    for key in sorted(set(raw) - set(TOP_KEYS)):
        problems.found.append(f"{key}: unknown key; mesh.toml takes {', '.join(sorted(TOP_KEYS))}")
    nodes = problems.check(_nodes, raw.get("nodes"), base, backend, default=())
    runtime = problems.check(_runtime, raw.get("runtime"), base)
    proxy = problems.check(_proxy, raw.get("proxy"), base)
    recovery = problems.check(_recovery, raw.get("recovery"), base)
    recycle = problems.check(_recycle, raw.get("recycle"), base)
    if recycle is not None and recycle.enabled and runtime is not None and runtime.profile != Profile.MESHD_RANK:
        problems.found.append(f"recycle: the {runtime.profile} profile's ranks do not report when a request is in "
                              "flight, so no recycle could wait for the mesh to be idle; use profile = "
                              '"meshd-rank", or leave [recycle] out')
    control = problems.check(table, Control, raw.get("control"), "control", base, {"listen": '"127.0.0.1:8001"'})
    if control is not None:
        problems.check(split_listen, "control.listen", control.listen)
    state_dir = problems.check(_path, raw, "state_dir", "state", '"/var/lib/meshd"', default="state")
    hostfile = problems.check(_path, raw, "hostfile", None, '"hostfile.json"')
    ssh = problems.check(_ssh, raw.get("ssh"), base)
    retention = problems.check(table, Retention, raw.get("retention"), "retention", base, {})
    if retention is not None and min(retention.generations, retention.incidents) < 1:
        problems.found.append("retention: generations and incidents must be at least 1; for example "
                              "generations = 100")
    if proxy is not None and control is not None:
        problems.check(_listeners_apart, proxy, control, runtime)
    problems.raise_any()
    if backend in ("jaccl", "jaccl-ring") and not hostfile:
        hostfile = str(Path(state_dir) / "hostfile.json")  # where `meshctl provision` writes it
    return MeshConfig(name, backend, tuple(nodes), runtime, proxy, recovery, control, base / state_dir,
                      base / hostfile if hostfile else None, path, ssh, retention, recycle)


def _name(raw: dict) -> str:
    name = raw.get("name", "mesh")
    if not isinstance(name, str) or not name:
        raise ConfigError(f'name: expected a non-empty string, got {name!r}; for example name = "studio-mesh"')
    return name


def _backend(raw: dict) -> str:
    backend = raw.get("backend", "ring")
    if backend not in BACKENDS:
        raise ConfigError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}; for example backend = \"jaccl\"")
    return backend


def _path(raw: dict, key: str, default: str | None, example: str) -> str | None:
    value = raw.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ConfigError(f"{key}: expected a path, got {value!r}; for example {key} = {example}")
    return value


def _nodes(nodes_raw, base: Path, backend: str) -> list[Node]:
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ConfigError('nodes: at least one [[nodes]] table is needed; for example\n'
                          '  [[nodes]]\n  name = "studio-1"\n  agent = "https://10.0.0.1:7701"\n'
                          '  token_file = "tokens/studio-1"')
    problems = Problems()
    nodes = [n for i, raw in enumerate(nodes_raw) if (n := problems.check(_node, i, raw, base)) is not None]
    names = [n.name for n in nodes]
    for dupe in sorted({x for x in names if names.count(x) > 1}):
        problems.found.append(f"nodes: the name {dupe!r} is used twice; node names must be unique")
    if backend == "nccl" and len(nodes) == len(nodes_raw):
        problems.check(_check_devices, nodes)
    problems.raise_any()
    return nodes


def _node(i: int, n, base: Path) -> Node:
    where = f"nodes[{i}]"
    if not isinstance(n, dict):
        raise ConfigError(f"{where}: expected a table")
    problems = Problems()
    for key in sorted(set(n) - set(NODE_KEYS)):
        problems.found.append(f"{where}.{key}: unknown key; a node takes {', '.join(NODE_KEYS)}")
    for key, example in (("name", '"studio-1"'), ("agent", '"https://10.0.0.1:7701"'),
                         ("token_file", '"tokens/studio-1"')):
        if not isinstance(n.get(key), str) or not n[key]:
            problems.found.append(f"{where}.{key}: missing or not a string; for example {key} = {example}")
    for key in ("address", "ssh", "devices"):
        if not isinstance(n.get(key, ""), str):
            problems.found.append(f'{where}.{key}: expected a string, got {n[key]!r}; for example devices = "1"')
    if isinstance(n.get("agent"), str) and n["agent"]:
        problems.check(_agent_url, where, n["agent"])
    problems.raise_any()
    return Node(n["name"], n["agent"].rstrip("/"), base / n["token_file"], n.get("address", "127.0.0.1"),
                n.get("ssh", ""), n.get("devices", ""))


def _agent_url(where: str, agent: str) -> None:
    if not agent.startswith(("http://", "https://")):
        raise ConfigError(f'{where}.agent: expected a URL, got {agent!r}; for example agent = "https://10.0.0.1:7701"')
    url = urlparse(agent)
    try:
        port = url.port
    except ValueError:
        raise ConfigError(f"{where}.agent: {agent} has a port out of range; use 1-65535, for example :7701")
    if port is not None:
        port_in_range(f"{where}.agent", port)
    if url.scheme == "http" and not loopback(url.hostname):
        raise ConfigError(f"{where}.agent: {agent} is plain HTTP off loopback, where the agent's token "
                          "would cross the network in clear; use https:// (`meshctl agents install` issues "
                          "the node's certificate from the mesh CA)")


def _runtime(raw, base: Path) -> Runtime:
    runtime = table(Runtime, raw, "runtime", base, {"model": '"/Volumes/models/DeepSeek-V4"',
                                                   "profile": '"meshd-rank"'})
    problems = Problems()
    if not runtime.model:
        problems.found.append('runtime.model: missing; the model directory on every node, for example '
                              'model = "/Volumes/models/DeepSeek-V4"')
    problems.check(port_in_range, "runtime.port", runtime.port)
    problems.check(port_in_range, "runtime.ring_port", runtime.ring_port)
    problems.raise_any()
    return runtime


def _proxy(raw, base: Path) -> Proxy:
    proxy = table(Proxy, raw, "proxy", base, {"listen": '"127.0.0.1:8000"'})
    problems = Problems()
    problems.check(split_listen, "proxy.listen", proxy.listen)
    if proxy.open_off_loopback and not proxy.allow_open:
        problems.found.append(f"proxy.listen: {proxy.listen} is off loopback and proxy.api_keys_file is not set, "
                              "so anyone who reaches it may use the mesh; set api_keys_file = \"api-keys\" (one key "
                              "per line), or allow_open = true to serve it open on purpose")
    if proxy.concurrency < 1:
        problems.found.append("proxy.concurrency: must be at least 1")
    if min(proxy.header_timeout, proxy.body_timeout) <= 0:
        problems.found.append("proxy.header_timeout and proxy.body_timeout must be seconds above 0; for example "
                              "header_timeout = 10")
    problems.raise_any()
    return proxy


def _recovery(raw, base: Path) -> Recovery:
    recovery = table(Recovery, raw, "recovery", base, {"ladder": '["restart", "reprovision", "reboot"]'})
    bad_steps = [s for s in recovery.ladder if s not in set(LadderStep)]
    if bad_steps or not recovery.ladder or recovery.ladder[0] != LadderStep.RESTART:
        raise ConfigError('recovery.ladder: must start with "restart" and use only restart, reprovision, reboot; '
                          'for example ladder = ["restart", "reprovision", "reboot"]')
    if recovery.planned_restart not in PLANNED_RESTARTS:
        raise ConfigError(f"recovery.planned_restart: {recovery.planned_restart!r} is neither \"drain\" (the streams "
                          "in flight finish on the ending generation) nor \"cut\" (they resume on the next at once); "
                          'for example planned_restart = "drain"')
    return recovery


def _recycle(raw, base: Path) -> Recycle:
    recycle = table(Recycle, raw, "recycle", base, {"after": "86400.0", "window": '"03:00-04:00"',
                                                     "idle_for": "60.0", "steps": "50000000"})
    if recycle.window:
        try:
            start, end = recycle.minutes
        except ValueError:
            start = end = None
        if start is None or start == end:
            raise ConfigError(f'recycle.window: {recycle.window!r} is not a daily window "HH:MM-HH:MM" (local '
                              'time, 24-hour, start and end apart); for example window = "03:00-04:00"')
    return recycle


def _listeners_apart(proxy: Proxy, control: Control, runtime: Runtime | None) -> None:
    """The controller's two listeners (and rank 0's, when it shares their host) on different ports."""
    ports = {"proxy.listen": proxy.listen.rpartition(":")[2], "control.listen": control.listen.rpartition(":")[2]}
    if runtime is not None and loopback(runtime.host):
        ports["runtime.port"] = str(runtime.port)
    seen: dict[str, str] = {}
    for key, port in ports.items():
        if port in seen:
            raise ConfigError(f"{key}: port {port} is {seen[port]}'s too; give each listener its own port")
        seen[port] = key


def json_schema() -> dict:
    """A JSON Schema of mesh.toml for editors (`meshctl config schema`; taplo and VS Code's Even Better TOML
    read it): every table and key with its type and default; unknown keys are mistakes."""
    def section(cls, required: tuple[str, ...] = ()) -> dict:
        props = {}
        for f in fields(cls):
            default = f.default if f.default is not MISSING else f.default_factory()
            props[f.name] = _schema_of(f.name, default)
        return {"type": "object", "properties": props, "additionalProperties": False,
                **({"required": list(required)} if required else {})}

    node = {"type": "object", "additionalProperties": False, "required": ["name", "agent", "token_file"],
            "properties": {"name": {"type": "string", "minLength": 1},
                           "agent": {"type": "string", "pattern": "^https?://", "examples": ["https://10.0.0.1:7701"]},
                           "token_file": {"type": "string", "minLength": 1}, "address": {"type": "string"},
                           "ssh": {"type": "string"}, "devices": {"type": "string"}}}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "meshd mesh.toml",
            "type": "object", "additionalProperties": False, "required": ["nodes", "runtime"],
            "properties": {"name": {"type": "string", "minLength": 1, "default": "mesh"},
                           "backend": {"enum": list(BACKENDS), "default": "ring"},
                           "nodes": {"type": "array", "minItems": 1, "items": node},
                           "runtime": section(Runtime, ("model",)), "proxy": section(Proxy),
                           "recovery": section(Recovery), "control": section(Control), "ssh": section(Ssh),
                           "retention": section(Retention), "recycle": section(Recycle),
                           "state_dir": {"type": "string", "default": "state"}, "hostfile": {"type": "string"}}}


def _schema_of(name: str, default) -> dict:
    if isinstance(default, bool):
        return {"type": "boolean", "default": default}
    if name in ("port", "ring_port"):
        return {"type": "integer", "minimum": 1, "maximum": 65535, "default": default}
    if isinstance(default, int):
        return {"type": "integer", "minimum": 0, "default": default}
    if isinstance(default, float):
        return {"type": "number", "minimum": 0, "default": default}
    if isinstance(default, tuple):
        return {"type": "array", "items": {"type": "string"}, "default": list(default)}
    if isinstance(default, dict):
        return {"type": "object", "default": default}
    if name == "planned_restart":
        return {"enum": list(PLANNED_RESTARTS), "default": default}
    if name == "listen":
        return {"type": "string", "pattern": r"^.+:[0-9]{1,5}$", "default": default}
    return {"type": "string", **({"default": default} if isinstance(default, str) else {})}


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
                                         "key_file": '"~/.ssh/id_ed25519"', "config": '"~/.ssh/config"'})
    return replace(ssh, known_hosts=str(base / os.path.expanduser(ssh.known_hosts)),
                   config=str(base / os.path.expanduser(ssh.config)) if ssh.config else "")


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
