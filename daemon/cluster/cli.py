"""`minibatch-serve`: minibatch replicas on Ray Serve behind one API — start, status, stop, logs.

The options of `minibatchd start` mean the same here, per replica (model,
weights, mode, limits, KV size, threads) or at the ingress (socket, TCP host
and port, API keys); the cluster's own are below. Every option also reads an
environment variable MINIBATCH_<NAME>.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from minibatch.daemon import cli as daemon_cli
from minibatch.daemon.client import request_json
from minibatch.daemon.lifecycle import LifecycleError, ensure_private_dir, running_pid
from minibatch.daemon.paths import default_cluster_log_file, default_cluster_socket

PROG = "minibatch-serve"
CLUSTER_OPTIONS = [
    # flag, type, default, help
    ("--replicas", int, 2, "engine replicas (each one model on one device)"),
    ("--autoscale", str, None, "MIN:MAX replicas, scaled by Ray Serve on requests in flight (instead of --replicas)"),
    ("--address", str, None, "an existing Ray cluster (auto, or ray://HOST:10001); default: start one on this machine"),
    ("--routing", str, "prefix", "prefix (a prompt goes where its start is cached) or least-loaded"),
    ("--spill-threshold", int, 8, "requests in flight beyond the least loaded replica past which a prompt spills over"),
    (
        "--stream-interval-ms",
        float,
        0.0,
        "send each stream's chunks to the ingress at most this often, coalesced (0: token by token)",
    ),
    ("--gpus-per-replica", float, None, "GPUs each replica takes (default: 1 where the cluster has GPUs, else 0)"),
]


def env(flag: str) -> str:
    return daemon_cli.env_name(flag)


def add_socket(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"the ingress's Unix socket (env MINIBATCH_SERVE_SOCKET; default {default_cluster_socket()})",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="minibatch engine replicas on Ray Serve, behind one API")
    sub = ap.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="deploy the replicas and the ingress (in the background unless --foreground)")
    add_socket(start)
    daemon_cli.add_server_options(start, models=False)  # one model per application (docs/daemon.md, Several models)
    for flag, typ, default, help_ in CLUSTER_OPTIONS:
        value = os.environ.get(env(flag))
        start.add_argument(flag, type=typ, default=typ(value) if value else default, help=f"{help_} (env {env(flag)})")
    stop = sub.add_parser("stop", help="drain in-flight requests, stop the replicas, then exit")
    add_socket(stop)
    stop.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for it to exit")
    add_socket(sub.add_parser("status", help="show the cluster: each replica's batch, KV cache and mode"))
    logs = sub.add_parser("logs", help="print the cluster's log")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--log-file", type=Path, default=None)
    return ap


def socket_of(args) -> Path:
    return Path(args.socket) if args.socket else default_cluster_socket()


def parse_autoscale(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--autoscale: expected MIN:MAX (for example 1:4), got {text!r}") from None
    if not 0 < lo <= hi:
        raise ValueError(f"--autoscale: need 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def cluster_config(args, sock: Path):
    from .server import ClusterConfig, default_threads

    autoscale = parse_autoscale(args.autoscale)
    if args.replicas < 1:
        raise ValueError(f"--replicas: must be at least 1, got {args.replicas}")
    if args.routing not in ("prefix", "least-loaded"):
        raise ValueError(f"--routing: must be prefix or least-loaded, got {args.routing!r}")
    if args.spill_threshold < 0:
        raise ValueError(f"--spill-threshold: must be >= 0, got {args.spill_threshold}")
    if not 0 <= args.stream_interval_ms <= 1000:
        raise ValueError(f"--stream-interval-ms: must be in [0, 1000], got {args.stream_interval_ms:g}")
    daemon_cli.check_daemon_options(args)
    engine = daemon_cli.engine_config(args)
    engine.threads = args.threads or default_threads(autoscale[1] if autoscale else args.replicas)
    return ClusterConfig(
        engine=engine,
        socket=sock,
        host=args.host,
        port=args.port,
        guard=daemon_cli.guard_of(args),
        replicas=args.replicas,
        autoscale=autoscale,
        address=args.address,
        routing=args.routing,
        spill_threshold=args.spill_threshold,
        stream_interval_ms=args.stream_interval_ms,
        gpus_per_replica=args.gpus_per_replica,
        shutdown_timeout=args.shutdown_timeout,
        request_timeout=args.request_timeout,
        read_timeout=args.read_timeout,
        start_timeout=args.start_timeout,
        prompt_cache_shared=args.prompt_cache_shared,
        reasoning_format=args.reasoning_format,
        reasoning_budget=args.reasoning_budget,
        media_path=daemon_cli.media_path_of(args),
    )


def cmd_start(args) -> int:
    sock = socket_of(args)
    try:
        ensure_private_dir(sock.parent)
        conf = cluster_config(args, sock)
    except (LifecycleError, ValueError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    pid = running_pid(sock)
    if pid:
        print(f"{PROG}: already running (pid {pid}) on {sock}", file=sys.stderr)
        return 1
    if args.foreground:
        daemon_cli.reexec_without_key(args, "minibatch.daemon.cluster.cli")
        from .server import run

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return asyncio.run(run(conf))
    key = conf.guard.api_keys[0] if conf.guard and conf.guard.api_keys else None
    return daemon_cli.start_background(
        args, sock, key, PROG, "minibatch.daemon.cluster.cli", default_cluster_log_file()
    )


def cmd_status(args) -> int:
    sock = socket_of(args)
    key = os.environ.get("MINIBATCH_API_KEY")
    pid = running_pid(sock)
    if not pid:
        print(f"{PROG}: not running on {sock}")
        return 3
    try:
        hstatus, health = request_json(str(sock), "GET", "/health", api_key=key, timeout=15)
    except OSError as exc:
        print(f"{PROG}: pid {pid} holds the lock but the socket does not answer: {exc}")
        return 1
    cluster = health.get("cluster", {})
    rows = [
        ("pid", pid),
        ("socket", sock),
        ("status", health.get("status")),
        ("model", health.get("model")),
        ("replicas", f"{len(cluster.get('replicas', []))} live (wanted {cluster.get('wanted')})"),
        ("routing", cluster.get("routing")),
        ("mode", health.get("mode")),
    ]
    for k, v in rows:
        print(f"{k:>12}: {v}")
    if hstatus == 200:
        _, stats = request_json(str(sock), "GET", "/v1/engine/stats?steps=0", api_key=key, timeout=15)
        for r in stats.get("replicas", []):
            print(
                f"{'replica':>12}: {r['replica']}  batch {r['running']}/{r['max_num_seqs']}  waiting {r['waiting']}  "
                f"KV {r['kv_usage_percent']:.1f}%  {r['decode_tokens_per_s']:.1f} tok/s  "
                f"prefix hits {100 * r['prefix_cache_hit_rate']:.1f}%  {r['mode']}"
            )
    return 0 if hstatus == 200 else 1


def cmd_stop(args) -> int:
    args.socket = socket_of(args)
    return daemon_cli.cmd_stop(args, PROG)


def cmd_logs(args) -> int:
    args.log_file = args.log_file or default_cluster_log_file()
    return daemon_cli.cmd_logs(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.own_command_line = argv is None
    args.argv = sys.argv[1:] if argv is None else list(argv)
    handler = {"start": cmd_start, "stop": cmd_stop, "status": cmd_status, "logs": cmd_logs}
    try:
        return handler[args.command](args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
