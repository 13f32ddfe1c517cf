"""What restoring and prefilling cost on this rank, kept beside its snapshots: the prefix store's rates,
which restores weigh against prefilling (runtime/restore.py `worth_waiting`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from common.statusfile import write_atomic


FIGURES = ("read_bps", "build_bps", "prefill_tps")


class Rates:
    """What restoring and prefilling cost on this rank (bytes read a second, bytes of a restored cache built a
    second of the loop's time, tokens prefilled a second),
    kept beside its snapshots for the next generation, which has measured nothing yet when it starts."""

    def __init__(self, path: Path | None):
        self.path = path
        self._saving = threading.Lock()  # held while a thread writes the file
        try:
            saved = json.loads(path.read_text()) if path else {}
        except (OSError, ValueError):
            saved = {}
        saved = saved if isinstance(saved, dict) else {}
        self.read_bps, self.build_bps, self.prefill_tps = (float(saved.get(name, 0.0)) for name in FIGURES)

    def note(self, **rates: float) -> None:
        """New figures, kept on disk by a thread of their own: a small write on a disk busy with snapshots can
        wait behind their flushes, and the loop must not."""
        for name, value in rates.items():
            setattr(self, name, value)
        if self.path is not None and self._saving.acquire(blocking=False):
            threading.Thread(target=self._save, name="rates", daemon=True).start()

    def _save(self) -> None:
        try:
            write_atomic(self.path, {name: getattr(self, name) for name in FIGURES})
        except OSError:
            pass  # the next generation measures afresh
        finally:
            self._saving.release()
