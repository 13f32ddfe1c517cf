"""What restoring and prefilling cost on this rank, kept beside its snapshots: the prefix store's rates,
which restores weigh against prefilling (runtime/restore.py `worth_waiting`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from common.statusfile import write_atomic


class Rates:
    """What restoring and prefilling cost on this rank (bytes read a second, tokens prefilled a second),
    kept beside its snapshots for the next generation, which has measured nothing yet when it starts."""

    def __init__(self, path: Path | None):
        self.path = path
        self._saving = threading.Lock()  # held while a thread writes the file
        try:
            saved = json.loads(path.read_text()) if path else {}
        except (OSError, ValueError):
            saved = {}
        self.read_bps = float(saved.get("read_bps", 0.0)) if isinstance(saved, dict) else 0.0
        self.prefill_tps = float(saved.get("prefill_tps", 0.0)) if isinstance(saved, dict) else 0.0

    def note(self, **rates: float) -> None:
        """New figures, kept on disk by a thread of their own: a small write on a disk busy with snapshots can
        wait behind their flushes, and the loop must not."""
        for name, value in rates.items():
            setattr(self, name, value)
        if self.path is not None and self._saving.acquire(blocking=False):
            threading.Thread(target=self._save, name="rates", daemon=True).start()

    def _save(self) -> None:
        try:
            write_atomic(self.path, {"read_bps": self.read_bps, "prefill_tps": self.prefill_tps})
        except OSError:
            pass  # the next generation measures afresh
        finally:
            self._saving.release()
