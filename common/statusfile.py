"""The rank's status file: JSON written atomically (write, then rename) by the
rank, read by its agent.

`progress_at` moves on every load step, prefill chunk, decode step and idle
liveness exchange, so a rank blocked in a collective stops moving it while its
heartbeat keeps `updated_at` fresh.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from common.states import RankState


@dataclass
class RankStatus:
    generation: int
    rank: int
    world: int
    pid: int
    state: RankState = RankState.LOADING
    load_done: int = 0
    load_total: int = 0
    step: int = 0
    tokens: int = 0
    requests_in_flight: int = 0
    prompt_tokens_in_flight: int = 0
    mlx_active_bytes: int = 0  # MLX's allocator: memory in arrays, the most it held, its cache
    mlx_peak_bytes: int = 0
    mlx_cache_bytes: int = 0
    drafter: str = ""  # what drafts: "mtp" (the model's own head), "dspark" (its stages), "draft_model"; "": none
    draft_proposed: int = 0
    draft_accepted: int = 0
    draft_fallbacks: int = 0  # requests the drafter refused (a shape), decoded plainly instead
    draft_refeeds: int = 0  # verifies whose kept places went through the target again (caches nothing else cut back)
    draft_batched_steps: int = 0  # verify steps that drafted two rows or more at once (the drafting engine)
    kernels_hidden: int = 0  # the model's kernels hidden at load: they refuse this rank's share of the heads
    tape_hits: int = 0  # prompts the token tape served: a cache reused exactly
    tape_hit_tokens: int = 0  # the tokens it served, not prefilled: a resumed answer's own among them
    tape_misses: int = 0  # prompts no tape shared a prefix with
    tape_not_reusable: int = 0  # prompts that shared one with a tape whose cache could not be cut back to it
    tape_checkpoint_hits: int = 0  # tape hits a checkpoint served (a cache a trim cannot cut back, cut back to it)
    tape_checkpoints: int = 0  # the checkpoints the tape holds (runtime/prefix/checkpoints.py)
    tape_checkpoint_bytes: int = 0  # the memory they hold, within --checkpoint-budget-mb
    tape_taps_bytes: int = 0  # the memory the tapes' kept taps hold (DSpark's stages' context for the next turn)
    snapshots_written: int = 0  # prefix snapshot segments this rank wrote (runtime/prefix/snapshot.py)
    snapshots_restored: int = 0  # tapes restored from them
    snapshots_skipped: dict = field(default_factory=dict)  # by reason: missing, truncated, corrupt, foreign, ...
    snapshot_bytes: int = 0  # what its snapshot directory holds
    snapshot_checkpoint_bytes: int = 0  # of those, the tapes' checkpoints (runtime/prefix/checkpoints.py)
    snapshots_pending: int = 0  # segments staged or queued for the writer, not yet on the disk
    snapshot_pending_bytes: int = 0  # their bytes
    snapshot_restores_pending: int = 0  # tapes of the last generation still being restored while it serves
    snapshot_writer_error: str = ""  # why the snapshot writer stopped, if it did (nothing is written then)
    prefills: list = field(default_factory=list)  # the long prefills going on (common/prefills.py's Progress.shown:
    # rid shortened, done, total, rate in tokens/s, eta in seconds to the first token; rate and eta null at first)
    weights_fingerprint: str = ""  # of the weights it loaded (common/fingerprint.py); "" when they changed meanwhile
    progress_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    started_at: float = field(default_factory=time.time)

    @classmethod
    def from_dict(cls, data: dict) -> "RankStatus":
        """A status file as a rank of any version wrote it: fields this version does not know are left
        out, fields it lacks take their defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        return cls(**{**values, "state": RankState(values.get("state", RankState.LOADING))})


def write_atomic(path: Path, data) -> None:
    """`data` as JSON at `path`; a reader sees the old file or the new one, never half of either."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_status(path: str | Path) -> RankStatus | None:
    """The last status written, or None when there is none (yet) or it is unreadable (half a file from
    another writer, no rank's identity in it, a state this version does not know)."""
    try:
        return RankStatus.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError):
        return None
