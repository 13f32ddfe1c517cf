"""What `[runtime] model` names: a directory (the same path on every node) or a
Hugging Face repo id (`mlx-community/Qwen3-8B-4bit`), which each node finds in
its own Hugging Face cache, offline. `meshctl model pull` puts it there."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


class ModelNotFound(Exception):
    """Names the model, where it was looked for and the fix."""


def is_repo_id(model: str) -> bool:
    return not model.startswith(("/", "~", ".")) and bool(REPO_ID.match(model))


def served_name(model: str, model_name: str | None = None) -> str:
    """The name clients use: model_name when given, else the repo id, else the directory's name."""
    return model_name or (model if is_repo_id(model) else Path(model).name)


def resolve(model: str, node: str = "this node") -> Path:
    """The directory `model` is on this machine: the path itself, or the repo's snapshot in the local
    Hugging Face cache (never downloaded here)."""
    path = Path(model).expanduser()
    if path.exists() or not is_repo_id(model):
        if not path.exists():
            raise ModelNotFound(f"model path {model!r} does not exist on node {node}")
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelNotFound(f"{model} is not in node {node}'s Hugging Face cache ({constants.HF_HUB_CACHE}); "
                            f"`meshctl model pull {model}` downloads it on one node and copies it to the others")
