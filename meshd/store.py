"""SQLite in the state directory: generations, events, incidents, the audit
trail of control actions (who, what, when), and the few values a restarted
controller needs (what the operator asked for, the last
generation, each agent's last event sequence number).

A write that fails (a full disk, a quota) never raises into the controller:
it waits, in order, and is written before the next write or at `retry()`;
`failing` says why until then. The WAL is checkpointed early and truncated,
so it stays small on a small disk. Each controller records the epoch it took
(`take_epoch`, meshd/epochs.py); a write by an older one is refused (its `Fence`
is told), so a controller that was stopped and resumed after another took over
records nothing."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import structlog

from common.protocol import Ballot
from common.protocol import EPOCH_MAX
from meshd.epochs import Fence, stored_epoch

log = structlog.get_logger("meshd.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS generations (
    generation INTEGER PRIMARY KEY, started_at REAL, ready_at REAL, ended_at REAL, end_reason TEXT);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL, received_at REAL, node TEXT, seq INTEGER, kind TEXT,
    generation INTEGER, rank INTEGER, data TEXT);
CREATE TABLE IF NOT EXISTS incidents (
    id INTEGER PRIMARY KEY AUTOINCREMENT, opened_at REAL, cause TEXT, node TEXT, rank INTEGER,
    generation INTEGER, detail TEXT, steps TEXT, serving_back_at REAL);
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL, user TEXT, remote TEXT, action TEXT, outcome TEXT);
"""
AUDIT_KEEP = 10_000  # newest accepted actions kept
REFUSALS_KEEP = 1_000  # newest rows of refused calls kept, apart: refusals never evict an accepted action
REFUSED = "refused%"  # how a refusal's outcome begins
WAL_PAGES = 100  # a checkpoint once the WAL holds this many pages (SQLite's default, 1000, is 4 MB)
WAL_LIMIT = 1 << 20  # bytes the WAL is cut back to after a checkpoint
PENDING_KEEP = 10_000  # writes kept while the store fails; past it the oldest is dropped
EPOCH = "controller_epoch"  # the kv key of the newest controller's epoch
# Columns added since the first release: a store made before them gets them on open.
ADDED_COLUMNS = {"incidents": (("consequences", "TEXT"), ("timeline", "TEXT"), ("migrated", "INTEGER"))}
INCIDENT_COLUMNS = ("opened_at", "cause", "node", "rank", "generation", "detail", "steps", "consequences", "timeline",
                    "migrated")


def read_value(path: Path, key: str):
    """A value of the store at `path`, read without writing to it (another process owns it); None when
    there is no store or no such value."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
    except sqlite3.Error:
        return None
    return json.loads(row[0]) if row else None


def _connect(path: Path, exclusive: bool = False) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        if exclusive:
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
        db.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error:
        db.close()
        raise
    return db


class Superseded(Exception):
    pass


@dataclass(frozen=True)
class Write:
    """Statements written together; `key`: the kv value it sets (a newer write of the key replaces it)."""

    statements: tuple[tuple[str, tuple], ...]
    key: str | None = None
    value: object = None


class Store:
    def __init__(self, path: Path, on_error: Callable[[str], None] = lambda message: None):
        """`on_error(message)` is told of every write that failed (for /metrics)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = _connect(path)
        except sqlite3.OperationalError:  # no room for the WAL's shared-memory file: its index in this process
            self.db = _connect(path, exclusive=True)  # (meshctl and the proxy read the store once this one exits)
        self.db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
        self.db.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
        self.db.executescript(SCHEMA)
        for table, columns in ADDED_COLUMNS.items():
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns:
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        self.on_error = on_error
        self.pending: list[Write] = []  # oldest first
        self.failing: str | None = None  # why the last write failed, until one succeeds
        self.failing_since: float | None = None
        self.dropped = 0  # writes given up: PENDING_KEEP exceeded, or one SQLite can never write
        self.fence: Fence | None = None

    def last_epoch(self) -> int:
        """The epoch the newest controller of this store took (0: none yet, or a corrupt one, logged and
        ignored: `epochs.stored_epoch`)."""
        last = stored_epoch(self.get(EPOCH))
        if isinstance(last, str):
            log.error("store epoch ignored", reason=last)
            return 0
        return last

    def take_epoch(self, ballot: Ballot, mesh: str) -> Fence:
        """This controller's ballot of `mesh` (its epoch above the store's last and the agents'), recorded: every
        older controller's writes are refused from now on. Called while holding the state directory's lock. An
        epoch out of range is never stored (ValueError)."""
        if not 0 < ballot.epoch <= EPOCH_MAX:
            raise ValueError(f"epoch {ballot.epoch} is not one a controller takes (1 to {EPOCH_MAX})")
        self.fence = Fence(ballot, mesh)
        self.put(EPOCH, ballot.epoch)
        return self.fence

    # --- writes ------------------------------------------------------------------
    def _write(self, *statements: tuple[str, tuple], key: str | None = None, value=None) -> None:
        if key is not None:
            self.pending = [w for w in self.pending if w.key != key]
        self.pending.append(Write(statements, key, value))
        if len(self.pending) > PENDING_KEEP:
            self.pending.pop(0)
            self.dropped += 1
        self.retry()

    def retry(self) -> bool:
        """Write what waits, oldest first; False while the store still fails (`failing` says why)."""
        while self.pending:
            try:
                self._apply(self.pending[0].statements)
            except sqlite3.OperationalError as e:  # full, quota, I/O, locked: it may succeed later
                if self.failing is None:
                    self.failing_since = time.time()
                    log.error("store write failed; the controller acts on and writes it later", error=str(e))
                self.failing = str(e)
                self.on_error(str(e))
                return False
            except Superseded as e:
                self.pending.clear()
                self.fence.supersede(Ballot(e.args[0]), "the store")
                return False
            except sqlite3.Error as e:  # this write can never succeed: the ones behind it must not wait on it
                self.dropped += 1
                self.on_error(str(e))
                log.error("store write dropped", error=str(e), statement=self.pending[0].statements[0][0])
            self.pending.pop(0)
        if self.failing is not None:
            log.info("store writes again", failed_for=round(time.time() - self.failing_since, 1))
            self.failing = self.failing_since = None
            self.checkpoint()
        return True

    def _apply(self, statements: tuple[tuple[str, tuple], ...]) -> None:
        """One transaction: the epoch checked, then the statements."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            if self.fence is not None:
                row = self.db.execute("SELECT value FROM kv WHERE key = ?", (EPOCH,)).fetchone()
                newest = stored_epoch(json.loads(row[0])) if row else 0
                if isinstance(newest, int) and newest > self.fence.epoch:
                    raise Superseded(newest)
            for sql, params in statements:
                self.db.execute(sql, params)
            self.db.execute("COMMIT")
        except (sqlite3.Error, Superseded):
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            raise

    def checkpoint(self) -> None:
        """Everything in the WAL into the database, and the WAL cut to nothing (fails quietly when the disk
        has no room for it: it is tried again after the next failure heals)."""
        with contextlib.suppress(sqlite3.Error):
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    # --- values ------------------------------------------------------------------
    def get(self, key: str, default=None):
        waiting = next((w for w in reversed(self.pending) if w.key == key), None)
        if waiting is not None:
            return waiting.value
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put(self, key: str, value) -> None:
        self._write(("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                     "excluded.value", (key, json.dumps(value))), key=key, value=json.loads(json.dumps(value)))

    def record_event(self, record: dict) -> None:
        self._write(("INSERT INTO events (at, received_at, node, seq, kind, generation, rank, data) "
                     "VALUES (?,?,?,?,?,?,?,?)",
                     (record.get("at"), time.time(), record.get("node"), record.get("seq"), record.get("kind"),
                      record.get("generation"), record.get("rank"), json.dumps(record))))

    def note_generation(self, generation: int, what: str, at: float, detail: str = "") -> None:
        if what == "started":
            self._write(("INSERT OR REPLACE INTO generations (generation, started_at) VALUES (?, ?)", (generation, at)))
        elif what == "ready":
            self._write(("UPDATE generations SET ready_at = ? WHERE generation = ?", (at, generation)))
        else:
            self._write(("UPDATE generations SET ended_at = ?, end_reason = ? WHERE generation = ? "
                         "AND ended_at IS NULL", (at, detail, generation)))

    def open_incident(self, incident) -> None:
        self._write((f"INSERT INTO incidents ({', '.join(INCIDENT_COLUMNS)}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                     self._incident_values(incident)))

    def update_incident(self, incident, serving_back_at: float | None = None) -> None:
        """Everything an incident may learn after it opened: its cause (a peer's report that came first
        can be taken over), consequences, steps, timeline, and when serving came back."""
        assignments = ", ".join(f"{c} = ?" for c in INCIDENT_COLUMNS[1:])
        values = self._incident_values(incident)[1:]
        if serving_back_at is not None:
            assignments += ", serving_back_at = ?"
            values += (serving_back_at,)
        self._write((f"UPDATE incidents SET {assignments} WHERE opened_at = ?", values + (incident.opened_at,)))

    @staticmethod
    def _incident_values(i) -> tuple:
        return (i.opened_at, i.cause, i.node, i.rank, i.generation, i.detail, json.dumps(list(i.steps)),
                json.dumps(list(i.consequences)), json.dumps([[step, at] for step, at in i.timeline]), i.migrated)

    def open_incident_row(self) -> dict | None:
        """The newest incident still waiting to serve again (a restarted controller carries it on)."""
        row = self.db.execute(f"SELECT {', '.join(INCIDENT_COLUMNS)} FROM incidents "
                              "WHERE serving_back_at IS NULL ORDER BY id DESC LIMIT 1").fetchone()
        return self._incident_dict(row) if row else None

    @staticmethod
    def _incident_dict(row) -> dict:
        d = dict(zip(INCIDENT_COLUMNS, row))
        d["steps"] = tuple(json.loads(d["steps"] or "[]"))
        d["consequences"] = tuple(json.loads(d["consequences"] or "[]"))
        d["timeline"] = tuple((step, at) for step, at in json.loads(d["timeline"] or "[]"))
        d["migrated"] = d["migrated"] or 0
        return d

    def incidents(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute(f"SELECT {', '.join(INCIDENT_COLUMNS)}, serving_back_at FROM incidents "
                               "ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        out = []
        for r in rows:
            d = self._incident_dict(r[:-1])
            back = r[-1]
            out.append({**d, "steps": list(d["steps"]), "consequences": list(d["consequences"]),
                        "timeline": [{"step": step, "at": at, "after": round(at - d["opened_at"], 3)}
                                     for step, at in d["timeline"]],
                        "serving_back_at": back, "recovery_seconds": (back - d["opened_at"]) if back else None})
        return out

    def prune(self, generations: int, incidents: int) -> None:
        """Keep the events and generation rows of the newest `generations`, and the newest `incidents`."""
        oldest = "(SELECT generation FROM generations ORDER BY generation DESC LIMIT 1 OFFSET ?)"
        self._write((f"DELETE FROM events WHERE generation < {oldest}", (generations - 1,)),
                    (f"DELETE FROM generations WHERE generation < {oldest}", (generations - 1,)),
                    ("DELETE FROM incidents WHERE id NOT IN (SELECT id FROM incidents ORDER BY id DESC LIMIT ?)",
                     (incidents,)))

    def record_audit(self, user: str, remote: str, action: str, outcome: str) -> None:
        """A row of the audit trail; refusals (an outcome that begins "refused") are kept apart from the
        accepted actions, each the newest of its kind."""
        refused, keep = ("LIKE", REFUSALS_KEEP) if outcome.startswith("refused") else ("NOT LIKE", AUDIT_KEEP)
        self._write(("INSERT INTO audit (at, user, remote, action, outcome) VALUES (?,?,?,?,?)",
                     (time.time(), user, remote, action, outcome)),
                    (f"DELETE FROM audit WHERE outcome {refused} ? AND id <= "
                     f"(SELECT id FROM audit WHERE outcome {refused} ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
                     (REFUSED, REFUSED, keep)))

    def audit(self, limit: int = 200) -> list[dict]:
        """The newest `limit` accepted actions and the newest `limit // 4` refusals, newest first."""
        rows = self.db.execute(
            "SELECT at, user, remote, action, outcome FROM ("
            "SELECT * FROM (SELECT * FROM audit WHERE outcome NOT LIKE ? ORDER BY id DESC LIMIT ?) UNION ALL "
            "SELECT * FROM (SELECT * FROM audit WHERE outcome LIKE ? ORDER BY id DESC LIMIT ?)) ORDER BY id DESC",
            (REFUSED, limit, REFUSED, limit // 4)).fetchall()
        return [dict(zip(("at", "user", "remote", "action", "outcome"), r)) for r in rows]

    def generations(self, limit: int = 20) -> list[dict]:
        rows = self.db.execute("SELECT generation, started_at, ready_at, ended_at, end_reason FROM generations "
                               "ORDER BY generation DESC LIMIT ?", (limit,)).fetchall()
        return [dict(zip(("generation", "started_at", "ready_at", "ended_at", "end_reason"), r)) for r in rows]

    def close(self) -> None:
        self.retry()
        self.checkpoint()
        self.db.close()
