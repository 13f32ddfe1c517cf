"""A rank's launch, built before anything is spawned (TorchElastic's `_start_workers` shape): from the
start request and the agent's config, the command line, environment, working directory, log and status
files and the files the environment points to. Pure but for the model's resolution, which the caller
passes in, and a read of its checkpoint's headers (common/checkpoint.py: a checkpoint that will not load is
refused, named, before any rank loads it); every refusal (`BadSpec`) comes before the supervisor writes to
the disk."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from agents import ringwait
from agents.config import AgentConfig, Profile
from agents.standby import early_env
from common.checkpoint import survey
from common.hostfile import MLX_BACKEND, HostfileError, launch_env
from common.modelref import ModelNotFound
from common.protocol import RankSpec


class BadSpec(ValueError):
    """A start request this agent cannot run (HTTP 400); names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a start does to the node, spawn aside."""

    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: Path  # the rank's directory, gen-G/rank-r under the state directory
    log_path: Path
    status_path: Path  # removed before the spawn: a previous run's file says nothing of this one
    files: dict[Path, str]  # written before the spawn: the files the environment points to (mlx's hostfiles)
    early: dict[str, str]  # what of `env` a standby must have been started with to take this rank
    watch_status: bool  # the profile's rank writes the status file


def rank_dir(state_dir: Path, generation: int, rank: int) -> Path:
    return state_dir / f"gen-{generation}" / f"rank-{rank}"


def argv(profile: Profile, spec: RankSpec, python: str, model: Path, status_file: Path) -> tuple[str, ...]:
    """The profile's command filled in, then the request's `args` as the profile names them."""
    values = {"python": python, "model": model, "port": spec.port, "host": spec.host, "seed": spec.seed,
              "generation": spec.generation, "rank": spec.rank, "world": spec.world, "status_file": status_file}
    out = [part.format(**values) for part in profile.command]
    for name, value in spec.args.items():
        if name not in profile.args:
            raise BadSpec(f"args.{name}", f"profile {profile.name!r} takes no parameter {name!r}; "
                                          f"it takes: {', '.join(sorted(profile.args)) or 'none'}")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise BadSpec(f"args.{name}", f"args.{name} must be a string or a number")
        out += [profile.args[name], str(value)]
    return tuple(out)


def launch_plan(spec: RankSpec, config: AgentConfig, environ: dict[str, str],
                resolve: Callable[[str, str], Path], ring_wait: Path | None = None,
                mesh: str | None = None) -> LaunchPlan:
    """How this agent starts `spec`'s rank, its environment on top of `environ` (the agent's own);
    `resolve(model, node)` finds the model's directory (ModelNotFound when it cannot); `ring_wait`: the built
    agents/ringwait.c, preloaded into a ring rank that shares its host; `mesh`: the name of the mesh whose
    controller asked (the rank's title names it). BadSpec naming the
    field when the request asks for what this agent does not allow or cannot run."""
    profile = config.profiles.get(spec.profile)
    if profile is None:
        raise BadSpec("profile", f"profile {spec.profile!r} is not allowed on this node; "
                                 f"allowed: {', '.join(sorted(config.profiles))}")
    bad_env = sorted(set(spec.env) - set(config.env_allowlist))
    if bad_env:
        raise BadSpec("env", f"env {bad_env} not in this agent's env_allowlist ({', '.join(config.env_allowlist)})")
    try:
        model = resolve(spec.model, config.node)
    except ModelNotFound as e:
        raise BadSpec("model", str(e))
    if refusal := survey(model).refusal():
        raise BadSpec("model", f"{spec.model}: {refusal}")
    try:
        launch = launch_env(spec.hostfile, spec.rank, starting_port=spec.ring_port, nccl_port=spec.ring_port)
    except HostfileError as e:
        raise BadSpec("hostfile", str(e))
    if len(spec.hostfile["hosts"]) != spec.world:
        raise BadSpec("world", f"world is {spec.world} but the hostfile lists {len(spec.hostfile['hosts'])} hosts")
    cwd = rank_dir(config.state_dir, spec.generation, spec.rank)
    status_path = cwd / "status.json"
    env = {**environ, **launch.env, **{k: str(v) for k, v in spec.env.items()}}
    files = {}
    for var, content in launch.files.items():
        files[cwd / f"{var.lower()}.json"] = content + "\n"
        env[var] = str(cwd / f"{var.lower()}.json")
    if spec.devices and "CUDA_VISIBLE_DEVICES" in launch.env:
        env["CUDA_VISIBLE_DEVICES"] = spec.devices
    if preload := ringwait.preload(spec.hostfile, spec.rank, env.get("LD_PRELOAD"), ring_wait):
        env["LD_PRELOAD"] = preload
    env["MESHD_BACKEND"] = MLX_BACKEND[spec.hostfile.get("backend", "ring")]
    env["MESHD_GENERATION"] = str(spec.generation)
    env["MESHD_NODE"] = config.node
    env.pop("MESHD_MESH", None)
    if mesh:
        env["MESHD_MESH"] = mesh
    env["MESHD_AGENT"] = str(config.state_dir.resolve())
    env["MESHD_STATUS_FILE"] = str(status_path)
    env.pop("MESHD_RANK_SECRET", None)
    if spec.secret:
        env["MESHD_RANK_SECRET"] = spec.secret
    return LaunchPlan(argv(profile, spec, config.python, model, status_path), env, cwd, cwd / "rank.log",
                      status_path, files, early_env(env, config.env_allowlist), profile.status_file)
