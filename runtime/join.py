"""How a rank joins its mesh: mx.distributed.init on the backend the agent names."""

from __future__ import annotations

import os

import mlx.core as mx

from common.hostfile import DISTRIBUTED_ENV, distributed_backend


def join_mesh(backend: str = "any") -> mx.distributed.Group:
    """This process's group. Strict when the launch environment names peers (a missing one is then an
    error, never a silent mesh of one); without them (a mesh of one, or a rank run by hand) the one-rank
    group, whatever the backend."""
    return mx.distributed.init(strict=any(k in os.environ for k in DISTRIBUTED_ENV),
                               backend=distributed_backend(backend))
