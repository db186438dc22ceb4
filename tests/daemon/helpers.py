"""Start the real minibatchd as a subprocess on a short socket path and talk to it over the socket."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp

from minibatch.daemon.client import request_json


class Daemon:
    def __init__(
        self, socket: Path, model: Path | str, *args: str, env: dict | None = None, umask: int | None = None
    ) -> None:
        self.socket = socket
        # beside the socket, or beside its directory when the daemon is to create that
        self.log = socket.with_suffix(".log") if socket.parent.exists() else socket.parent.with_suffix(".log")
        cmd = [
            sys.executable,
            "-m",
            "minibatch.daemon.cli",
            "start",
            "--foreground",
            "--socket",
            str(socket),
            "--model",
            str(model),
            *args,
        ]
        full_env = {**os.environ, **(env or {})}
        self._logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            env=full_env,
            preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> Daemon:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                status, _ = request_json(str(self.socket), "GET", "/health", timeout=2)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"daemon not ready in {timeout} s:\n{self.log_text()}")

    def get(self, url: str, timeout: float = 10.0) -> tuple[int, dict]:
        return request_json(str(self.socket), "GET", url, timeout=timeout)

    def stats(self) -> dict:
        return self.get("/v1/engine/stats?steps=0")[1]

    def metrics(self) -> str:
        """/metrics' text (Prometheus' exposition format)."""
        status, out = self.get("/metrics")
        assert status == 200, out
        return out["raw"]

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Until nothing runs or waits and the KV cache is empty again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats()
            if s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0:
                return s
            time.sleep(0.05)
        raise AssertionError(f"daemon not idle after {timeout} s: {self.stats()}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


@contextmanager
def running_daemon(model: Path | str, *args: str, prefix: str = "mb-") -> Iterator[Daemon]:
    """A ready daemon on a short socket path in a fresh directory; stopped (exit 0 checked) and cleaned up after."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    daemon = Daemon(Path(d) / "d.sock", model, *args).wait_ready()
    try:
        yield daemon
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)


def session(socket: Path) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket)), base_url="http://localhost")


async def read_sse(resp: aiohttp.ClientResponse) -> tuple[list[dict | str], bytes]:
    """All events of an SSE response (parsed JSON, or the string '[DONE]') and the raw bytes."""
    raw = await resp.read()
    events = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: "), block
        data = block[len(b"data: ") :].decode()
        events.append(data if data == "[DONE]" else json.loads(data))
    return events, raw


def chat_body(text: str = "Hello!", **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], **kw}


def save_tools_model(tiny_chat_model_dir: Path, dest: Path, template: str) -> Path:
    """The tiny chat model in `dest` with another chat template (one that renders tools)."""
    for f in tiny_chat_model_dir.iterdir():
        shutil.copy(f, dest / f.name)
    (dest / "chat_template.jinja").write_text(template)
    return dest


@contextmanager
def keyed_daemon(model: Path | str, key: str, prefix: str = "mbk-") -> Iterator[Daemon]:
    """A ready daemon on a short socket and on a TCP port that wants `key` (its URL as `daemon.url`)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    daemon = Daemon(Path(d) / "d.sock", model, "--port", str(port), "--api-key", key, "--kv-cache-gb", "0.05")
    daemon.wait_ready()
    daemon.url = f"http://127.0.0.1:{port}"
    try:
        yield daemon
    finally:
        assert daemon.stop() == 0, daemon.log_text()
        shutil.rmtree(d, ignore_errors=True)


# StarCoder's markers, written over four unused special tokens of the built-in vocabulary (which has the
# repository-level ones, <repo_name> and <file_sep>, already)
RENAMED = {"<jupyter_start>": "<fim_prefix>", "<jupyter_text>": "<fim_suffix>", "<jupyter_code>": "<fim_middle>",
           "<jupyter_output>": "<fim_pad>"}  # fmt: skip


def with_fim_markers(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    path = dest / "tokenizer.json"
    tok = json.loads(path.read_text())
    for added in tok["added_tokens"]:
        added["content"] = RENAMED.get(added["content"], added["content"])
    tok["model"]["vocab"] = {RENAMED.get(k, k): v for k, v in tok["model"]["vocab"].items()}
    path.write_text(json.dumps(tok))
    return dest
