"""SQLite in the state directory: generations, events, incidents, and the few
values a restarted controller needs (what the operator asked for, the last
generation, each agent's last event sequence number)."""

from __future__ import annotations

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
"""


class Store:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

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

    def open_incident(self, opened_at: float, cause: str, node: str, rank: int, generation: int, detail: str) -> None:
        self.db.execute("INSERT INTO incidents (opened_at, cause, node, rank, generation, detail, steps) "
                        "VALUES (?,?,?,?,?,?,?)", (opened_at, cause, node, rank, generation, detail, "[]"))

    def update_incident(self, opened_at: float, steps: tuple[str, ...]) -> None:
        self.db.execute("UPDATE incidents SET steps = ? WHERE opened_at = ?", (json.dumps(list(steps)), opened_at))

    def close_incident(self, opened_at: float, serving_back_at: float, steps: tuple[str, ...]) -> None:
        self.db.execute("UPDATE incidents SET serving_back_at = ?, steps = ? WHERE opened_at = ?",
                        (serving_back_at, json.dumps(list(steps)), opened_at))

    def open_incident_row(self) -> dict | None:
        """The newest incident still waiting to serve again (a restarted controller carries it on)."""
        row = self.db.execute("SELECT opened_at, cause, node, rank, generation, detail, steps FROM incidents "
                              "WHERE serving_back_at IS NULL ORDER BY id DESC LIMIT 1").fetchone()
        if row is None:
            return None
        return dict(zip(("opened_at", "cause", "node", "rank", "generation", "detail"), row[:6]),
                    steps=tuple(json.loads(row[6] or "[]")))

    def incidents(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT opened_at, cause, node, rank, generation, detail, steps, serving_back_at "
                               "FROM incidents ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [{"opened_at": r[0], "cause": r[1], "node": r[2], "rank": r[3], "generation": r[4],
                 "detail": r[5], "steps": json.loads(r[6] or "[]"), "serving_back_at": r[7],
                 "recovery_seconds": (r[7] - r[0]) if r[7] else None} for r in rows]

    def generations(self, limit: int = 20) -> list[dict]:
        rows = self.db.execute("SELECT generation, started_at, ready_at, ended_at, end_reason FROM generations "
                               "ORDER BY generation DESC LIMIT ?", (limit,)).fetchall()
        return [dict(zip(("generation", "started_at", "ready_at", "ended_at", "end_reason"), r)) for r in rows]

    def close(self) -> None:
        self.db.close()
