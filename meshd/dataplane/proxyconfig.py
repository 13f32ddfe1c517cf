"""What meshd-proxy fronts: one mesh.toml (as always), or a proxy config listing several meshes, each a
mesh.toml with its own controller. Every mistake names its key and the fix, as mesh.toml's do."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agents.node import model_fingerprint
from common.modelref import ModelNotFound, resolve, served_name
from common.tomlcheck import ConfigError, Problems, read_toml
from meshd.config import MeshConfig, Proxy, _proxy, load, parse

TOP_KEYS = ("name", "fallback", "affinity_entries", "proxy", "meshes")
MESH_KEYS = ("name", "config")


@dataclass(frozen=True)
class Mesh:
    name: str  # the mesh's name at the proxy (its metrics, /v1/meshes); its mesh.toml's name by default
    cfg: MeshConfig


@dataclass(frozen=True)
class Front:
    name: str
    proxy: Proxy  # the endpoint's own settings: a proxy config's [proxy], else the one mesh's
    meshes: tuple[Mesh, ...]
    fallback: str = ""  # opt-in: the model that answers while no mesh of the requested one serves
    affinity_entries: int = 4096  # conversation prefixes remembered, for a follow-up to find its mesh
    path: Path | None = None

    @property
    def several(self) -> bool:
        return len(self.meshes) > 1


def single(cfg: MeshConfig) -> Front:
    """A mesh.toml's proxy: its one mesh, its [proxy]."""
    return Front(cfg.name, cfg.proxy, (Mesh(cfg.name, cfg),), path=cfg.path)


def is_proxy_config(raw: dict) -> bool:
    return "meshes" in raw


def load_front(path: str | Path) -> Front:
    """A proxy config (it has [[meshes]]) or a mesh.toml, or one ConfigError with every mistake in it."""
    path = Path(path).resolve()
    raw = read_toml(path, "pass --config with your proxy config or mesh.toml")
    if not is_proxy_config(raw):
        return single(parse(raw, path.parent, path))
    base = path.parent
    problems = Problems()
    for key in sorted(set(raw) - set(TOP_KEYS)):
        problems.found.append(f"{key}: unknown key; a proxy config takes {', '.join(TOP_KEYS)}")
    name = raw.get("name", "proxy")
    if not isinstance(name, str) or not name:
        problems.found.append(f'name: expected a non-empty string, got {name!r}; for example name = "studio"')
    proxy = problems.check(_proxy, raw.get("proxy"), base)
    meshes = problems.check(_meshes, raw["meshes"], base, default=())
    fallback = raw.get("fallback", "")
    if not isinstance(fallback, str):
        problems.found.append(f'fallback: expected a model name, got {fallback!r}; for example fallback = "small"')
    elif fallback and meshes and not any(fallback in served_names(m.cfg) for m in meshes):
        problems.found.append(f"fallback: no mesh serves {fallback!r}; name a model one of the meshes serves "
                              f"({', '.join(sorted({n for m in meshes for n in served_names(m.cfg)}))}), or leave "
                              "fallback out")
    entries = raw.get("affinity_entries", 4096)
    if type(entries) is not int or entries < 1:
        problems.found.append(f"affinity_entries: expected a whole number of at least 1, got {entries!r}; for "
                              "example affinity_entries = 4096")
    problems.raise_any()
    return Front(name, proxy, tuple(meshes), fallback, entries, path)


def _meshes(raw, base: Path) -> list[Mesh]:
    example = '\n  [[meshes]]\n  name = "left"\n  config = "left/mesh.toml"'
    if not isinstance(raw, list) or not raw or not all(isinstance(m, dict) for m in raw):
        raise ConfigError(f"meshes: at least one [[meshes]] table is needed; for example{example}")
    problems = Problems()
    meshes = [m for i, entry in enumerate(raw) if (m := problems.check(_mesh, i, entry, base)) is not None]
    names = [m.name for m in meshes]
    for dupe in sorted({n for n in names if names.count(n) > 1}):
        problems.found.append(f"meshes: the name {dupe!r} is used twice; give each [[meshes]] its own name")
    problems.raise_any()
    return meshes


def _mesh(i: int, entry: dict, base: Path) -> Mesh:
    where = f"meshes[{i}]"
    if unknown := sorted(set(entry) - set(MESH_KEYS)):
        raise ConfigError(f"{where}.{unknown[0]}: unknown key; a mesh takes {', '.join(MESH_KEYS)}")
    config = entry.get("config")
    if not isinstance(config, str) or not config:
        raise ConfigError(f'{where}.config: missing or not a string; the mesh\'s mesh.toml, for example '
                          'config = "left/mesh.toml"')
    try:
        cfg = load(base / config)
    except ConfigError as e:
        raise ConfigError(f"{where}.config ({base / config}): {e}") from None
    name = entry.get("name", cfg.name)
    if not isinstance(name, str) or not name:
        raise ConfigError(f'{where}.name: expected a non-empty string, got {name!r}; for example name = "left"')
    return Mesh(name, cfg)


def listed_names(cfg: MeshConfig) -> tuple[str, ...]:
    """What GET /v1/models lists for a mesh's model: its served name, then its aliases; never its path (every
    client would learn the server's directories)."""
    name = served_name(cfg.runtime.model, cfg.runtime.args.get("model_name"))
    return tuple(dict.fromkeys((name, *cfg.runtime.aliases)))


def served_names(cfg: MeshConfig) -> tuple[str, ...]:
    """What clients may call a mesh's model: the listed names, then its path and directory name (what
    mlx_lm.server's clients send; accepted, never listed)."""
    return tuple(dict.fromkeys((*listed_names(cfg), cfg.runtime.model, Path(cfg.runtime.model).name)))


def weights_fingerprint(cfg: MeshConfig) -> str:
    """The fingerprint of the mesh's weights as `meshctl doctor` compares them across nodes, read where
    the proxy runs; "" where the model is not there (the mesh is then nobody's twin)."""
    try:
        return model_fingerprint(str(resolve(cfg.runtime.model))).get("fingerprint", "")
    except ModelNotFound:
        return ""


def check_twins(front: Front) -> None:
    """Meshes that give their models one name serve the same weights: else a stream could not resume on
    the other, and a client could not tell which it got. ConfigError naming both and the fix."""
    seen = [(m.name, set(served_names(m.cfg)), weights_fingerprint(m.cfg)) for m in front.meshes]
    for name, names, fingerprint in seen:
        for other, others, theirs in seen:
            shared = sorted(names & others)
            if name < other and shared and fingerprint and theirs and fingerprint != theirs:
                raise ConfigError(f"meshes.{other}: it and {name} both serve {shared[0]!r} with different weights "
                                  f"(fingerprints {theirs} and {fingerprint}); give one of them another "
                                  "runtime.args.model_name, or the same model")
