"""`minibatchd`: start, stop and inspect the daemon.

Every option also reads an environment variable MINIBATCH_<NAME> (for example
MINIBATCH_MAX_NUM_SEQS=16); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

from .client import request_json
from .lifecycle import LifecycleError, ensure_private_dir, running_pid
from .models.settings import DEFAULT_LOAD_WAIT, DEFAULT_MAX_LOADED, DEFAULT_MEMORY_SHARE
from .paths import default_log_file, default_socket

# The daemon's models on demand (a cluster application serves one model and has none of these).
MODEL_OPTIONS = [
    ("--preload", str, None, "more models to load at start, comma-separated (they stay loaded, as --model does)"),
    (
        "--keep-alive",
        str,
        "5m",
        "how long a model loaded by a request stays after its last one: a duration (5m, 30s, 1h), 0 to unload "
        "at once, -1 to keep it (a request's keep_alive overrides it)",
    ),
    (
        "--max-loaded-models",
        int,
        DEFAULT_MAX_LOADED,
        "models loaded at once at most; one more evicts the least recently used idle one",
    ),
    (
        "--models-memory-gb",
        float,
        None,
        f"memory the loaded models' weights and KV caches may take together, GiB (default "
        f"{DEFAULT_MEMORY_SHARE:g} of the machine's memory, of the GPU's on a GPU)",
    ),
    (
        "--model-settings",
        str,
        None,
        'a JSON file of per-model engine options, e.g. {"qwen2.5-coder:7b": {"kv-cache-type": "q8_0", '
        '"max-model-len": 32768}}: each model loads with the daemon\'s options and its own on top',
    ),
    (
        "--load-wait",
        float,
        DEFAULT_LOAD_WAIT,
        "seconds a request for a model that does not fit waits for busy models to finish, then 503",
    ),
    (
        "--engine-loop",
        str,
        "shared",
        "shared: every model's steps alternate on one thread (one OpenMP team on the cores); per-model: a "
        "thread each, stepping at once",
    ),
]
# The listeners, limits and log (flag, type, default, help); the engine's options are in engine/options.py.
DAEMON_OPTIONS = [
    (
        "--reasoning-format",
        str,
        "auto",
        "a thinking model's reasoning: auto (apart, in reasoning_content / thinking) or none (left in the content)",
    ),
    (
        "--reasoning-budget",
        int,
        -1,
        "thinking tokens a thinking model may spend before its end-of-thinking marker is put in and the answer "
        "begins, where a request sets no budget: -1 no bound, 0 the answer at once",
    ),
    ("--host", str, None, "also listen on TCP at this host (default 127.0.0.1 when --port is set)"),
    ("--port", int, None, "also listen on TCP at this port (off by default)"),
    (
        "--api-key",
        str,
        None,
        "key every TCP request must send as 'Authorization: Bearer KEY' (prefer the env variable: "
        "a flag shows in ps while it starts)",
    ),
    ("--api-key-file", str, None, "file of API keys, one per line; reread when it changes, so keys can be rotated"),
    ("--allowed-hosts", str, None, "extra Host names TCP requests may use, comma-separated ('*': any)"),
    ("--allowed-origins", str, None, "browser origins allowed over TCP, with CORS, comma-separated (default: none)"),
    ("--shutdown-timeout", float, 30.0, "seconds to drain in-flight requests on stop"),
    (
        "--request-timeout",
        float,
        600.0,
        "time limit per request, seconds, from its arrival or its prompt's last computed chunk",
    ),
    (
        "--media-path",
        str,
        None,
        "a folder whose files requests may send as file:// image URLs (llama-server's --media-path; default: "
        "none, file:// refused)",
    ),
    ("--read-timeout", float, 30.0, "seconds a client may take to send its request (headers and body)"),
    ("--log-file", str, None, "log file for the background daemon (default: user state dir)"),
]


def env_name(flag: str) -> str:
    return "MINIBATCH_" + flag.lstrip("-").replace("-", "_").upper()


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket", type=Path, default=None, help=f"Unix socket path (env MINIBATCH_SOCKET; default {default_socket()})"
    )


def server_options(models: bool = True) -> list[tuple]:
    """(flag, type, default, help) of every `start` option: the engine's (one definition, engine/options.py),
    the models' on demand (`models`), then the daemon's."""
    from minibatch.engine.options import ENGINE_OPTIONS

    engine = [(o.flag, o.type, o.default, o.help) for o in ENGINE_OPTIONS]
    return engine + (MODEL_OPTIONS if models else []) + DAEMON_OPTIONS


def add_server_options(p: argparse.ArgumentParser, models: bool = True) -> None:
    for flag, typ, default, help_ in server_options(models):
        env = os.environ.get(env_name(flag))
        value = typ(env) if env not in (None, "") else default
        shown = f"; default {default}" if default is not None else ""
        p.add_argument(flag, type=typ, default=value, help=f"{help_} (env {env_name(flag)}{shown})")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=os.environ.get("MINIBATCH_NO_PREFIX_CACHING") == "1",
        help="do not share KV blocks between requests with a common prefix (benchmarks replaying one trace)",
    )
    p.add_argument(
        "--prompt-cache-shared",
        action="store_true",
        default=os.environ.get("MINIBATCH_PROMPT_CACHE_SHARED") == "1",
        help="let requests under different API keys hit each other's cached prefixes, in memory and on disk "
        "(default: each key its own, so that no client can time another's prompts)",
    )
    p.add_argument(
        "--socket-requires-key",
        action="store_true",
        default=os.environ.get("MINIBATCH_SOCKET_REQUIRES_KEY") == "1",
        help="require the API key on the Unix socket too (default: its file permissions guard it)",
    )
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        default=os.environ.get("MINIBATCH_INSECURE_NO_AUTH") == "1",
        help="allow a non-loopback --host without an API key (anyone who can reach it may use the daemon)",
    )
    p.add_argument(
        "--foreground", action="store_true", help="run attached to this terminal instead of in the background"
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the daemon to become ready")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minibatchd", description="minibatch inference daemon on a Unix socket")
    sub = ap.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start the daemon (in the background unless --foreground)")
    add_common(start)
    add_server_options(start)
    for name, help_ in (
        ("stop", "stop the daemon: drain in-flight requests, then exit"),
        ("status", "show what the daemon is doing"),
    ):
        p = sub.add_parser(name, help=help_)
        add_common(p)
        if name == "stop":
            p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to exit")
    logs = sub.add_parser("logs", help="print the daemon's log")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--log-file", type=Path, default=None)
    models = sub.add_parser(
        "models", help="list the models this machine can serve without a network (and what a running daemon loaded)"
    )
    add_common(models)
    cache = sub.add_parser(
        "prompt-cache",
        help="list the disk prompt cache (each model's cached KV blocks), or clear it (a running daemon's, else "
        "the folder's)",
    )
    add_common(cache)
    cache.add_argument("--clear", action="store_true", help="remove the cached blocks (of --model only, if given)")
    cache.add_argument("--model", default=None, help="with --clear: only this model's blocks (a name as listed)")
    cache.add_argument(
        "--prompt-cache-dir",
        default=os.environ.get("MINIBATCH_PROMPT_CACHE_DIR") or None,
        help="the folder when no daemon runs (env MINIBATCH_PROMPT_CACHE_DIR; default: the daemon's default)",
    )
    cache.add_argument("--json", action="store_true", help="print the listing as JSON")
    return ap


def socket_of(args) -> Path:
    return Path(args.socket) if args.socket else default_socket()


def engine_config(args):
    from minibatch.engine.options import engine_config

    return engine_config(vars(args))


def pool_settings(args):
    """How many models stay loaded, for how long, in how much memory (ValueError naming the option)."""
    from .models.settings import PoolSettings, parse_duration, read_model_settings

    return PoolSettings(
        max_loaded=args.max_loaded_models,
        memory_bytes=None if args.models_memory_gb is None else int(args.models_memory_gb * 2**30),
        keep_alive=parse_duration(args.keep_alive, "--keep-alive"),
        load_wait=args.load_wait,
        engine_loop=args.engine_loop,
        model_settings=read_model_settings(args.model_settings, engine_config(args)),
    )


def preload_of(args) -> tuple[str, ...]:
    return tuple(n.strip() for n in (args.preload or "").split(",") if n.strip())


def check_daemon_options(args) -> None:
    """The daemon's own settings (not the engine's), checked before anything starts: a ValueError naming the
    option (minibatchd's and each cluster replica's daemon's)."""
    if args.reasoning_format not in ("auto", "none"):
        raise ValueError(f"--reasoning-format: must be auto or none, got {args.reasoning_format!r}")
    if args.reasoning_budget < -1:
        raise ValueError(f"--reasoning-budget: must be -1 (no bound), 0 or more, got {args.reasoning_budget}")
    media_path_of(args)


def media_path_of(args) -> str | None:
    """--media-path, checked: an existing folder."""
    if args.media_path is None:
        return None
    if not os.path.isdir(args.media_path):
        raise ValueError(f"--media-path: {args.media_path} is not a folder")
    return os.path.realpath(args.media_path)


def guard_of(args):
    from .guard import Guard

    return Guard.from_options(
        args.api_key,
        args.api_key_file,
        args.socket_requires_key,
        args.host,
        args.port,
        args.allowed_hosts,
        args.allowed_origins,
        args.insecure_no_auth,
    )


def without_key(argv: list[str]) -> tuple[list[str], str | None]:
    """argv with any --api-key value taken out (it goes to the child's environment, never its command line)."""
    out, key, skip = [], None, False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--api-key":
            key, skip = (argv[i + 1] if i + 1 < len(argv) else None), True
        elif a.startswith("--api-key="):
            key = a.split("=", 1)[1]
        else:
            out.append(a)
    return out, key


def reexec_without_key(args, module: str) -> None:
    """A key given on this process's command line: start `module` again with it in the environment instead,
    so `ps` and /proc/PID/cmdline never show it (returns only when there is nothing to hide)."""
    argv, key = without_key(args.argv)
    if key is not None and args.own_command_line:
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], {**os.environ, "MINIBATCH_API_KEY": key})


def cmd_start(args) -> int:
    sock = socket_of(args)
    try:
        ensure_private_dir(sock.parent)
        cfg = engine_config(args)
        models = pool_settings(args)
        check_daemon_options(args)
        guard = guard_of(args)  # a refused bind is reported here, before anything listens
    except (LifecycleError, ValueError) as exc:
        print(f"minibatchd: {exc}", file=sys.stderr)
        return 2
    pid = running_pid(sock)
    if pid:
        print(f"minibatchd: already running (pid {pid}) on {sock}", file=sys.stderr)
        return 1
    if args.foreground:
        reexec_without_key(args, "minibatch.daemon.cli")
        import threading

        # Importing torch takes ~2 s: start it now, beside the web server's own imports, not after them.
        threading.Thread(target=__import__, args=("torch",), name="import-torch", daemon=True).start()
        from .server import DaemonConfig, serve

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        conf = DaemonConfig(
            cfg,
            sock,
            args.host,
            args.port,
            args.shutdown_timeout,
            args.request_timeout,
            args.read_timeout,
            guard,
            models,
            preload_of(args),
            args.reasoning_format,
            reasoning_budget=args.reasoning_budget,
            prompt_cache_shared=args.prompt_cache_shared,
            media_path=media_path_of(args),
        )
        return asyncio.run(serve(conf))
    return start_background(args, sock, guard.api_keys[0] if guard.api_keys else None)


def start_background(
    args, sock: Path, api_key: str | None, prog: str = "minibatchd", module: str = "minibatch.daemon.cli", log_file=None
) -> int:
    """Run `module` with --foreground in a new session, show its log until it answers /health, then return."""
    log_file = Path(args.log_file) if args.log_file else log_file or default_log_file()
    log_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    rest, key = without_key(args.argv)
    argv = [sys.executable, "-m", module, *rest, "--foreground", "--socket", str(sock)]
    env = {**os.environ, **({"MINIBATCH_API_KEY": key} if key is not None else {})}
    offset = log_file.stat().st_size if log_file.exists() else 0
    # private to the user: the log holds what clients asked for and the models' paths
    with os.fdopen(os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    print(f"{prog}: starting (pid {proc.pid}), log {log_file}", file=sys.stderr)
    deadline = time.monotonic() + args.start_timeout
    with open(log_file, "rb") as f:
        f.seek(offset)
        while time.monotonic() < deadline:
            chunk = f.read()
            if chunk:  # show conversion and loading progress as it happens
                sys.stderr.write(chunk.decode(errors="replace"))
                sys.stderr.flush()
            if proc.poll() is not None:
                print(
                    f"{prog}: the daemon exited with status {proc.returncode} before it was ready (see above)",
                    file=sys.stderr,
                )
                return 1
            try:
                status, body = request_json(str(sock), "GET", "/health", timeout=2, api_key=api_key)
                if status == 200:
                    print(f"{prog}: ready (pid {proc.pid}) on {sock}")
                    print(str(sock))
                    return 0
            except OSError:
                pass
            time.sleep(0.1)
    print(
        f"{prog}: not ready after {args.start_timeout:.0f} s; still starting (pid {proc.pid}), see {log_file}",
        file=sys.stderr,
    )
    return 1


def cmd_stop(args, prog: str = "minibatchd") -> int:
    sock = socket_of(args)
    pid = running_pid(sock)
    if not pid or pid < 0:
        print(f"{prog}: not running on {sock}", file=sys.stderr)
        return 1
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if running_pid(sock) is None:
            print(f"{prog}: stopped (pid {pid})")
            return 0
        time.sleep(0.1)
    print(f"{prog}: pid {pid} did not exit within {args.timeout:.0f} s", file=sys.stderr)
    return 1


def cmd_status(args) -> int:
    sock = socket_of(args)
    key = os.environ.get("MINIBATCH_API_KEY")  # only needed with --socket-requires-key
    pid = running_pid(sock)
    if not pid:
        print(f"minibatchd: not running on {sock}")
        return 3
    try:
        hstatus, health = request_json(str(sock), "GET", "/health", api_key=key)
    except OSError as exc:
        print(f"minibatchd: pid {pid} holds the lock but the socket does not answer: {exc}")
        return 1
    lines = [
        ("pid", pid),
        ("socket", sock),
        ("status", health.get("status")),
        ("uptime", f"{health.get('uptime_s', 0):.0f} s"),
        ("model", health.get("model")),
        ("device", f"{health.get('device', '?')} ({health.get('dtype', '?')})"),
        ("weights", health.get("weights", "?")),
    ]
    if memory := health.get("memory"):
        lines.append(
            ("memory", f"{memory['num_params'] / 1e6:.0f}M parameters in {memory['loaded_bytes'] / 1e6:.0f} MB")
        )
    if hstatus == 200 and health.get("models"):
        _, s = request_json(str(sock), "GET", "/v1/engine/stats?steps=0", api_key=key)
        mode = s["mode"] + (f" (switching to {s['pending_mode']})" if s.get("pending_mode") else "")
        lines += [
            ("mode", mode),
            ("running", f"{s['running']} / {s['max_num_seqs']}"),
            ("waiting", s["waiting"]),
            (
                "kv cache",
                f"{s['kv_blocks_used']} / {s['kv_blocks_total']} blocks ({s['kv_usage_percent']:.1f}%), "
                f"{kv_text(health)}",
            ),  # fmt: skip
            ("tokens/s", f"{s['decode_tokens_per_s']:.1f} decode, {s['prefill_tokens_per_s']:.1f} prefill (last 2 s)"),
            ("prefix hits", f"{100 * s['prefix_cache_hit_rate']:.1f}% of prompt tokens"),
            ("preemptions", s["preemptions"]),
        ]
    if health.get("last_error"):
        lines.append(("last error", health["last_error"]))
    for k, v in lines:
        print(f"{k:>12}: {v}")
    loaded = health.get("models") or []
    if loaded:
        print(f"\n{'loaded models':>12}:")
        for m in loaded:
            until = "kept loaded" if m["expires_at"].startswith("0001") else f"until {m['expires_at']}"
            print(
                f"  {m['name']:<32} {m['mode']:<10} {m['running']:>3} running {m['waiting']:>3} waiting  "
                f"{m['memory_bytes'] / 2**20:6.0f} MB  {m['weights']}  KV {kv_text(m)}  {until}"
            )
    for name in health.get("loading") or []:
        print(f"  {name:<32} loading")
    return 0 if hstatus == 200 else 1


def kv_text(facts: dict) -> str:
    """A loaded model's KV cache in a few words: its type, bytes per token and how many tokens fit."""
    if "kv_cache_type" not in facts:
        return "-"
    return f"{facts['kv_cache_type']}, {facts['kv_bytes_per_token']:,} B/token, {facts['kv_cache_tokens']:,} tokens"


def cmd_logs(args) -> int:
    path = Path(args.log_file) if args.log_file else default_log_file()
    if not path.exists():
        print(f"minibatchd: no log at {path}", file=sys.stderr)
        return 1
    with open(path, "rb") as f:
        sys.stdout.write(f.read().decode(errors="replace"))
        sys.stdout.flush()
        while args.follow:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            else:
                time.sleep(0.25)
    return 0


def cmd_models(args) -> int:
    from minibatch.engine.store.cache import list_models

    for m in list_models():
        if m.kind == "builtin":
            state = "ready" if m.ready else "converts on first use" if m.note else "-"
        else:
            state = "ready" if m.ready else "cannot run here"
        print(f"{m.name:<32} {m.kind:<10} {state:<22} {m.note}")
    sock = socket_of(args)
    if running_pid(sock):  # what the running daemon has loaded, and its KV caches
        try:
            _, health = request_json(str(sock), "GET", "/health", api_key=os.environ.get("MINIBATCH_API_KEY"))
        except OSError:
            health = {}
        loaded = health.get("models") or []
        if loaded:
            print(f"\nloaded by the daemon on {sock}:")
            for m in loaded:
                sees = f" · sees images ({m['vision']['source']})" if m.get("vision") else ""
                print(f"  {m['name']:<32} KV cache {kv_text(m)}{sees}")
    from minibatch.engine.models.config import SUPPORTED_MODEL_TYPES

    print(
        "\n--model and a request's `model` take any name above (a bare Ollama name works too: qwen2.5:0.5b), a "
        "Hugging Face model directory, a .gguf file, or a hub id when online; a running daemon loads it on first "
        f"use. Families: {', '.join(SUPPORTED_MODEL_TYPES)}."
    )
    return 0


def cmd_prompt_cache(args) -> int:
    """The running daemon's prompt cache over its socket (so its index stays true), else the folder's files."""
    import json

    sock = socket_of(args)
    key = os.environ.get("MINIBATCH_API_KEY")
    if running_pid(sock):
        path = "/v1/prompt-cache" + (f"?model={urllib.parse.quote(args.model)}" if args.model else "")
        method = "DELETE" if args.clear else "GET"
        status, body = request_json(str(sock), method, path)  # as the socket's own user: it may clear
        if status == 401 and key:  # (--socket-requires-key)
            status, body = request_json(str(sock), method, path, api_key=key)
        if status != 200:
            print(f"minibatchd: {body.get('error', {}).get('message', body)}", file=sys.stderr)
            return 1
    else:
        from minibatch.engine.kv_offload.disk import default_folder, inspect, summary

        folder = Path(args.prompt_cache_dir) if args.prompt_cache_dir else default_folder()
        cache = inspect(folder)
        body = summary(cache, 0, {}) | {"enabled": None, "folder": str(folder)}
        if args.clear:
            listed = [m["identity"] for m in body["models"] if args.model in (None, m["model"], m["identity"])]
            if args.model and not listed:
                print(f"minibatchd: the prompt cache holds no blocks of {args.model!r}", file=sys.stderr)
                return 1
            removed = [cache.clear(None if args.model is None else i) for i in (listed if args.model else [None])]
            body = {"removed_blocks": sum(r[0] for r in removed), "removed_bytes": sum(r[1] for r in removed)}
    if args.json:
        print(json.dumps(body, indent=2))
    elif args.clear:
        print(f"removed {body['removed_blocks']} blocks ({body['removed_bytes'] / 2**20:.1f} MiB)")
    else:
        print(prompt_cache_text(body))
    return 0


def prompt_cache_text(body: dict) -> str:
    """The listing as `minibatchd prompt-cache` prints it."""
    budget = f" of {body['budget_bytes'] / 2**30:.1f} GiB" if body.get("budget_bytes") else ""
    state = {True: "on", False: "off", None: "no daemon running"}[body.get("enabled")]
    lines = [
        f"prompt cache ({state}){' in ' + body['folder'] if body.get('folder') else ''}: {body['blocks']} blocks, "
        f"{body['bytes'] / 2**20:.1f} MiB{budget}"
    ]
    for m in body["models"]:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(m["last_used"])) if m["last_used"] else "-"
        facts = f"{m['kv_cache_type'] or '?'}, blocks of {m['block_size'] or '?'}, {m['weights'] or '?'}"
        loaded = " (loaded)" if m["loaded"] else ""
        lines.append(
            f"  {m['model']:<32} {m['blocks']:>7} blocks {m['bytes'] / 2**20:>9.1f} MiB  last used {used}  "
            f"[{facts}]{loaded}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.own_command_line = argv is None  # the process's own argv, which `ps` shows
    args.argv = sys.argv[1:] if argv is None else list(argv)
    handler = {
        "start": cmd_start,
        "stop": cmd_stop,
        "status": cmd_status,
        "logs": cmd_logs,
        "models": cmd_models,
        "prompt-cache": cmd_prompt_cache,
    }
    try:
        return handler[args.command](args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
