"""The chat beside the engine: one broadcast with the real chat on screen, and the same requests without it.

  .venv/bin/python scripts/features/bench_chat.py                          # 1, 4 and 6 panes, a private daemon
  .venv/bin/python scripts/features/bench_chat.py --panes 4 --max-tokens 256 --repeats 3 --socket PATH
  .venv/bin/python scripts/features/bench_chat.py --url http://127.0.0.1:8000 --api-key KEY   # a TCP listener
  .venv/bin/python scripts/features/bench_chat.py --hog 0.25,0.5            # also the engine beside a busy loop

For each pane count it starts `minibatch-chat` in a pseudo-terminal of --size (a real terminal for
it: the script answers its capability query and reads every byte it draws), types one prompt of the
bundled chat set into each pane and broadcasts them (ctrl+b), and waits until the daemon has finished
them all. Then the same requests (the same messages and the panes' parameters: the chat's own sampling
defaults with one seed, or greedy with --sampling greedy; either way the same tokens, since a seeded draw
depends on the seed and the token's position only) go out from a plain client with the chat closed.
Repeats alternate the two; the medians are reported, and each ratio is the median of the repeats' own
ratios (a with/without pair runs within a minute, so the machine's drift cancels in it), printed beside it:

- engine tok/s: the daemon's generated-token counter over the wall time from the broadcast to the
  last request's end, with the chat and without it, and their ratio;
- the chat's CPU seconds per 1,000 streamed tokens (its process's user + system time over that
  window), its frames per second (synchronized-output frames it wrote) and its resident memory.

--hog F[,F...] adds the contention figures: the same requests without the chat beside a busy loop
that takes the fraction F of one core (busy F of every 10 ms), each repeat against its own run with
no loop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchlib import CHAT_SET  # noqa: E402
from loadgen import env_socket, session, stream_request  # noqa: E402

from minibatch.daemon.client import request_json  # noqa: E402
from minibatch.tui.history import History, PaneSettings  # noqa: E402

SYNC_QUERY, SYNC_REPLY, SYNC_START = b"\x1b[?2026$p", b"\x1b[?2026;2$y", b"\x1b[?2026h"
# a busy loop that takes the share {f} of one core: busy f of every 10 ms, asleep the rest
HOG = (
    "import time\nd={f}\nwhile True:\n t=time.perf_counter()\n"
    " while time.perf_counter()-t<d*0.01: pass\n time.sleep((1-d)*0.01)\n"
)


def prompts(n: int) -> list[str]:
    lines = CHAT_SET.read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


class Daemon:
    """The daemon under test: given (--socket/--url), or a private one this script starts and stops."""

    def __init__(self, args) -> None:
        self.args, self.private, self.folder = args, None, None
        if args.url or args.socket:
            self.target = args.url or env_socket(args.socket)
            return
        self.folder = Path(tempfile.mkdtemp(prefix="mb-chat-", dir="/tmp"))
        self.target = str(self.folder / "d.sock")
        cmd = [sys.executable, "-m", "minibatch.daemon.cli", "start", "--socket", self.target]
        cmd += ["--model", args.model, "--log-file", str(self.folder / "d.log"), *args.daemon_arg]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        self.private = True

    def get(self, path: str) -> dict:
        status, body = request_json(self.target, "GET", path, timeout=30, api_key=self.args.api_key)
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {body}")
        return body

    def generated_tokens(self) -> float:
        status, body = request_json(self.target, "GET", "/metrics", timeout=30, api_key=self.args.api_key)
        text = body.get("raw", "")  # Prometheus text, not JSON
        m = re.search(r"^minibatch_generation_tokens_total(?:\{[^}]*\})? ([\d.e+]+)$", text, re.M)
        if status != 200 or m is None:
            raise RuntimeError(f"/metrics: no minibatch_generation_tokens_total (HTTP {status})")
        return float(m.group(1))

    def wait_finished(self, finished_before: int, n: int, timeout: float) -> float:
        """Poll until n more requests have finished and nothing runs or waits; the time it saw that."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.get("/v1/engine/stats?steps=0")
            if st["requests_finished"] >= finished_before + n and st["running"] == 0 and st["waiting"] == 0:
                return time.monotonic()
            time.sleep(0.05)
        raise RuntimeError(f"{n} requests did not finish within {timeout} s")

    def first_arrival(self, finished_before: int) -> threading.Thread:
        """A thread that polls every 10 ms until a request of the next batch reaches the engine (something
        runs or waits, or finished more); its `.at` is the time it saw that."""

        def poll() -> None:
            deadline = time.monotonic() + self.args.timeout
            while time.monotonic() < deadline:
                st = self.get("/v1/engine/stats?steps=0")
                if st["running"] or st["waiting"] or st["requests_finished"] > finished_before:
                    watcher.at = time.monotonic()
                    return
                time.sleep(0.01)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.at = None
        watcher.start()
        return watcher

    def stop(self) -> None:
        if self.private:
            subprocess.run(
                [sys.executable, "-m", "minibatch.daemon.cli", "stop", "--socket", self.target],
                stdout=subprocess.DEVNULL,
            )


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_rss_mb(pid: int) -> float:
    m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) / 1024 if m else 0.0


class Terminal:
    """minibatch-chat in a pseudo-terminal; a thread reads all it draws, counts its frames, answers its query."""

    def __init__(self, args, target: str, db: Path) -> None:
        cols, rows = (int(v) for v in args.size.split("x"))
        cmd = [sys.executable, "-m", "minibatch.tui.cli", "--db", str(db)]
        cmd += ["--url", target] if target.startswith("http://") else ["--socket", target]
        env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(cols), "LINES": str(rows)}
        if args.api_key:
            env["MINIBATCH_API_KEY"] = args.api_key
        winsize = struct.pack("HHHH", rows, cols, 0, 0)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat, on the terminal's other side
            fcntl.ioctl(0, termios.TIOCSWINSZ, winsize)
            os.execvpe(cmd[0], cmd, env)
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, winsize)
        self.frames = 0
        self.bytes = 0
        self.tail = b""
        self.seen = bytearray()  # the first bytes it drew, to know it is up
        self._done = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._done:
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if not ready:
                continue
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                return
            if not data:
                return
            joined = self.tail + data
            if SYNC_QUERY in joined:
                os.write(self.fd, SYNC_REPLY)
            self.frames += joined.count(SYNC_START) - self.tail.count(SYNC_START)
            self.tail = joined[-16:]
            self.bytes += len(data)
            if len(self.seen) < 1 << 20:
                self.seen += data

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_for(self, needle: bytes, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.seen:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the chat did not show {needle!r} within {timeout} s")
            time.sleep(0.05)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.type("\x11")  # ctrl+q
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            time.sleep(0.05)
        else:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
        self._done = True
        self._reader.join(1)
        os.close(self.fd)


def with_chat(daemon: Daemon, args, texts: list[str], settings: PaneSettings) -> dict:
    with tempfile.TemporaryDirectory() as d:
        db = Path(d) / "chat.sqlite3"
        history = History(db)
        for i in range(len(texts)):
            history.new_pane(i, settings)
        history.close()
        term = Terminal(args, daemon.target, db)
        try:
            term.wait_for(b"ready")
            time.sleep(1.0)  # let it settle: its first frames are not part of the figure
            for text in texts:  # focus starts in pane 1; tab moves to the next (a key of its own, not in a burst)
                for key in (text, "\t"):
                    term.type(key)
                    time.sleep(0.2)
            time.sleep(0.3)
            finished, tokens = daemon.get("/v1/engine/stats?steps=0")["requests_finished"], daemon.generated_tokens()
            arrival = daemon.first_arrival(finished)
            frames, cpu, t0 = term.frames, proc_cpu(term.pid), time.monotonic()
            term.type("\x02")  # ctrl+b: every pane asks its own pending input
            t1 = daemon.wait_finished(finished, len(texts), args.timeout)
            arrival.join()
            time.sleep(0.3)  # the last tokens reach the screen
            cpu, frames = proc_cpu(term.pid) - cpu, term.frames - frames
            rss = proc_rss_mb(term.pid)
            tokens = daemon.generated_tokens() - tokens
        finally:
            term.close()
    wall = t1 - t0
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        **engine_window(tokens, t0, arrival.at, t1),
        "chat_cpu_s": cpu,
        "chat_cpu_s_per_1k_tokens": 1000 * cpu / tokens if tokens else None,
        "frames_per_s": frames / (wall + 0.3),
        "chat_rss_mb": rss,
    }


def without_chat(daemon: Daemon, args, texts: list[str], settings: PaneSettings) -> dict:
    """The panes' requests, exactly as the chat sends them (messages and parameters), from a plain client."""

    async def fire() -> list:
        async with session(None if args.url else daemon.target, args.url, args.api_key) as s:
            bodies = [{"messages": [{"role": "user", "content": t}], **settings.request_params()} for t in texts]
            return await asyncio.gather(*(stream_request(s, i, b) for i, b in enumerate(bodies)))

    finished, tokens = daemon.get("/v1/engine/stats?steps=0")["requests_finished"], daemon.generated_tokens()
    arrival = daemon.first_arrival(finished)
    t0 = time.monotonic()
    results = asyncio.run(fire())
    t1 = daemon.wait_finished(finished, len(texts), args.timeout)
    arrival.join()
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"requests failed: {[r.error for r in failed]}")
    tokens = daemon.generated_tokens() - tokens
    window = engine_window(tokens, t0, arrival.at, t1)
    return {"tokens": tokens, "wall_s": t1 - t0, "tok_s": tokens / (t1 - t0), **window}


def engine_window(tokens: float, t0: float, first: float | None, t1: float) -> dict:
    """The engine's own window, from the first request's arrival (polled, so up to ~10 ms late) to the last
    one's end, and the wait before it: with the chat, from the broadcast key to that arrival."""
    first = t0 if first is None else first
    return {"dispatch_s": first - t0, "engine_tok_s": tokens / (t1 - first)}


@contextlib.contextmanager
def hog(fraction: float):
    proc = subprocess.Popen([sys.executable, "-c", HOG.format(f=fraction)]) if fraction > 0 else None
    try:
        time.sleep(0.3 if proc else 0)
        yield
    finally:
        if proc:
            proc.kill()
            proc.wait()


def median_of(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if all(isinstance(r.get(k), int | float) for r in runs)]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--panes", default="1,4,6", help="pane counts, comma-separated (1 to 6; default 1,4,6)")
    ap.add_argument("--max-tokens", type=int, default=256, help="each pane's max tokens (default 256)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each variant; medians reported (default 3)")
    ap.add_argument("--hog", default="", help="busy-loop fractions of one core for the contention rows, e.g. 0.25,0.5")
    ap.add_argument("--size", default="160x48", help="the chat's terminal, COLSxROWS (default 160x48)")
    ap.add_argument("--socket", default=None, help="a running daemon's socket (default: start a private one)")
    ap.add_argument("--url", default=None, help="a daemon's (or a cluster ingress's) TCP listener instead")
    ap.add_argument("--api-key", default=os.environ.get("MINIBATCH_API_KEY"), help="key for --url")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the private daemon's model")
    ap.add_argument(
        "--daemon-arg", action="append", default=[], help="extra option for the private daemon (repeatable)"
    )
    ap.add_argument(
        "--sampling",
        choices=["chat", "greedy"],
        default="chat",
        help="the panes' sampling: the chat's defaults (temperature 0.7, top_p 0.95) seeded, or greedy",
    )
    ap.add_argument("--timeout", type=float, default=600, help="seconds one broadcast may take")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    args = ap.parse_args()
    panes = [int(p) for p in args.panes.split(",")]
    if not all(1 <= p <= 6 for p in panes):
        ap.error("--panes: each count must be in [1, 6] (the chat's limit)")
    hogs = [float(f) for f in args.hog.split(",") if f]
    if not all(0 < f < 1 for f in hogs):
        ap.error("--hog: each fraction must be in (0, 1)")
    if args.sampling == "chat":
        settings = PaneSettings(max_tokens=args.max_tokens, seed=1)
    else:
        settings = PaneSettings(temperature=0.0, max_tokens=args.max_tokens)
    daemon = Daemon(args)
    report: dict = {"target": daemon.target, "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": []}
    report["sampling"] = settings.request_params()
    try:
        report["model"] = daemon.get("/health").get("model")
        for n in panes:
            texts = prompts(n)
            without_chat(daemon, args, texts, settings)  # warm-up: the prefix cache and the allocator
            runs = {"with": [], "without": []}
            hogged: dict[float, list[dict]] = {f: [] for f in hogs}
            hog_ratios: dict[float, list[float]] = {f: [] for f in hogs}
            for r in range(args.repeats):  # alternate, so drift hits both alike
                order = ("without", "with") if r % 2 == 0 else ("with", "without")
                for variant in order:
                    fn = with_chat if variant == "with" else without_chat
                    runs[variant].append(fn(daemon, args, texts, settings))
                for f in hogs:  # each beside the idle run of the same repeat
                    with hog(f):
                        hogged[f].append(without_chat(daemon, args, texts, settings))
                    hog_ratios[f].append(hogged[f][-1]["tok_s"] / runs["without"][-1]["tok_s"])
            row = {"panes": n, "with": median_of(runs["with"]), "without": median_of(runs["without"])}
            # each repeat's with/without pair, measured minutes apart at most: the median of their ratios
            pairs = list(zip(runs["with"], runs["without"]))
            row["ratios"] = [w["tok_s"] / wo["tok_s"] for w, wo in pairs]
            row["ratio"] = statistics.median(row["ratios"])
            row["engine_ratios"] = [w["engine_tok_s"] / wo["engine_tok_s"] for w, wo in pairs]
            row["engine_ratio"] = statistics.median(row["engine_ratios"])
            row["hog"] = {
                str(f): {**median_of(hogged[f]), "ratios": hog_ratios[f], "ratio": statistics.median(hog_ratios[f])}
                for f in hogs
            }
            report["rows"].append(row)
            print_row(row)
    finally:
        daemon.stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"report: {args.json}")
    return 0


def print_row(row: dict) -> None:
    w, wo = row["with"], row["without"]
    print(
        f"{row['panes']} pane{'s' if row['panes'] > 1 else ''}: engine {w['tok_s']:.1f} tok/s with the chat, "
        f"{wo['tok_s']:.1f} without: {row['ratio']:.2f}x ({spread(row['ratios'])}); "
        f"the chat {w['chat_cpu_s_per_1k_tokens']:.2f} s CPU "
        f"per 1,000 tokens, {w['frames_per_s']:.1f} frames/s, {w['chat_rss_mb']:.0f} MB resident",
        flush=True,
    )
    print(
        f"  from the first request's arrival: {w['engine_tok_s']:.1f} tok/s with the chat, {wo['engine_tok_s']:.1f} "
        f"without: {row['engine_ratio']:.2f}x; the broadcast reached the engine {1000 * w['dispatch_s']:.0f} ms "
        f"after the key ({1000 * wo['dispatch_s']:.0f} ms for the plain client)",
        flush=True,
    )
    for f, h in row["hog"].items():
        print(
            f"  beside a busy loop of {float(f):.0%} of a core: {h['tok_s']:.1f} tok/s, {h['ratio']:.2f}x "
            f"({spread(h['ratios'])})",
            flush=True,
        )


def spread(ratios: list[float]) -> str:
    """Each repeat's ratio, for the reader to see how far the median is from its runs."""
    return "runs " + ", ".join(f"{x:.2f}" for x in ratios)


if __name__ == "__main__":
    sys.exit(main())
