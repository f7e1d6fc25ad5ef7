"""The `ecd` command: `ecd serve` runs the daemon; the others are client tools for operators.

    ecd serve --socket /run/ecd/ecd.sock --shm-dir /dev/shm --max-bytes 8GiB
    ecd health [--service S] | ecd stats [POOL] | ecd ls [POOL] | ecd evict|delete POOL KEY...
    ecd drop POOL [--force] | ecd --version

Client commands take --address (default: ECD_ADDRESS, else the default socket), --token and
--tls-ca/--tls-cert/--tls-key (defaults: ECD_TOKEN or ECD_TOKEN_FILE, ECD_TLS_*), --timeout and
--json.
Exit status: 0 success, 1 the daemon answered with an error or is not SERVING, 2 bad usage or
configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from ec_daemon.server import config as config_module
from ec_daemon.server.checks import StartupError
from ec_protocol import __version__
from ec_protocol.address import default_target
from ec_protocol.errors import EcdError
from ec_protocol.types import ClusterStats, ItemResult, RefusedPool, Role
from ec_protocol.units import format_size, parse_size

# The client library is imported by the commands that use it when they run: `ecd serve` loads
# none of it (tests/unit/test_layering.py).
if TYPE_CHECKING:
    from ec_client import Client


def display_key(key: bytes) -> str:
    """A key as text when it is printable UTF-8, else as 0x-prefixed hex."""
    try:
        text = key.decode()
    except UnicodeDecodeError:
        return "0x" + key.hex()
    return text if text.isprintable() and not text.startswith("0x") else "0x" + key.hex()


def parse_key(text: str) -> bytes:
    """The inverse of display_key: 0x-prefixed hex, else UTF-8; a usage error if the hex is not."""
    if not text.startswith("0x"):
        return text.encode()
    try:
        return bytes.fromhex(text[2:])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a key: after 0x, expected an even number of hex digits"
        ) from None


def to_json(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, bytes):
        return display_key(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def emit(args: argparse.Namespace, data: Any, human: Callable[[], str]) -> None:
    print(json.dumps(to_json(data), indent=2) if args.json else human())


# ---- commands ------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from ec_daemon.server import logs, server

    try:
        config, sources = config_module.load(vars(args), os.environ, args.config)
    except config_module.ConfigError as exc:
        print(f"ecd: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_format, config.log_level)
    # Before --print-config too: a typo'd variable is why a setting shows its default there.
    for variable in config_module.unknown_env(os.environ):
        logging.getLogger("ecd.config").warning(
            "unknown environment variable, ignored: no setting has this name",
            extra={"variable": variable},
        )
    if args.print_config:
        print(
            config_module.reference() if args.markdown else config_module.describe(config, sources)
        )
        return 0
    try:
        server.run(config)
    except StartupError as exc:
        # Through the logger, so that with --log-format json this line is JSON like the rest.
        logging.getLogger("ecd.server").error("cannot start", extra={"reason": str(exc)})
        return 2
    except server.ServerDied:
        return 1  # logged already; non-zero so that systemd or Kubernetes restarts the daemon
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from ec_client import check_health

    target = args.address or default_target()
    try:
        status = check_health(target, service=args.service, **connection(args))
    except EcdError as exc:
        if exc.code == grpc.StatusCode.NOT_FOUND:  # Health.Check's answer for a service it lacks
            status = f"SERVICE_UNKNOWN (ecd at {target} has no health service {args.service!r})"
        else:
            status = f"UNREACHABLE ({exc.message})"
    emit(args, {"status": status, "target": target}, lambda: status)
    return 0 if status == "SERVING" else 1


def connection(args: argparse.Namespace) -> dict[str, Any]:
    """How a client command reaches the daemon (`client_arguments`): its timeout, token and TLS
    files; what is not given comes from the environment, as for every client (a --tls-* flag
    over its own ECD_TLS_* variable)."""
    from ec_client import TLSFiles

    flags = (args.tls_ca, args.tls_cert, args.tls_key)
    tls = None
    if any(flags):
        env = [os.environ.get(f"ECD_TLS_{name}") for name in ("CA", "CERT", "KEY")]
        tls = TLSFiles(
            *(flag or variable or None for flag, variable in zip(flags, env, strict=True))
        )
    return {"timeout_s": args.timeout, "token": args.token, "tls": tls}


def admin_client(args: argparse.Namespace) -> Client:
    """A session for an operator command; a daemon that cannot be reached fails it at once when
    a connection shows why (no socket there, TLS refused), naming the address."""
    from ec_client import Client, check_health

    reach = connection(args)
    check_health(args.address, **reach)
    return Client(
        args.address,
        name="ecd-cli",
        role=Role.ADMIN,
        keepalive=False,
        connect_timeout_s=reach.pop("timeout_s"),
        **reach,
    )


def cmd_stats(args: argparse.Namespace) -> int:
    with admin_client(args) as client:
        opened_in = client.boot_epoch
        stats = client.stats(args.engine or "")
    # Not this command's own session: the daemon counted it if it is the one the session was
    # opened in (one that restarted meanwhile answered before the session was opened again).
    if stats.boot_epoch == opened_in:
        stats = dataclasses.replace(stats, sessions=stats.sessions - 1)

    def human() -> str:
        head = (
            f"ecd {stats.version}  epoch {stats.boot_epoch}  up {stats.uptime_s:.0f}s  "
            f"sessions {stats.sessions}  lease expiries {stats.lease_expiries}\n"
            f"budget {format_size(stats.capacity_bytes)} of {format_size(stats.max_bytes)} in "
            f"pool capacity; pool files {format_size(stats.reserved_bytes)} (with headers and "
            "slot tables)"
        )
        rows = [
            (
                p.engine_id + (" (ephemeral)" if p.ephemeral else ""),
                format_size(p.capacity_bytes),
                format_size(p.reserved_bytes),
                f"{100 * (1 - p.free_blocks / p.num_blocks):.1f}%",
                f"{p.entries_ready}/{p.max_entries}",
                p.entries_pending,
                p.pins,
                p.entries_locked,
                p.hits,
                p.misses,
                p.evictions,
                f"{p.evictions_for_space}/{p.evictions_for_entries}",
                p.no_space,
                f"{p.remote_hits}/{p.remote_misses}",
                format_size(p.remote_bytes),
                p.compat_key or "-",  # last: the longest, of any length
            )
            for p in stats.pools
        ]
        headers = (
            "POOL",
            "CAPACITY",
            "FILE",
            "USED",
            "READY/MAX",
            "PENDING",
            "PINS",
            "LOCKED",
            "HITS",
            "MISSES",
            "EVICTIONS",
            "FOR_SPACE/ENTRIES",
            "NO_SPACE",
            "REMOTE_HITS/MISSES",
            "REMOTE_BYTES",
            "COMPAT_KEY",
        )
        pools = table(headers, rows) if rows else "(no pools)"
        store = f"\n{cluster_line(stats.cluster)}" if stats.cluster is not None else ""
        return f"{head}{store}\n\n{pools}{refused_table(stats.refused)}"

    emit(args, stats, human)
    return 0


def refused_table(refused: Sequence[RefusedPool]) -> str:
    """The pool files the daemon refused, after a table of the pools it serves ("" if none)."""
    if not refused:
        return ""
    rows = [(r.engine_id, r.path, r.reason) for r in refused]
    return "\n\nrefused pool files, kept for inspection (`ecd drop POOL` removes one):\n" + table(
        ("POOL", "FILE", "REASON"), rows
    )


def cluster_line(c: ClusterStats) -> str:
    state = "connected" if c.connected else f"NOT CONNECTED ({c.error})"
    led = ""
    if c.master != c.leader:  # several masters: the one that leads
        led = f" (leader {c.leader or 'unknown'}, {c.leader_changes} leader changes)"
    return (
        f"store {c.master}{led} {state}; published {c.published}, already stored "
        f"{c.already_stored}, unpublishable {c.unpublishable}, gone {c.gone}, failed "
        f"{c.publish_failures} (retried {c.publishes_retried}), "
        f"dropped {c.dropped}; lookups failed {c.lookup_failures}; claims {c.claims} (lost "
        f"{c.claims_lost}), waits for other nodes hit {c.waits_hit}, missed {c.waits_missed}; "
        f"republished {c.republished} in {c.republish_batches} batches{republished_at(c)}"
    )


def republished_at(c: ClusterStats) -> str:
    """When the last republish that put entries ended (UTC, as the daemon's log lines say)."""
    if not c.last_republish:
        return ""
    return time.strftime(", the last at %Y-%m-%dT%H:%M:%SZ", time.gmtime(c.last_republish))


def cmd_ls(args: argparse.Namespace) -> int:
    if args.engine is None:
        return list_pools(args)
    with admin_client(args) as client:
        entries = list(client.iter_entries(args.engine))

    def human() -> str:
        rows = [
            (
                e.state.value.upper(),
                format_size(e.spec.nbytes),
                e.spec.dtype,
                "x".join(map(str, e.spec.shape)),
                len(e.extents),
                e.pins,
                f"{e.age_s:.1f}s",
                e.producer,
                display_key(e.key),  # last: up to 256 bytes (512 hex digits), padding no other
            )
            for e in entries
        ]
        headers = ("STATE", "SIZE", "DTYPE", "SHAPE", "EXTENTS", "PINS", "AGE", "PRODUCER", "KEY")
        return table(headers, rows) if rows else "(no entries)"

    emit(args, entries, human)
    return 0


def list_pools(args: argparse.Namespace) -> int:
    """ecd ls with no pool: a row per pool, what `ecd ls POOL` would list in it; then the pool
    files the daemon refused, with why."""
    with admin_client(args) as client:
        stats = client.stats()
    pools = stats.pools
    listed: list[dict[str, object]] = [
        {
            "engine_id": p.engine_id,
            "entries_ready": p.entries_ready,
            "entries_pending": p.entries_pending,
            "bytes_ready": p.bytes_ready,
            "capacity_bytes": p.capacity_bytes,
            "block_size_bytes": p.block_size_bytes,
            "ephemeral": p.ephemeral,
        }
        for p in pools
    ]
    listed += [
        {"engine_id": r.engine_id, "refused": r.reason, "path": r.path} for r in stats.refused
    ]

    def human() -> str:
        rows = [
            (
                p.engine_id + (" (ephemeral)" if p.ephemeral else ""),
                p.entries_ready,
                p.entries_pending,
                format_size(p.bytes_ready),
                format_size(p.capacity_bytes),
                format_size(p.block_size_bytes),
            )
            for p in pools
        ]
        headers = ("POOL", "READY", "PENDING", "BYTES", "CAPACITY", "BLOCK")
        return (table(headers, rows) if rows else "(no pools)") + refused_table(stats.refused)

    emit(args, listed, human)
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    from ec_client import Client

    return drop_entries(args, Client.evict)


def cmd_delete(args: argparse.Namespace) -> int:
    from ec_client import Client

    return drop_entries(args, Client.delete)


def drop_entries(
    args: argparse.Namespace, drop: Callable[[Client, str, list[bytes]], list[ItemResult]]
) -> int:
    """ecd evict / ecd delete: a table of what happened to each key; exit 1 if any failed."""
    with admin_client(args) as client:
        results = drop(client, args.engine, args.keys)
    emit(
        args,
        results,
        lambda: table(
            ("KEY", "RESULT", "MESSAGE"),
            [(display_key(r.key), r.status.value, r.message) for r in results],
        ),
    )
    return 0 if all(not r.status.is_error for r in results) else 1


def cmd_drop(args: argparse.Namespace) -> int:
    """ecd drop: delete a pool and its file, giving its capacity back to the budget."""
    with admin_client(args) as client:
        dropped = client.drop_pool(args.engine, args.force)
    emit(
        args,
        {"engine_id": args.engine, "entries_dropped": dropped},
        lambda: f"dropped pool {args.engine!r} and its {dropped} entries",
    )
    return 0


# ---- parser --------------------------------------------------------------------------------------

# A pool is named by its engine_id (`ecd ls` lists them).
POOL_HELP = "the pool's name, its engine_id (ecd ls lists them)"
SUITES = ("costs", "latency", "control", "data", "load", "handoff", "all", "restart", "cluster")


def suite_set(text: str) -> set[str]:
    suites = set(text.split(","))
    unknown = suites - set(SUITES)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown suite(s) {', '.join(sorted(unknown))}: expected some of {', '.join(SUITES)}"
        )
    return suites


def size(text: str) -> int:
    try:
        nbytes = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size above 0")
    return nbytes


def size_list(text: str) -> list[int]:
    return [size(s) for s in text.split(",")]


def count(text: str) -> int:
    if not text.isdigit() or int(text) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: expected 1 or more")
    return int(text)


def count_list(text: str) -> list[int]:
    return [count(n) for n in text.split(",")]


def cmd_bench(args: argparse.Namespace) -> int:
    from ec_bench import bench, bench_cluster
    from ec_daemon.tools import costs, transfer_floor
    from ec_daemon.tools.spawn import restartable_daemon, spawned_daemon
    from ec_daemon.tools.spawn_store import spawned_master, spawned_store_daemons

    report = bench.Report({})
    suites = args.suite
    if "restart" in suites and not args.spawn:
        print(
            "ecd: --suite restart SIGKILLs its daemon and starts it again: it needs --spawn",
            file=sys.stderr,
        )
        return 2
    if "cluster" in suites and not args.spawn:
        print("ecd: --suite cluster starts a master and daemons: it needs --spawn", file=sys.stderr)
        return 2
    if {"costs", "all"} & suites:  # in process: no daemon needed
        daemon = costs.measure(args.batch * 4, args.iterations * 2)
        bench.bench_costs(daemon, args.batch * 4, args.iterations * 2, report)
    spawned = ("--max-bytes", "4GiB", "--log-level", "warning")
    if "restart" in suites:  # daemons of its own, killed and started again; not part of "all"
        bench.bench_restart(
            lambda flags: restartable_daemon(*flags, prefix="ecd-bench-", cache_bytecode=True),
            args.restart_entries,
            args.runs,
            report,
        )
    if "cluster" in suites:  # a master and two daemons of its own; not part of "all"
        with (
            spawned_master(prefix="ecd-bench-") as master,
            # The reading daemon lends the store nothing: every value it reads is another
            # node's, never one the master placed in its own segment.
            spawned_store_daemons(master, ("256MiB", "0"), *spawned, prefix="ecd-bench-") as two,
        ):
            near, far = ((d.address, d.pid) for d in two)
            cluster = bench_cluster.Cluster(
                master.address,
                master.metadata,
                master.pid,
                near,
                far,
                f"http://127.0.0.1:{master.metrics_port}/metrics",
            )
            bench_cluster.run_cluster(cluster, master.restart, transfer_floor.read_ms, args, report)
    if suites - {"costs", "restart", "cluster"}:
        if args.spawn:
            with spawned_daemon(*spawned, prefix="ecd-bench-") as address:
                bench.run(address, args, report)
        else:
            bench.run(args.address or default_target(), args, report)
    bench.finish(report, args.output)
    return 0


def client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--address",
        help="daemon address, e.g. unix:///run/ecd/ecd.sock or 127.0.0.1:7878 "
        "[default: ECD_ADDRESS, else the default socket]",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to reach the daemon [default: 5]"
    )
    parser.add_argument(
        "--token",
        help="bearer token the daemon requires (its --token-file) [default: ECD_TOKEN, else "
        "the line of ECD_TOKEN_FILE, named by ECD_TOKEN_NAME]; other users can read a flag in "
        "ps: prefer the variables",
    )
    for name, what in (
        ("ca", "CA that signed the daemon's certificate (TLS over --tcp)"),
        ("cert", "this client's certificate, for mutual TLS"),
        ("key", "the key of --tls-cert"),
    ):
        parser.add_argument(
            f"--tls-{name}", metavar="PEM", help=f"{what} [default: ECD_TLS_{name.upper()}]"
        )


def add_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    run: Callable[[argparse.Namespace], int],
    client: bool = False,
    **kwargs: Any,
) -> argparse.ArgumentParser:
    """A subcommand that main() runs with `run`, that takes no abbreviated flags (`--max-byte` is
    not `--max-bytes`) and that main() can name in a usage error; a client of the daemon takes
    `client_arguments`."""
    command = commands.add_parser(name, allow_abbrev=False, **kwargs)
    command.set_defaults(parser=command, run=run)
    if client:
        client_arguments(command)
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ecd", description="ecd, the encoder-cache daemon", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"ecd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_queries(commands)
    _add_removals(commands)
    _add_bench(commands)
    return parser


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = add_command(
        commands,
        "serve",
        cmd_serve,
        help="run the daemon",
        description="Run the daemon. Settings: flags over ECD_* environment variables over the "
        "--config TOML file (same names, with underscores) over defaults.",
    )
    config_module.add_arguments(serve)


def _add_queries(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that read the daemon: health, stats, ls."""
    health = add_command(
        commands, "health", cmd_health, client=True, help="check the daemon (exit 0 if SERVING)"
    )
    health.add_argument(
        "--service",
        default="",
        help="a health service of the daemon's: ecd.v1.EncoderCache, or ecd.cluster (SERVING "
        "while the Mooncake Store's master answers) [default: the daemon as a whole]",
    )

    stats = add_command(
        commands, "stats", cmd_stats, client=True, help="daemon and pool statistics"
    )
    stats.add_argument("engine", nargs="?", metavar="POOL", help="only this pool")

    ls = add_command(
        commands, "ls", cmd_ls, client=True, help="list the entries of a pool, or the pools"
    )
    ls.add_argument(
        "engine", nargs="?", metavar="POOL", help="this pool's entries [default: list the pools]"
    )


def _add_removals(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The commands that take entries or pools away: evict, delete, drop."""
    for name, run, what in (
        ("evict", cmd_evict, "evict READY unpinned entries of a pool, as eviction would"),
        ("delete", cmd_delete, "delete entries of a pool in any state (a pinned one goes at its "
         "last release)"),
    ):  # fmt: skip
        drop = add_command(commands, name, run, client=True, help=what)
        drop.add_argument("engine", metavar="POOL", help=POOL_HELP)
        drop.add_argument(
            "keys", nargs="+", type=parse_key, metavar="KEY", help="key as text, or 0x-prefixed hex"
        )

    drop_pool = add_command(
        commands,
        "drop",
        cmd_drop,
        client=True,
        help="delete a pool and its file, giving its capacity back to the budget",
        description="Refused while entries of the pool are PENDING or pinned, unless --force. "
        "Of a pool whose file the daemon refused (ecd ls lists them), removes the file; one that "
        "does not read as the pool's needs --force.",
    )
    drop_pool.add_argument("engine", metavar="POOL", help=POOL_HELP)
    drop_pool.add_argument(
        "--force",
        action="store_true",
        help="drop it even with entries PENDING or pinned; remove a refused file whatever it holds",
    )


def _add_bench(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = add_command(
        commands,
        "bench",
        cmd_bench,
        help="load generator: RPC latency, bandwidth vs raw copy, ops/s, handoff latency",
        description="Every figure is a median over --runs runs; speeds are ratios to a baseline "
        "measured in the same run (a health check; a raw copy_ into the same mapping).",
    )
    bench.add_argument("--address", help="daemon address [default: ECD_ADDRESS / default socket]")
    bench.add_argument("--spawn", action="store_true", help="start a private daemon for the run")
    bench.add_argument(
        "--suite",
        type=suite_set,
        default="all",
        help="costs,latency,control,data,load,handoff or all; restart (a warm restart after a "
        "SIGKILL; with --spawn) and cluster (a Mooncake master and two daemons in its store; "
        "with --spawn) only when named",
    )
    bench.add_argument("--runs", type=count, default=5, help="repetitions; medians are reported")
    bench.add_argument(
        "--iterations", type=count, default=100, help="samples per run (control, handoff)"
    )
    bench.add_argument(
        "--sizes", type=size_list, default="256KiB,8MiB,64MiB", help="entry sizes (data)"
    )
    bench.add_argument(
        "--batch", type=count, default=8, help="entries per put_many/get_many (data)"
    )
    bench.add_argument(
        "--processes", type=count_list, default="1,4", help="client process counts (load)"
    )
    bench.add_argument(
        "--load-size", type=size, default="256KiB", help="entry size (latency, load)"
    )
    bench.add_argument("--seconds", type=float, default=5.0, help="duration per count (load)")
    bench.add_argument(
        "--restart-entries",
        type=count_list,
        default="10000,100000",
        help="entries in the pool when the daemon is killed, one daemon each (restart)",
    )
    _add_bench_cluster_arguments(bench)
    bench.add_argument("--output", help="also write the figures as JSON to this file")


def _add_bench_cluster_arguments(bench: argparse.ArgumentParser) -> None:
    """The flags of `ecd bench --suite cluster`."""
    bench.add_argument(
        "--cluster-samples", type=count, default=10, help="reads of each kind per run (cluster)"
    )
    bench.add_argument(
        "--cluster-nodes",
        type=count_list,
        default="1,10,100",
        help="simulated nodes publishing entries of their own (cluster: directory memory)",
    )
    bench.add_argument(
        "--cluster-entries", type=count, default=1000, help="entries each simulated node publishes"
    )
    bench.add_argument(
        "--republish-entries",
        type=count,
        default=100_000,
        help="entries a daemon publishes again after the master restarted empty (cluster)",
    )
    bench.add_argument(
        "--cluster-clients",
        type=count_list,
        default="1,8,64",
        help="store clients asking the master at once (cluster: lookups per second)",
    )
    bench.add_argument(
        "--cluster-seconds", type=float, default=2.0, help="duration per client count (cluster)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        result: int = args.run(args)
    except EcdError as exc:
        target = getattr(args, "address", None) or default_target()
        where = "" if target in exc.message else f" (ecd at {target})"
        print(f"ecd: {exc}{where}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader left (`ecd ls POOL | head`): not an error. Point stdout at /dev/null so
        # that flushing it at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return result
