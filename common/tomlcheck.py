"""TOML in and out for mesh.toml and agent.toml: reading with a message that
names the file, checking a table against a dataclass's defaults (type by type,
no unknown keys, every mistake naming the key and an example of right), and
writing (tomli-w: quoting and escaping done right, in one place)."""

from __future__ import annotations

import ipaddress
import os
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

import tomli_w


class ConfigError(ValueError):
    """One mistake or several (`problems`), each naming the key, what is wrong and the fix."""

    def __init__(self, *problems: str):
        super().__init__("\n".join(problems))
        self.problems = list(problems)


class Problems:
    """Every mistake of a file in one pass: each check runs, and what fails is kept for one ConfigError."""

    def __init__(self):
        self.found: list[str] = []

    def check(self, fn, *args, default=None):
        """fn(*args), or `default` after noting its mistakes."""
        try:
            return fn(*args)
        except ConfigError as e:
            self.found += e.problems
            return default

    def raise_any(self) -> None:
        if self.found:
            raise ConfigError(*self.found)


def port_in_range(key: str, port: int) -> int:
    if not 1 <= port <= 65535:
        raise ConfigError(f"{key}: port {port} is out of range; use 1-65535, for example 8100")
    return port


def split_listen(key: str, value: str) -> tuple[str, int]:
    if not isinstance(value, str) or ":" not in value or not value.rsplit(":", 1)[1].isdigit():
        raise ConfigError(f'{key}: expected "host:port", got {value!r}; for example {key} = "127.0.0.1:8000"')
    host, port = value.rsplit(":", 1)
    return host, port_in_range(key, int(port))


def listen_host(listen: str) -> str:
    """The host of a "host:port" listen address, without an IPv6 address's brackets."""
    return listen.rpartition(":")[0].strip("[]")


def wildcard(host: str) -> bool:
    """Does a server listening on `host` listen on every address of the machine?"""
    return host.strip("[]") in ("0.0.0.0", "::", "")


def loopback(host: str | None) -> bool:
    """Is `host` (an address, bracketed or not, or "localhost") this machine's loopback?"""
    host = (host or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _value(want, value, name: str, where: str, example: str, base: Path):
    """`value` checked against the type of the default `want`, converted where TOML differs."""
    if isinstance(want, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
    elif isinstance(want, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}; for example {name} = {example}")
        if value < 0:
            raise ConfigError(f"{where}: must not be negative, got {value}")
    elif isinstance(want, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected seconds, got {value!r}; for example {name} = {example}")
        if value < 0:
            raise ConfigError(f"{where}: must not be negative, got {value}")
        value = float(value)
    elif isinstance(want, tuple):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings; for example {name} = {example}")
        value = tuple(value)
    elif isinstance(want, dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a table; for example {name} = {example}")
    elif name.endswith("_file"):
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a path; for example {name} = {example}")
        value = base / value if value else None
    elif not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}; for example {name} = {example}")
    return value


def table(cls, raw: Any, key: str, base: Path, examples: dict[str, str]):
    """Check a TOML table against the defaults of dataclass `cls` and build it;
    `key` "" means the top level."""
    if raw is None:
        return cls()
    if not isinstance(raw, dict):
        raise ConfigError(f"[{key}]: expected a table, got {raw!r}")
    known = {f.name: f for f in fields(cls)}
    problems = Problems()
    for name in sorted(set(raw) - set(known)):
        where = f"{key}.{name}" if key else name
        problems.found.append(f"{where}: unknown key; {f'[{key}]' if key else 'the file'} takes {', '.join(known)}")
    defaults = cls()
    values = {name: problems.check(_value, getattr(defaults, name), value, name, f"{key}.{name}" if key else name,
                                   examples.get(name, repr(getattr(defaults, name))), base)
              for name, value in raw.items() if name in known}
    problems.raise_any()
    return cls(**values)


def read_toml(path: Path, fix: str) -> dict:
    """The parsed file, or ConfigError naming the file and `fix`."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}; {fix}")
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}")


def dumps_toml(data: dict) -> str:
    """`data` as TOML (paths as strings, None values left out)."""
    return tomli_w.dumps(_plain(data))


def write_toml(path: Path, data: dict) -> Path:
    path.write_text(dumps_toml(data))
    return path


def _plain(v):
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items() if x is not None}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, os.PathLike):
        return str(v)
    return v
