"""Running the daemon: startup checks, the store, listeners, the lease reaper, readiness and stop.

Order of startup: check that nothing but a stale socket is at --socket, the shm directory (huge
pages if asked for) and budget -> take the locks -> adopt pool files left by a previous daemon ->
warn about what will run badly (not tmpfs, memlock; the latter only a note on a machine with no
GPU) -> metrics endpoint -> the fd channel (pool files handed to granted clients) -> bind and
start the gRPC server -> with a store, start joining it -> health SERVING and READY=1.
Order of shutdown (SIGTERM/SIGINT): end Watch streams, their ends written -> stop accepting and
health NOT_SERVING (in one step of the loop), STOPPING=1 -> end waiting Acquires, let in-flight
RPCs finish within shutdown_grace -> close the fd channel -> stop the metrics endpoint -> abort
the fetches from the store in flight, leave the store -> close pool files (they stay: they are
the cache) -> remove the socket and the lock files.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # stubs lag

from ec_daemon.cluster.leader import etcd_endpoints
from ec_daemon.cluster.mooncake import StoreSettings, end_process_left_open
from ec_daemon.cluster.node import ClusterNode
from ec_daemon.cluster.pending import Claims
from ec_daemon.cluster.republish import Republisher
from ec_daemon.cluster.tier import Cluster
from ec_daemon.core.pools import PoolSettings
from ec_daemon.core.sessions import tag
from ec_daemon.core.store import SessionEnd, Store, StoreConfig
from ec_daemon.server import auth, checks, reflection, systemd
from ec_daemon.server.config import Config
from ec_daemon.server.events import EventHub
from ec_daemon.server.fd_channel import FdChannel
from ec_daemon.server.metrics import Metrics, snapshot_on_loop
from ec_daemon.server.service import EncoderCacheService
from ec_daemon.server.validate import Limits
from ec_daemon.server.wire import add_to_server
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb
from ec_protocol.types import WatchEvent

log = logging.getLogger("ecd.server")

# How long a stop waits for the ends of the Watch streams it ended to be written before it
# refuses new calls (see stop): milliseconds, unless a client reads nothing and its stream's
# send buffer is full; such a client gets its end, or not, at the grace's deadline.
STREAM_ENDS_WRITTEN_S = 1.0

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EncoderCache"].full_name
# The health service's name for the store (--store-master): SERVING while its master answers,
# NOT_SERVING while it does not; the daemon's own health is SERVING either way (it serves
# locally). Unknown without a store.
CLUSTER_HEALTH = "ecd.cluster"


@dataclass
class Daemon:
    """Everything the running daemon holds, so that stop() can undo it in order."""

    config: Config
    store: Store
    hub: EventHub
    server: grpc.aio.Server
    health: health_aio.HealthServicer
    locks: list[checks.DirectoryLock]
    service: EncoderCacheService
    metrics: Metrics
    metrics_server: WSGIServer | None = None
    channel: FdChannel | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    cluster: Cluster | None = None


def cluster_node(config: Config) -> ClusterNode:
    """The node's part in the Mooncake Store (--store-master), not joined yet: it joins on its
    own thread once started, and keeps trying while the master cannot be reached."""
    # --tcp is HOST:PORT, HOST an IPv6 address in brackets
    host = config.transfer_host or config.tcp.rpartition(":")[0].strip("[]")
    if not host or host in ("0.0.0.0", "::"):
        raise checks.StartupError(
            "--store-master needs the address the store's other clients reach this node at: "
            "set --transfer-host (or --tcp HOST:PORT on that address)"
        )
    settings = StoreSettings(
        config.store_master,
        config.store_metadata,
        host,
        config.store_segment_bytes,
        config.store_protocol,
        config.store_devices,
    )
    return ClusterNode(settings)


def build_store(
    config: Config, budget: int, hub: EventHub, cluster: Cluster | None = None
) -> Store:
    pools = PoolSettings(
        shm_dir=config.shm_dir,
        max_bytes=budget,
        eviction=config.eviction,
        entries_per_pool=config.entries_per_pool,
        max_pool_bytes=config.max_pool_bytes,
        file_mode=config.pool_mode,
        file_gid=checks.group_id(config.pool_group),
    )
    publish = hub.publish
    if cluster is not None:

        def publish(event: WatchEvent) -> None:
            hub.publish(event)
            cluster.on_event(event)

    store = Store(
        StoreConfig(pools, config.lease_ttl, config.pending_timeout),
        clock=time.monotonic,
        publish=publish,
        cluster=cluster.stats if cluster is not None else lambda: None,
    )
    if cluster is not None:
        cluster.bind(store, hub.waits, hub.wait_for)
    return store


async def start(config: Config) -> Daemon:
    guard, page_tokens = load_credentials(config)
    tls = tcp_credentials(config)
    check_directories(config)
    locks = [
        checks.DirectoryLock(config.shm_dir / ".ecd.lock", f"shm directory {config.shm_dir}"),
        checks.DirectoryLock(
            config.socket.with_name(config.socket.name + ".lock"), f"socket {config.socket}"
        ),
    ]
    budget = checks.resolve_budget(config.shm_dir, config.max_bytes, config.entries_per_pool)
    for lock in locks:
        lock.acquire()
    hub = EventHub()
    cluster = build_cluster(config)
    store = build_store(config, budget, hub, cluster)
    adopt_pools(store)
    warn_environment(config, budget)
    metrics = Metrics(snapshot_on_loop(store, asyncio.get_running_loop()))
    metrics.page_tokens = page_tokens
    metrics_server = (
        metrics.serve(config.metrics_host, config.metrics_port) if config.metrics_port else None
    )
    server, service, channel, health_servicer = build_server(
        config, store, hub, metrics, guard, cluster
    )
    listen(server, config, tls)
    await server.start()
    secure_socket(config)

    daemon = Daemon(
        config,
        store,
        hub,
        server,
        health_servicer,
        locks,
        service,
        metrics,
        metrics_server,
        channel=channel,
        cluster=cluster,
    )
    await begin_serving(daemon)
    log_serving(daemon, budget, tls is not None, guard.enabled)
    return daemon


def log_serving(daemon: Daemon, budget: int, tls: bool, tokens: bool) -> None:
    config = daemon.config
    log.info(
        "serving",
        extra={
            "socket": str(config.socket),
            "tcp": config.tcp or "off",
            "tls": "mutual" if config.tls_client_ca else "on" if tls else "off",
            "auth": "tokens+acl" if config.acl_file else "tokens" if tokens else "off",
            "metrics": (
                f"{config.metrics_host}:{config.metrics_port}" if daemon.metrics_server else "off"
            ),
            "store": config.store_master or "off",
            "shm_dir": str(config.shm_dir),
            "max_bytes": budget,
            "pools": len(daemon.store.engine_ids()),
            "boot_epoch": daemon.store.boot_epoch,
            "pid": os.getpid(),
        },
    )


def load_credentials(config: Config) -> tuple[auth.Guard, frozenset[str] | None]:
    """The guard of the token file and access list, and the metrics page's tokens; a file that
    cannot be used stops the start."""
    try:
        guard = auth.guard_from_files(config.token_file, config.acl_file, config.trust_all_tokens)
        page_tokens = metrics_tokens(config)
    except auth.AuthConfigError as exc:
        raise checks.StartupError(str(exc)) from exc
    if guard.enabled and guard.rules is None:
        log.warning(
            "every token is an admin (--trust-all-tokens, no --acl-file): any token may evict, "
            "delete and drop every pool",
            extra={"token_file": str(config.token_file)},
        )
    return guard, page_tokens


def check_directories(config: Config) -> None:
    """Nothing but a stale socket at --socket; a usable shm directory (of huge pages, if asked)."""
    checks.check_socket_path(config.socket)
    checks.check_shm_dir(config.shm_dir)
    if config.hugepages:
        checks.check_hugepages(
            config.shm_dir,
            checks.parse_mounts(checks.MOUNTS.read_text()),
            checks.shmem_huge_policy(),
        )


def build_cluster(config: Config) -> Cluster | None:
    """The cluster tier with --store-master (not started yet); None without."""
    if not config.store_master:
        return None
    node = cluster_node(config)
    return Cluster(
        node,
        Claims(node),
        Republisher(node, config.republish_rate, config.republish_every),
        config.pull_timeout,
    )


def warn_environment(config: Config, budget: int) -> None:
    """Say what will run badly here (not a tmpfs, memlock), and what would on a GPU."""
    findings = checks.environment_findings(config.shm_dir, budget, checks.gpu_present())
    for check, problem in findings.warnings.items():
        log.warning("startup check: running, but badly", extra={"check": check, "problem": problem})
    for check, problem in findings.notes.items():
        log.info(
            "startup check: no GPU on this machine, so a problem only for GPU engines",
            extra={"check": check, "problem": problem},
        )


def build_server(
    config: Config,
    store: Store,
    hub: EventHub,
    metrics: Metrics,
    guard: auth.Guard,
    cluster: Cluster | None,
) -> tuple[grpc.aio.Server, EncoderCacheService, FdChannel | None, health_aio.HealthServicer]:
    """The gRPC server with its services (not listening yet), and the fd channel granted
    clients' pool files are handed over on."""
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
    )
    if config.pool_group and config.acl_file is not None:
        log.warning(
            "pool_group gives every member of its group every pool's bytes by the files' paths, "
            "whatever the access list grants; clients of other users need no pool_group (the "
            "daemon hands them the pools they are granted)",
            extra={"pool_group": config.pool_group},
        )
    channel = FdChannel.listen(
        store, config.socket, config.socket_mode, checks.group_id(config.socket_group)
    )
    service = EncoderCacheService(
        store,
        hub,
        Limits(max_batch=config.max_batch),
        observe=metrics.observe,
        guard=guard,
        cluster=cluster,
        tickets=channel.tickets if channel is not None else None,
    )
    add_to_server(service, server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable(
        server, (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    )
    return server, service, channel, health_servicer


def listen(server: grpc.aio.Server, config: Config, tls: grpc.ServerCredentials | None) -> None:
    """The server's ports: the Unix socket, and --tcp (TLS if given)."""
    bind_unix_socket(server, config)
    if config.tcp and tls is not None:
        server.add_secure_port(config.tcp, tls)
    elif config.tcp:
        log.warning(
            "TCP without TLS: anyone who can reach the port can use the cache; use --tls-cert",
            extra={"tcp": config.tcp},
        )
        server.add_insecure_port(config.tcp)


async def begin_serving(daemon: Daemon) -> None:
    """Join the store (with one), health SERVING, the background tasks, READY=1."""
    health = daemon.health
    if daemon.cluster is not None:
        daemon.cluster.start()
        daemon.tasks.append(asyncio.create_task(follow_cluster(health, daemon.cluster)))
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    store = daemon.store
    daemon.tasks.append(asyncio.create_task(reap_sessions(store)))
    daemon.tasks.append(asyncio.create_task(settle_producers(store)))
    daemon.tasks.append(asyncio.create_task(check_pools(store, daemon.config.pool_check_interval)))
    interval = systemd.watchdog_interval_s()
    if interval:
        daemon.tasks.append(asyncio.create_task(feed_watchdog(interval)))
    systemd.notify("READY=1")


def metrics_tokens(config: Config) -> frozenset[str] | None:
    """The tokens of --metrics-token-file; None without one."""
    if config.metrics_token_file is None:
        return None
    return frozenset(auth.load_tokens(config.metrics_token_file))


def reload_credentials(daemon: Daemon) -> None:
    """SIGHUP: read the token file, the access list and the metrics token file again, all or
    nothing: one that cannot be used leaves those in use as they were (an error names the file
    and why). The log says what changed by token name, never a token."""
    config = daemon.config
    if config.token_file is None and config.metrics_token_file is None:
        log.info("SIGHUP: nothing to reload (no --token-file nor --metrics-token-file)")
        return
    try:
        guard = auth.guard_from_files(config.token_file, config.acl_file, config.trust_all_tokens)
        page_tokens = metrics_tokens(config)
    except auth.AuthConfigError as exc:
        log.error(
            "SIGHUP: not reloaded, the token files and access list in use are kept",
            extra={"reason": str(exc)},
        )
        return
    changes = daemon.service.update_guard(guard)
    daemon.metrics.page_tokens = page_tokens
    log.info(
        "SIGHUP: token files and access list reloaded",
        extra={
            "added": ",".join(changes.added),
            "removed": ",".join(changes.removed),
            "rotated": ",".join(changes.rotated),
            "rules": "off" if changes.rules is None else changes.rules,
            "metrics_tokens": "off" if page_tokens is None else len(page_tokens),
        },
    )


def adopt_pools(store: Store) -> None:
    """Adopt the pool files a previous daemon left, the garbage collector paused: what adoption
    builds (an entry, its extents, its spec) lives as long as its entry, and collections while
    100,000 entries are built only traverse them again and again (about a third of the time,
    docs/performance.md, *A warm restart*). They are then frozen out of later collections, which
    would otherwise traverse them all once more during the first calls served."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        store.adopt_pools()
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def tcp_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS for the TCP port (mutual when a client CA is given), or None for plain TCP."""
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_client_ca is not None:
            raise checks.StartupError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if config.tls_cert is None or config.tls_key is None:
        raise checks.StartupError("TLS needs both --tls-cert and --tls-key")
    if not config.tcp:
        raise checks.StartupError("--tls-cert is for the TCP port: add --tcp HOST:PORT")
    try:
        chain = config.tls_cert.read_bytes()
        key = config.tls_key.read_bytes()
        ca = config.tls_client_ca.read_bytes() if config.tls_client_ca else None
    except OSError as exc:
        raise checks.StartupError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=ca, require_client_auth=ca is not None
    )


def bind_unix_socket(server: grpc.aio.Server, config: Config) -> None:
    config.socket.parent.mkdir(parents=True, exist_ok=True)
    # A socket at the path is stale (checks.check_socket_path), and we hold the socket lock, so
    # no daemon starting meanwhile made it live.
    config.socket.unlink(missing_ok=True)
    server.add_insecure_port(f"unix:{config.socket}")


def secure_socket(config: Config) -> None:
    os.chmod(config.socket, config.socket_mode)
    gid = checks.group_id(config.socket_group)
    if gid is not None:
        os.chown(config.socket, -1, gid)


async def reap_sessions(store: Store) -> None:
    """End sessions whose lease ran out, a few times per TTL so nothing outlives it by much;
    free what removed entries held once their readers' lock pins are gone; tell evictions."""
    period = min(store.lease_ttl_s / 4, 1.0)
    while True:
        await asyncio.sleep(period)
        store.reclaim()
        store.summarize_evictions()
        for end in store.expire_sessions():
            log_session_end("session lease expired", end)


def log_session_end(message: str, end: SessionEnd) -> None:
    extra = {"session": tag(end.session_id), "client": end.client, "pid": end.pid}
    log.warning(message, extra={**extra, "aborted": end.aborted, "released": end.released})


# How often the daemon looks for sessions whose process died (life marks) and entries PENDING too
# long: what a waiter for another's encode waits at most, past its producer's death. One
# F_OFD_GETLK per session and pool it opened, and a look at each PENDING entry.
SETTLE_PERIOD_S = 0.2


async def settle_producers(store: Store) -> None:
    """Settle the fate of entries whose producer will not: end the sessions whose process died
    (their PENDING entries aborted at once, not one lease later), abort entries PENDING past
    the pending timeout (docs/design.md §4, *Single flight*)."""
    while True:
        await asyncio.sleep(SETTLE_PERIOD_S)
        for end in store.end_dead_sessions():
            log_session_end("session's process is gone (its life mark went)", end)
        # One line per pool and producer, never one per entry (nor any key).
        for (engine_id, producer), aborted in Counter(store.abort_stale_pending()).items():
            log.warning(
                "PENDING entries aborted: not committed within the pending timeout (their "
                "producer is stuck, or encodes longer than that: raise --pending-timeout)",
                extra={
                    "engine_id": engine_id,
                    "client": producer,
                    "aborted": aborted,
                    "timeout_s": store.config.pending_timeout_s,
                },
            )


async def check_pools(store: Store, interval_s: float) -> None:
    """Notice pool files truncated or overwritten behind the daemon's back (see verify_pools)."""
    while True:
        await asyncio.sleep(interval_s)
        for engine_id in store.verify_pools():
            log.error(
                "pool refused: its file changed under the daemon", extra={"engine_id": engine_id}
            )


async def follow_cluster(health: health_aio.HealthServicer, cluster: Cluster) -> None:
    """Keep the store's health status (CLUSTER_HEALTH) the node's, and settle what waits for a
    master that does not answer: checked every second."""
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    while True:
        cluster.settle()
        await health.set(CLUSTER_HEALTH, serving if cluster.connected else not_serving)
        await asyncio.sleep(1.0)


async def feed_watchdog(interval_s: float) -> None:
    while True:
        systemd.notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)


async def stop(daemon: Daemon) -> None:
    log.info("stopping", extra={"grace_s": daemon.config.shutdown_grace})
    # server.stop refuses new calls at once and waits for in-flight ones, up to the grace. Two
    # kinds of call would only ever end at its deadline, so they are ended here: Watch streams
    # (they never end by themselves), and Acquires waiting on keys (no producer can commit any
    # more once new calls are refused), which are answered UNAVAILABLE (shutting_down: nothing
    # pinned, safe to retry) for their clients to wait on at the next daemon. The grace is left
    # to calls that are doing work. Waiting out the grace here was what made a restart take
    # seconds, longer than clients would wait for the next daemon.
    #
    # Watch streams end first, and server.stop begins only once their ends are written: on each
    # connection a stream's end then comes before server.stop's GOAWAY and PING, and grpc closes
    # the connection only after the client answered that PING, so after it read the end. The
    # other way round, the connection closed as the last stream ended, and a client whose own
    # write (a PING's answer, a window update) came after that lost the end waiting in its
    # socket to the write's EPIPE: its stream failed with "Stream removed" instead of ending.
    daemon.hub.shut_down()
    await daemon.hub.streams_ended(STREAM_ENDS_WRITTEN_S)
    # Refusing new calls begins in the same step of the loop as NOT_SERVING goes out (stop's
    # task is scheduled first), so a client that reacts to NOT_SERVING finds its next call
    # refused rather than served by a daemon on its way out.
    stopped = asyncio.ensure_future(daemon.server.stop(daemon.config.shutdown_grace))
    await daemon.health.enter_graceful_shutdown()
    systemd.notify("STOPPING=1")
    daemon.hub.end_waits()
    await stopped
    if daemon.channel is not None:
        await daemon.channel.close()
    if daemon.metrics_server is not None:
        # shutdown() waits for the serving thread's next poll: off the loop, so it cannot stall it.
        await asyncio.to_thread(daemon.metrics_server.shutdown)
        daemon.metrics_server.server_close()
    for task in daemon.tasks:
        task.cancel()
    if daemon.cluster is not None:  # before the pool files go: it reads them
        await daemon.cluster.stop(daemon.config.shutdown_grace)
    daemon.store.close(drop_pools=daemon.config.drop_pools_on_exit)
    daemon.config.socket.unlink(missing_ok=True)
    for lock in daemon.locks:
        lock.release(remove=True)
    log.info("stopped")


class ServerDied(RuntimeError):
    """The gRPC server ended without being asked to; the daemon exits so that its supervisor
    restarts it (warm: pools are re-adopted)."""


async def serve(config: Config) -> None:
    daemon = await start(config)
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.stopping.set)
    loop.add_signal_handler(signal.SIGHUP, reload_credentials, daemon)
    # grpc.aio's server can end by itself (one call whose :path is not UTF-8 makes its loop raise
    # and shut down): a daemon alive but deaf would be the worst outcome, so that ends it too.
    terminated = asyncio.ensure_future(daemon.server.wait_for_termination())
    stopping = asyncio.ensure_future(daemon.stopping.wait())
    await asyncio.wait({terminated, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not daemon.stopping.is_set():
        log.error("gRPC server ended by itself; exiting so that the supervisor restarts the daemon")
        daemon.stopping.set()
        await stop(daemon)
        raise ServerDied("the gRPC server ended by itself")
    await stop(daemon)
    terminated.cancel()


def run(config: Config) -> None:
    uvloop.run(serve(config))
    if etcd_endpoints(config.store_master):  # its store client was left open
        end_process_left_open()
