"""Chat history in SQLite: panes (with their settings) and their messages, restored at start."""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS panes (
    id INTEGER PRIMARY KEY,
    position INTEGER NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    temperature REAL NOT NULL DEFAULT 0.7,
    top_p REAL NOT NULL DEFAULT 0.95,
    max_tokens INTEGER NOT NULL DEFAULT 0,  -- 0: the daemon's default
    seed INTEGER,
    model TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    pane_id INTEGER NOT NULL REFERENCES panes(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    created REAL NOT NULL,
    images TEXT  -- a user message's attached images: their paths, one a line
);
"""


@dataclass(slots=True)
class PaneSettings:
    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int | None = None  # None: the daemon's default (DEFAULT_MAX_TOKENS, within the context)
    seed: int | None = None
    model: str | None = None  # the pane's model (any the daemon lists); None: the daemon's own

    def request_params(self) -> dict:
        params = {"temperature": self.temperature, "top_p": self.top_p}
        if self.max_tokens is not None:
            params["max_tokens"] = self.max_tokens
        if self.seed is not None:
            params["seed"] = self.seed
        if self.model is not None:
            params["model"] = self.model
        return params


@dataclass(slots=True)
class StoredPane:
    id: int
    settings: PaneSettings
    messages: list[dict] = field(default_factory=list)  # {"role", "content"}, and "images" (paths) where it has some


class History:
    def __init__(self, path: Path | str) -> None:
        if str(path) != ":memory:":  # private to the user (0700 folder, 0600 file): it holds every conversation
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(path, 0o600)
        self.db = sqlite3.connect(str(path))
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(panes)")}
        if "model" not in columns:  # a history from before panes had their model
            with self.db:
                self.db.execute("ALTER TABLE panes ADD COLUMN model TEXT")
        if "images" not in {row[1] for row in self.db.execute("PRAGMA table_info(messages)")}:
            with self.db:  # a history from before messages had images
                self.db.execute("ALTER TABLE messages ADD COLUMN images TEXT")

    def close(self) -> None:
        self.db.close()

    def panes(self) -> list[StoredPane]:
        rows = self.db.execute(
            "SELECT id, system_prompt, temperature, top_p, max_tokens, seed, model FROM panes ORDER BY position, id"
        ).fetchall()
        out = []
        for pid, sp, t, p, m, seed, model in rows:
            msgs = self.db.execute(
                "SELECT role, content, images FROM messages WHERE pane_id = ? ORDER BY id", (pid,)
            ).fetchall()
            messages = [
                {"role": r, "content": c, **({"images": images.split("\n")} if images else {})} for r, c, images in msgs
            ]
            out.append(StoredPane(pid, PaneSettings(sp, t, p, m or None, seed, model), messages))
        return out

    def new_pane(self, position: int, settings: PaneSettings | None = None) -> int:
        s = asdict(settings or PaneSettings())
        with self.db:
            cur = self.db.execute(
                "INSERT INTO panes (position, system_prompt, temperature, top_p, max_tokens, seed, model) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    position,
                    s["system_prompt"],
                    s["temperature"],
                    s["top_p"],
                    s["max_tokens"] or 0,
                    s["seed"],
                    s["model"],
                ),
            )
        return int(cur.lastrowid)

    def save_settings(self, pane_id: int, settings: PaneSettings) -> None:
        with self.db:
            self.db.execute(
                "UPDATE panes SET system_prompt = ?, temperature = ?, top_p = ?, max_tokens = ?, seed = ?, model = ? "
                "WHERE id = ?",
                (
                    settings.system_prompt,
                    settings.temperature,
                    settings.top_p,
                    settings.max_tokens or 0,
                    settings.seed,
                    settings.model,
                    pane_id,
                ),
            )

    def add_message(self, pane_id: int, role: str, content: str, images: tuple[str, ...] = ()) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO messages (pane_id, role, content, created, images) VALUES (?, ?, ?, ?, ?)",
                (pane_id, role, content, time.time(), "\n".join(images) or None),
            )

    def clear(self, pane_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages WHERE pane_id = ?", (pane_id,))

    def delete_pane(self, pane_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM panes WHERE id = ?", (pane_id,))

    def reset(self) -> None:
        with self.db:
            self.db.execute("DELETE FROM messages")
            self.db.execute("DELETE FROM panes")
