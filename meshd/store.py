"""SQLite in the state directory: generations, events, incidents, the audit
trail of control actions (who, what, when), and the few values a restarted
controller needs (what the operator asked for, the last
generation, each agent's last event sequence number)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path

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
AUDIT_KEEP = 10_000  # newest rows kept: refused attempts must not grow the store without bound
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


class Store:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        for table, columns in ADDED_COLUMNS.items():
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns:
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def get(self, key: str, default=None):
        row = self.db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default

    def put(self, key: str, value) -> None:
        self.db.execute("INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                        (key, json.dumps(value)))

    def record_event(self, record: dict) -> None:
        self.db.execute(
            "INSERT INTO events (at, received_at, node, seq, kind, generation, rank, data) VALUES (?,?,?,?,?,?,?,?)",
            (record.get("at"), time.time(), record.get("node"), record.get("seq"), record.get("kind"),
             record.get("generation"), record.get("rank"), json.dumps(record)))

    def note_generation(self, generation: int, what: str, at: float, detail: str = "") -> None:
        if what == "started":
            self.db.execute("INSERT OR REPLACE INTO generations (generation, started_at) VALUES (?, ?)",
                            (generation, at))
        elif what == "ready":
            self.db.execute("UPDATE generations SET ready_at = ? WHERE generation = ?", (at, generation))
        else:
            self.db.execute("UPDATE generations SET ended_at = ?, end_reason = ? WHERE generation = ? "
                            "AND ended_at IS NULL", (at, detail, generation))

    def open_incident(self, incident) -> None:
        self.db.execute(f"INSERT INTO incidents ({', '.join(INCIDENT_COLUMNS)}) VALUES (?,?,?,?,?,?,?,?,?,?)",
                        self._incident_values(incident))

    def update_incident(self, incident, serving_back_at: float | None = None) -> None:
        """Everything an incident may learn after it opened: its cause (a peer's report that came first
        can be taken over), consequences, steps, timeline, and when serving came back."""
        assignments = ", ".join(f"{c} = ?" for c in INCIDENT_COLUMNS[1:])
        values = self._incident_values(incident)[1:]
        if serving_back_at is not None:
            assignments += ", serving_back_at = ?"
            values += (serving_back_at,)
        self.db.execute(f"UPDATE incidents SET {assignments} WHERE opened_at = ?", values + (incident.opened_at,))

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
        row = self.db.execute("SELECT generation FROM generations ORDER BY generation DESC LIMIT 1 OFFSET ?",
                              (generations - 1,)).fetchone()
        if row is not None:
            self.db.execute("DELETE FROM events WHERE generation < ?", (row[0],))
            self.db.execute("DELETE FROM generations WHERE generation < ?", (row[0],))
        self.db.execute("DELETE FROM incidents WHERE id NOT IN (SELECT id FROM incidents ORDER BY id DESC LIMIT ?)",
                        (incidents,))

    def record_audit(self, user: str, remote: str, action: str, outcome: str) -> None:
        cur = self.db.execute("INSERT INTO audit (at, user, remote, action, outcome) VALUES (?,?,?,?,?)",
                              (time.time(), user, remote, action, outcome))
        self.db.execute("DELETE FROM audit WHERE id <= ?", (cur.lastrowid - AUDIT_KEEP,))

    def audit(self, limit: int = 200) -> list[dict]:
        rows = self.db.execute("SELECT at, user, remote, action, outcome FROM audit ORDER BY id DESC LIMIT ?",
                               (limit,)).fetchall()
        return [dict(zip(("at", "user", "remote", "action", "outcome"), r)) for r in rows]

    def generations(self, limit: int = 20) -> list[dict]:
        rows = self.db.execute("SELECT generation, started_at, ready_at, ended_at, end_reason FROM generations "
                               "ORDER BY generation DESC LIMIT ?", (limit,)).fetchall()
        return [dict(zip(("generation", "started_at", "ready_at", "ended_at", "end_reason"), r)) for r in rows]

    def close(self) -> None:
        self.db.close()
