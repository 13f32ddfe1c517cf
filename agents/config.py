"""The agent's own config (TOML) -> a frozen AgentConfig.

The agent runs only the commands its own config lists as profiles; the
controller names a profile and sends parameters. Every mistake names the key,
what was wrong, and an example of right.
"""

from __future__ import annotations

import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agents.stall import StallWindows
from common.secretfile import read_secret
from common.tls import Pair
from common.tomlcheck import ConfigError, loopback, read_toml, split_listen, table

PLACEHOLDERS = {"python", "model", "port", "host", "seed", "generation", "rank", "world", "status_file"}

DEFAULT_PROFILES = {
    "meshd-rank": {
        "command": ["{python}", "-m", "runtime.rank", "--model", "{model}", "--host", "{host}", "--port", "{port}",
                    "--seed", "{seed}", "--meshd-generation", "{generation}", "--status-file", "{status_file}"],
        "args": {"max_tokens": "--max-tokens", "max_tokens_limit": "--max-tokens-limit",
                 "draft_model": "--draft-model", "num_draft_tokens": "--num-draft-tokens",
                 "prefill_step_size": "--prefill-step-size", "model_name": "--model-name",
                 "heartbeat_interval": "--heartbeat-interval", "drain_deadline": "--drain-deadline",
                 "max_context": "--max-context", "model_package": "--model-package", "drafter": "--drafter",
                 "snapshots": "--snapshots", "snapshot_budget_mb": "--snapshot-budget-mb",
                 "snapshot_every": "--snapshot-every", "snapshot_max_age": "--snapshot-max-age",
                 "checkpoint_budget_mb": "--checkpoint-budget-mb", "grammar_cache_mb": "--grammar-cache-mb",
                 "prefill_report_every": "--prefill-report-every"},
        "status_file": True,
    },
    # The transport check `meshctl doctor --canary` runs before a model load.
    "meshd-canary": {
        "command": ["{python}", "-m", "runtime.canary", "--meshd-generation", "{generation}"],
        "args": {"seconds": "--seconds", "largest": "--largest"},
        "status_file": False,
    },
    # Stock mlx_lm.server rejects unknown flags, so the generation marker
    # rides on the interpreter's -X options.
    "mlx-lm-server": {
        "command": ["{python}", "-X", "meshd-generation={generation}", "-m", "mlx_lm.server", "--model", "{model}",
                    "--host", "{host}", "--port", "{port}"],
        "args": {"max_tokens": "--max-tokens", "draft_model": "--draft-model"},
        "status_file": False,
    },
}

DEFAULT_ENV_ALLOWLIST = ("MLX_METAL_FAST_SYNCH", "MLX_RING_VERBOSE", "MLX_JACCL_VERBOSE", "NCCL_DEBUG",
                         "OMP_NUM_THREADS", "HF_HUB_OFFLINE")


@dataclass(frozen=True)
class Profile:
    name: str
    command: tuple[str, ...]
    args: dict[str, str]
    status_file: bool


@dataclass(frozen=True)
class AgentConfig:
    node: str
    host: str
    port: int
    token_file: Path
    state_dir: Path
    profiles: dict[str, Profile]
    allow_reboot: bool = False
    reboot_command: tuple[str, ...] = ("sudo", "-n", "shutdown", "-r", "now")
    env_allowlist: tuple[str, ...] = DEFAULT_ENV_ALLOWLIST
    stall: StallWindows = field(default_factory=StallWindows)
    log_max_bytes: int = 16 << 20
    ibv_hang_seconds: float = 30.0
    grace_seconds: float = 30.0
    metrics_token_file: Path | None = None
    python: str = sys.executable
    wired_limit_mb: int = 0  # applied at start when set (macOS, lost at reboot)
    tls: Pair | None = None  # the API's certificate and key, from the mesh CA
    keep_generations: int = 10  # generation directories (rank logs, status files) kept; older ones pruned
    standby: bool = True  # keep a standby rank (imports and device init done) for the next generation

    def token(self) -> str:
        return read_secret(self.token_file, "token_file")

    def metrics_token(self) -> str | None:
        return read_secret(self.metrics_token_file, "metrics_token_file") if self.metrics_token_file else None


def _need(table: dict, key: str, kind, where: str, example: str):
    if key not in table:
        raise ConfigError(f"{where}{key}: missing; for example {key} = {example}")
    value = table[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}{key}: expected {kind.__name__}, got {value!r}; for example {key} = {example}")
    return value


def _profile(name: str, raw) -> Profile:
    where = f"profiles.{name}."
    if not isinstance(raw, dict):
        raise ConfigError(f"profiles.{name}: expected a table with a command, e.g. [profiles.{name}]")
    command = _need(raw, "command", list, where, '["{python}", "-m", "runtime.rank", "--model", "{model}"]')
    if not command or not all(isinstance(c, str) for c in command):
        raise ConfigError(f"{where}command: must be a non-empty list of strings")
    try:
        used = {f for part in command for _, f, _, _ in string.Formatter().parse(part) if f}
    except ValueError as e:
        raise ConfigError(f"{where}command: {e}; write a literal brace as {{{{ or }}}}")
    unknown = used - PLACEHOLDERS
    if unknown:
        raise ConfigError(f"{where}command: unknown placeholder(s) {sorted(unknown)}; "
                          f"known: {', '.join(sorted(PLACEHOLDERS))}")
    if "generation" not in used:
        raise ConfigError(f'{where}command: must carry the generation marker, e.g. "--meshd-generation", '
                          '"{generation}" (the orphan sweep finds ranks by it)')
    args = raw.get("args", {})
    if not isinstance(args, dict) or not all(isinstance(v, str) and v.startswith("-") for v in args.values()):
        raise ConfigError(f'{where}args: must map parameter names to flags, e.g. {{max_tokens = "--max-tokens"}}')
    status_file = raw.get("status_file", True)
    if not isinstance(status_file, bool):
        raise ConfigError(f"{where}status_file: expected true or false, got {status_file!r}")
    return Profile(name, tuple(command), dict(args), status_file)


@dataclass(frozen=True)
class Options:
    """The agent.toml keys that have defaults, with the types they must have."""

    listen: str = "127.0.0.1:7701"
    state_dir: str = "state"
    disable_default_profiles: bool = False
    allow_reboot: bool = False
    reboot_command: tuple[str, ...] = AgentConfig.reboot_command
    env_allowlist: tuple[str, ...] = DEFAULT_ENV_ALLOWLIST
    log_max_bytes: int = AgentConfig.log_max_bytes
    ibv_hang_seconds: float = AgentConfig.ibv_hang_seconds
    grace_seconds: float = AgentConfig.grace_seconds
    metrics_token_file: Path | None = None
    python: str = sys.executable
    wired_limit_mb: int = 0
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    keep_generations: int = AgentConfig.keep_generations
    standby: bool = AgentConfig.standby


EXAMPLES = {"listen": '"127.0.0.1:7701"', "state_dir": '"/var/lib/meshd-agent"',
            "reboot_command": '["sudo", "-n", "shutdown", "-r", "now"]', "metrics_token_file": '"metrics.token"'}


def parse(raw: dict, base: Path) -> AgentConfig:
    node = _need(raw, "node", str, "", '"studio-1"')
    token_file = base / _need(raw, "token_file", str, "", '"/etc/meshd/agent.token"')
    opts = table(Options, {k: v for k, v in raw.items() if k not in ("node", "token_file", "profiles", "stall")},
                 "", base, EXAMPLES)
    host, port = split_listen("listen", opts.listen)
    if opts.keep_generations < 1:
        raise ConfigError("keep_generations: must be at least 1 (the generation that runs); for example "
                          "keep_generations = 10")
    if (opts.tls_cert_file is None) != (opts.tls_key_file is None):
        raise ConfigError("tls_cert_file, tls_key_file: set both or neither; `meshctl agents install` writes both")
    tls = Pair(opts.tls_cert_file, opts.tls_key_file) if opts.tls_cert_file and opts.tls_key_file else None
    if tls is None and not loopback(host):
        raise ConfigError(f"listen: {opts.listen} is off loopback, where the mesh's token would cross the network "
                          "in clear; set tls_cert_file and tls_key_file (`meshctl agents install` issues them from "
                          'the mesh CA), or listen = "127.0.0.1:7701"')
    if not opts.reboot_command:
        raise ConfigError(f"reboot_command: must not be empty; for example reboot_command = {EXAMPLES['reboot_command']}")
    extra = raw.get("profiles", {})
    if not isinstance(extra, dict):
        raise ConfigError("profiles: must be a table of profiles, e.g. [profiles.my-runtime]")
    profiles_raw = {**({} if opts.disable_default_profiles else DEFAULT_PROFILES), **extra}
    if not profiles_raw:
        raise ConfigError("profiles: no profile is allowed; add one, e.g. [profiles.meshd-rank]")
    profiles = {name: _profile(name, p) for name, p in profiles_raw.items()}
    return AgentConfig(
        node=node, host=host, port=port, token_file=token_file, state_dir=base / opts.state_dir, profiles=profiles,
        allow_reboot=opts.allow_reboot, reboot_command=opts.reboot_command, env_allowlist=opts.env_allowlist,
        stall=table(StallWindows, raw.get("stall"), "stall", base, {}),
        log_max_bytes=opts.log_max_bytes, ibv_hang_seconds=opts.ibv_hang_seconds, grace_seconds=opts.grace_seconds,
        metrics_token_file=opts.metrics_token_file, python=opts.python, wired_limit_mb=opts.wired_limit_mb, tls=tls,
        keep_generations=opts.keep_generations, standby=opts.standby,
    )


def load(path: str | Path) -> AgentConfig:
    path = Path(path)
    return parse(read_toml(path, "pass --config with this node's agent.toml"), path.parent)
