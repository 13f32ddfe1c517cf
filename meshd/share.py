"""The files meshd ships beside its code: service templates (systemd/,
launchd/), docs, alert rules, the dashboard and the API descriptions. In a
checkout they sit at the top of the tree; a wheel carries the same files as
package data under meshd/share/ (pyproject.toml maps them), so an installed
meshd renders its units and points at its docs without a checkout."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent


def in_checkout() -> bool:
    return (CHECKOUT / "pyproject.toml").exists()


def shared(kind: str) -> Path:
    """The directory of `kind` (systemd, launchd, docs, prometheus, grafana, openapi)."""
    return CHECKOUT / kind if in_checkout() else HERE / "share" / kind
