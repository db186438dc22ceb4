"""Run the cluster from this process: lock, Ray, the replicas on Serve, the ingress; drain on SIGTERM.

By default this process starts a Ray cluster of its own on this machine (and it
ends with the process); `--address` joins an existing one (`ray start` on each
machine, then `auto` or `ray://HOST:10001`), and stopping then deletes only the
replicas this process deployed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve

from minibatch.daemon.guard import Guard
from minibatch.daemon.lifecycle import InstanceLock, LifecycleError
from minibatch.daemon.server import app_runner, listen
from minibatch.engine.factory import EngineConfig

from .ingress import create_app
from .replica import EngineReplica
from .replica_set import ReplicaSet

log = logging.getLogger("minibatch.cluster")
APP_NAME = "minibatch"
ROUTER_CLASS = "minibatch.daemon.cluster.router:PrefixRouter"


@dataclass
class ClusterConfig:
    engine: EngineConfig
    socket: Path
    host: str | None = None
    port: int | None = None
    guard: Guard | None = None
    replicas: int = 2
    autoscale: tuple[int, int] | None = None  # (min, max) replicas, scaled by Serve on requests in flight
    address: str | None = None  # an existing Ray cluster; None: start one here
    routing: str = "prefix"  # or "least-loaded"
    spill_threshold: int = 8
    stream_interval_ms: float = 0.0  # coalesce a stream's chunks over this window (0: token by token)
    gpus_per_replica: float | None = None  # None: 1 where the cluster has GPUs and --device allows
    shutdown_timeout: float = 30.0
    request_timeout: float = 600.0
    read_timeout: float = 30.0
    start_timeout: float = 600.0
    prompt_cache_shared: bool = False  # every key's requests share cached prefixes (the replicas' state.cache_salt)
    # the replicas' daemons' own settings, as minibatchd's options set them
    reasoning_format: str = "auto"
    reasoning_budget: int = -1
    media_path: str | None = None

    @property
    def max_replicas(self) -> int:
        return self.autoscale[1] if self.autoscale else self.replicas

    @property
    def wanted(self) -> str:
        return f"{self.autoscale[0]}:{self.autoscale[1]}" if self.autoscale else str(self.replicas)


def default_threads(replicas: int) -> int:
    """Each replica's CPU thread budget when none is given: this machine's cores shared out."""
    return max(1, (os.cpu_count() or 1) // max(1, replicas))


def deployment(conf: ClusterConfig, gpus: float):
    """The replicas' Serve application: one model and one device each, routed by PrefixRouter."""
    from ray.serve.config import RequestRouterConfig

    # The replicas share the disk prompt cache's folder, each process bounding what it writes: a share each keeps
    # the folder within --prompt-cache-gb (docs/cluster.md)
    eng = dataclasses.replace(conf.engine, prompt_cache_gb=conf.engine.prompt_cache_gb / conf.max_replicas)
    options: dict = dict(
        name="engine",
        ray_actor_options={"num_cpus": eng.threads or 1, "num_gpus": gpus},
        # what one engine takes in (a batch and its queue); Serve holds the rest at the handle
        max_ongoing_requests=eng.max_num_seqs + eng.max_queue,
        max_queued_requests=eng.max_queue,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=conf.shutdown_timeout + 10,
        max_constructor_retry_count=3 * conf.max_replicas,
        logging_config={"enable_access_log": False},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"spill_threshold": conf.spill_threshold},
        ),
    )
    if conf.autoscale:
        lo, hi = conf.autoscale
        options["autoscaling_config"] = {
            "min_replicas": lo,
            "max_replicas": hi,
            "initial_replicas": lo,
            # a replica is busy enough when a full batch runs on it; requests waiting beyond that add replicas
            "target_ongoing_requests": eng.max_num_seqs,
        }
    else:
        options["num_replicas"] = conf.replicas
    return serve.deployment(EngineReplica, **options).bind(
        eng,
        conf.request_timeout,
        conf.read_timeout,
        conf.shutdown_timeout,
        conf.start_timeout,
        conf.stream_interval_ms / 1000,
        conf.prompt_cache_shared,
        conf.reasoning_format,
        conf.reasoning_budget,
        conf.media_path,
    )


def connect(conf: ClusterConfig) -> float:
    """Start or join Ray and Serve (on the main thread); the GPUs each replica takes."""
    if conf.address:
        ray.init(address=conf.address, logging_level=logging.WARNING)
    else:
        cpus = max(os.cpu_count() or 1, conf.max_replicas * (conf.engine.threads or 1))
        # requests and answers pass as small messages: a small object store, not 30% of memory in /dev/shm
        ray.init(
            address="local",
            num_cpus=cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
            object_store_memory=256 * 2**20,
        )
    serve.start(proxy_location="Disabled")  # the ingress is ours: no Serve HTTP proxy
    if conf.gpus_per_replica is not None:
        return conf.gpus_per_replica
    has_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    return 1.0 if has_gpu and conf.engine.device in ("auto", "cuda") else 0.0


async def run(conf: ClusterConfig) -> int:
    loop = asyncio.get_running_loop()
    lock = InstanceLock(conf.socket, "minibatch-serve")
    try:
        lock.acquire()
    except LifecycleError as exc:
        log.error("%s", exc)
        return 1
    cluster = ReplicaSet(conf.engine.model, conf.routing, conf.wanted, conf.read_timeout)
    guard = conf.guard or Guard()
    runner = app_runner(create_app(cluster, guard), conf.read_timeout)
    stop = asyncio.Event()
    started_ray = False
    try:
        await listen(runner, conf.socket, conf.host, conf.port, guard)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        began = time.perf_counter()
        log.info("listening on %s (pid %d); starting Ray", conf.socket, os.getpid())
        try:
            gpus = await loop.run_in_executor(None, connect, conf)
            started_ray = True
            # Ray's core worker installs a failure-signal handler for SIGTERM that logs a stack and arms a
            # 3 s alarm, which would kill a drain that takes longer: ours again, over it.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            log.info(
                "deploying %s replica(s) of %s, %d CPU thread(s) and %g GPU each, routing: %s",
                conf.wanted,
                conf.engine.model,
                conf.engine.threads or 1,
                gpus,
                conf.routing,
            )
            deploy = loop.run_in_executor(
                None, lambda: serve.run(deployment(conf, gpus), name=APP_NAME, route_prefix=None)
            )
            done, _ = await asyncio.wait(
                [deploy, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED
            )
            if deploy not in done:
                log.info("stopped while the replicas were starting")
                return 0
            cluster.attach(deploy.result())
        except Exception as exc:
            cluster.status, cluster.load_error = "failed", f"{type(exc).__name__}: {exc}"
            log.error("could not start the replicas: %s", cluster.load_error)
            return 1
        await cluster.views("GET", "/health")  # builds the handle's router, so the replicas are known at once
        cluster.status = "ready"
        log.info("ready in %.1f s: %d replica(s) %s", time.perf_counter() - began, len(cluster.live()), cluster.live())
        watch = asyncio.ensure_future(cluster.watch())
        try:
            await stop.wait()
            await drain(cluster, conf.shutdown_timeout)
        finally:
            watch.cancel()
        return 0
    finally:
        await runner.cleanup()
        if started_ray:
            await loop.run_in_executor(None, teardown, conf)
        lock.release()
        log.info("stopped")


async def drain(cluster: ReplicaSet, timeout: float) -> None:
    """Refuse new requests and let those in flight finish, for up to `timeout` s; then the replicas stop
    (each drains its own engine)."""
    cluster.status = "draining"
    log.info("draining: %d request(s) in flight (up to %.0f s)", cluster.in_flight, timeout)
    deadline = time.monotonic() + timeout
    while cluster.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if cluster.in_flight:
        log.warning("drain timeout: %d request(s) still in flight end with the replicas", cluster.in_flight)


def teardown(conf: ClusterConfig) -> None:
    try:
        if conf.address:
            serve.delete(APP_NAME)  # another's cluster: only what we deployed
        else:
            serve.shutdown()
    finally:
        ray.shutdown()
