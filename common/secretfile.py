"""Private files (tokens, keys, logs): created with their final mode (0600)
in one step, never world-readable for an instant; a token others can read is
refused."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from common.tomlcheck import ConfigError


def ensure_secret(path: Path) -> str:
    """The token in `path`, created (random, mode 0600) when the file does not exist yet."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    token = secrets.token_hex(24)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def write_private(path: Path, data: bytes) -> None:
    """`data` in a file created 0600 in one step (an older file is replaced, not reused with its mode)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(data)


def open_appending(path: Path, mode: str = "ab", **options):
    """A file opened for appending, created 0600 when it is new: a log only its user reads."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), mode, **options)


def derive(key: str, purpose: str) -> str:
    """A secret for `purpose` that only holders of `key` can compute, and no other purpose's."""
    return hmac.new(key.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def read_secret(path: Path, key: str) -> str:
    """The token in `path`, or ConfigError naming `key` and the fix."""
    try:
        if path.stat().st_mode & 0o077:
            raise ConfigError(f"{key}: {path} is readable by other users; run `chmod 600 {path}`")
        value = path.read_text().strip()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({e.strerror}); create it with a random token, "
                          f"e.g. `python -c 'import secrets; print(secrets.token_hex(24))' > {path}`")
    if len(value) < 16:
        raise ConfigError(f"{key}: the token in {path} is shorter than 16 characters; use a random one")
    return value
