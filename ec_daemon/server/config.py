"""Daemon configuration: command-line flags over ECD_* environment variables over a TOML file over
defaults. Every setting is declared once in SETTINGS; the flags, the environment names, the TOML
keys, `ecd serve --help` and `--print-config` are all derived from that table.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ec_protocol.address import daemon_socket_path
from ec_protocol.units import format_size, parse_size

ENV_PREFIX = "ECD_"


def _mode(text: str | int) -> int:
    """Permission bits written in octal: "0660", "660" or "0o660" (a TOML file's bare 660 and
    0o660 reach here as written, see _modes_as_written)."""
    if isinstance(text, int):
        raise ValueError(f'{text} is a number; write the mode as an octal string, e.g. "0660"')
    try:
        mode = int(text, 8)
    except ValueError:
        raise ValueError(f'{text!r} is not an octal mode; expected e.g. "0660"') from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"{text!r} is {oct(mode)}: expected permission bits, 0 to 0777")
    return mode


def _pool_mode(text: str | int) -> int:
    mode = _mode(text)
    if mode & 0o600 != 0o600:
        raise ValueError(
            f"{oct(mode)} leaves the owner without read and write: the daemon could not adopt its "
            "own pool files after a restart; expected at least 0600"
        )
    return mode


def _bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean; expected true or false")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"{text!r} is not one of {', '.join(allowed)}")
        return text

    return parse


def _size_or_auto(text: str | int) -> int | None:
    """None means auto: decided at startup (see the setting)."""
    return None if text == "auto" else _positive_size(text)


def _count_or_auto(text: str | int) -> int | None:
    """None means auto: decided per pool (see the setting)."""
    if text == "auto":
        return None
    count = int(text)
    if count <= 0:
        raise ValueError(f"{text!r} is not a positive number or auto")
    return count


def _seconds(least: float, above: bool = False) -> Callable[[str | float], float]:
    """A finite number of seconds of at least `least` (more than it, with `above`)."""

    def parse(text: str | float) -> float:
        value = float(text)
        if not math.isfinite(value) or value < least or (above and value == least):
            bound = f"more than {least:g}" if above else f"at least {least:g}"
            raise ValueError(f"{text!r} is not a number of seconds {bound}")
        return value

    return parse


def _count(least: int, most: int, what: str) -> Callable[[str | int], int]:
    def parse(text: str | int) -> int:
        value = int(text)
        if not least <= value <= most:
            raise ValueError(f"{text!r} is not {what}: expected {least} to {most}")
        return value

    return parse


def _positive_size(text: str | int) -> int:
    size = parse_size(text)
    if size <= 0:
        raise ValueError(f"{text!r} is not a size above 0")
    return size


def _host_port(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if text and (not sep or not host or not port.isdigit()):
        raise ValueError(f"{text!r} is not HOST:PORT, e.g. 127.0.0.1:7878")
    return text


def _store_master(text: str) -> str:
    """HOST:PORT of the one master, or etcd://HOST:PORT[;HOST:PORT...]: the etcd endpoints
    through which several masters elect a leader (the daemon follows it)."""
    scheme, sep, endpoints = text.partition("://")
    if not sep:
        return _host_port(text)
    if scheme != "etcd":
        raise ValueError(
            f"{text!r}: the store's masters are found through etcd only; expected HOST:PORT or "
            "etcd://HOST:PORT[;HOST:PORT...]"
        )
    for endpoint in endpoints.split(";"):
        host, colon, port = endpoint.rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(
                f"{text!r}: etcd endpoint {endpoint!r} is not HOST:PORT; expected "
                "etcd://HOST:PORT[;HOST:PORT...], e.g. etcd://10.0.0.1:2379;10.0.0.2:2379"
            )
    return text


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None


@dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    metavar: str = ""
    unset: str = "(none)"  # what a value of None means, as --help and --print-config show it

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    def show(self, value: Any) -> str:
        """A value as an operator writes it: modes in octal, TOML booleans, unset as what it means."""
        if value is None or value == "":
            return self.unset
        if isinstance(value, bool):
            return str(value).lower()
        if self.name.endswith("_mode"):
            return oct(value)
        return str(value)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "socket",
        Path,
        None,
        "Unix socket to listen on [/run/ecd, $XDG_RUNTIME_DIR/ecd or /tmp/ecd-UID]/ecd.sock",
        "PATH",
        "(computed)",
    ),
    Setting("socket_mode", _mode, 0o660, 'permissions of the socket, in octal ("0660")', "MODE"),
    Setting(
        "socket_group", str, "", "group owning the socket (clients in it may connect)", "GROUP"
    ),
    Setting("tcp", _host_port, "", "also listen on TCP HOST:PORT", "HOST:PORT", "off"),
    Setting(
        "tls_cert",
        _optional_path,
        None,
        "with --tcp: serve TLS with this certificate chain (PEM); needs --tls-key",
        "FILE",
    ),
    Setting("tls_key", _optional_path, None, "private key of --tls-cert (PEM)", "FILE"),
    Setting(
        "tls_client_ca",
        _optional_path,
        None,
        "with TLS: require client certificates signed by this CA (mutual TLS)",
        "FILE",
    ),
    Setting("shm_dir", Path, Path("/dev/shm"), "directory of the pool files (a tmpfs)", "DIR"),
    Setting(
        "hugepages",
        _bool,
        False,
        "require 2 MiB pages for pool files: refuse to start unless shm-dir is a tmpfs mounted "
        "with huge=always or huge=within_size",
        "BOOL",
    ),
    Setting(
        "max_bytes",
        _size_or_auto,
        None,
        "budget of all pools' capacity together, e.g. 8GiB (GiB, MiB, KiB: powers of 1024; "
        "GB or G, MB or M: powers of 1000, so 8G is 8 * 10^9 bytes; their files hold a little "
        "more: headers and slot tables); auto = half of shm-dir",
        "SIZE",
        "auto",
    ),
    Setting(
        "lease_ttl",
        _seconds(0, above=True),
        10.0,
        "seconds a silent client's allocations and pins are kept",
        "SECONDS",
    ),
    Setting(
        "pending_timeout",
        _seconds(0, above=True),
        30.0,
        "seconds an entry may stay PENDING (allocated, not committed) before the daemon aborts "
        "it: the longest anyone waits for another's encode (raise it for encodes that take "
        "longer)",
        "SECONDS",
    ),
    Setting(
        "eviction",
        _choice("lru", "fifo"),
        "lru",
        "which READY entry is evicted first: lru or fifo",
        "POLICY",
    ),
    Setting(
        "entries_per_pool",
        _count_or_auto,
        None,
        "entries each pool can hold (a slot of 512 bytes of its file each) unless it asks for "
        "its own number (OpenPool's max_entries), and the most it may ask for; auto = one per "
        "32 KiB of capacity in whole 2 MiB, at least 4088, at most 65536, and pools may ask for "
        "up to 65536: a number is for pools of smaller entries, and costs their files more",
        "N",
        "auto",
    ),
    Setting(
        "max_pool_bytes",
        _size_or_auto,
        None,
        "largest capacity one pool may ask for; auto = the whole budget",
        "SIZE",
        "auto",
    ),
    Setting(
        "max_batch",
        _count(1, 1 << 31, "a batch size"),
        4096,
        "items one request may carry (clients split larger batches)",
        "N",
    ),
    Setting("max_message_bytes", _positive_size, 64 << 20, "largest gRPC message accepted", "SIZE"),
    Setting(
        "pool_mode",
        _pool_mode,
        0o600,
        'permissions of pool files, in octal ("0600"; "0660" with --pool-group)',
        "MODE",
    ),
    Setting(
        "pool_group",
        str,
        "",
        "group given path access to every pool file (with pool_mode 0660); clients of other users "
        "get the pools they are granted over the socket without it",
        "GROUP",
    ),
    Setting(
        "metrics_port",
        _count(0, 65535, "a TCP port"),
        0,
        "serve Prometheus metrics on this port (0 = off)",
        "PORT",
    ),
    Setting(
        "metrics_host",
        str,
        "127.0.0.1",
        "address the metrics port binds; 0.0.0.0 (all interfaces) for a Prometheus on another "
        "host to scrape it, best with --metrics-token-file: the page names every pool",
        "HOST",
    ),
    Setting(
        "metrics_token_file",
        _optional_path,
        None,
        "answer the metrics page only to `Authorization: Bearer <token>` with a token of this "
        "file (lines `TOKEN` or `NAME TOKEN`; Prometheus: authorization.credentials_file)",
        "FILE",
    ),
    Setting(
        "token_file",
        _optional_path,
        None,
        "require a bearer token from this file (lines `NAME TOKEN`) on every RPC",
        "FILE",
    ),
    Setting(
        "acl_file",
        _optional_path,
        None,
        "per-pool access list (TOML: which token names may produce, consume, admin where)",
        "FILE",
    ),
    Setting(
        "trust_all_tokens",
        _bool,
        False,
        "serve a --token-file without an --acl-file, every token an admin (it may evict, "
        "delete and drop every pool); without this the daemon refuses to start so",
        "BOOL",
    ),
    Setting(
        "pool_check_interval",
        _seconds(0.1),
        5.0,
        "seconds between checks that pool files were not truncated or overwritten",
        "SECONDS",
    ),
    Setting(
        "log_format", _choice("text", "json"), "text", "log line format: text or json", "FORMAT"
    ),
    Setting(
        "log_level",
        _choice("debug", "info", "warning", "error"),
        "info",
        "least severe level logged",
        "LEVEL",
    ),
    Setting(
        "shutdown_grace",
        _seconds(0),
        5.0,
        "seconds in-flight RPCs get to finish on SIGTERM (Acquires waiting on keys are answered "
        "UNAVAILABLE at once, for their clients to wait on at the next daemon)",
        "SECONDS",
    ),
    Setting(
        "drop_pools_on_exit",
        _bool,
        False,
        "delete pool files on shutdown (default: keep them, they are the cache)",
        "BOOL",
    ),
    Setting(
        "pull_timeout",
        _seconds(0, above=True),
        1.0,
        "seconds a remote hit from the store may take; an Acquire of a key a shared pool lacks "
        "waits up to this long for it, or its wait_ms if longer",
        "SECONDS",
    ),
    Setting(
        "republish_rate",
        _count(1, 1 << 31, "a number of entries a second"),
        50_000,
        "entries a second, at most, that this daemon offers the store again when the store lost "
        "what it published (a master restarted without its directory)",
        "ENTRIES",
    ),
    Setting(
        "republish_every",
        _seconds(0),
        60.0,
        "seconds between this daemon's walks of each shared pool that offer the store every "
        "entry it lacks (one lookup per 512 entries held): an entry whose copy in the store went "
        "(the node that lent its memory died, it was removed) is a remote hit again within this "
        "and the walk; 0: only when the store lost what this daemon published",
        "SECONDS",
    ),
    Setting(
        "transfer_host",
        str,
        "",
        "the address the store's other clients reach this daemon's transfer engine at; "
        "default: --tcp's host",
        "HOST",
        "(--tcp's host)",
    ),
    Setting(
        "store_master",
        _store_master,
        "",
        "join the Mooncake Store whose master listens at HOST:PORT, or whose masters elect a "
        "leader through etcd at etcd://HOST:PORT[;HOST:PORT...] (the daemon follows the "
        "leader): the entries of pools opened with a cluster_namespace are published to it "
        "(needs --store-metadata, and --transfer-host or --tcp)",
        "HOST:PORT",
        "off",
    ),
    Setting(
        "store_metadata",
        str,
        "",
        "the store's metadata server, e.g. http://HOST:PORT/metadata (the master's own with "
        "--enable_http_metadata_server); with several masters P2PHANDSHAKE (none: the nodes "
        "exchange it directly)",
        "URL",
    ),
    Setting(
        "store_segment_bytes",
        parse_size,
        1 << 30,
        "memory this node lends the store for every node's entries (0: none; outside --max-bytes)",
        "SIZE",
    ),
    Setting(
        "store_protocol",
        _choice("tcp", "rdma"),
        "tcp",
        "how the store moves entries between nodes: tcp or rdma",
        "PROTOCOL",
    ),
    Setting(
        "store_devices",
        str,
        "",
        "with rdma: the store's RDMA devices, comma-separated (e.g. mlx5_0); default: all",
        "DEVICES",
        "(all)",
    ),
)


@dataclass(frozen=True)
class Config:
    socket: Path
    socket_mode: int
    socket_group: str
    tcp: str
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    shm_dir: Path
    hugepages: bool
    max_bytes: int | None
    lease_ttl: float
    pending_timeout: float
    eviction: str
    entries_per_pool: int | None
    max_pool_bytes: int | None
    max_batch: int
    max_message_bytes: int
    pool_mode: int
    pool_group: str
    metrics_port: int
    metrics_host: str
    metrics_token_file: Path | None
    token_file: Path | None
    acl_file: Path | None
    trust_all_tokens: bool
    pool_check_interval: float
    log_format: str
    log_level: str
    shutdown_grace: float
    drop_pools_on_exit: bool
    pull_timeout: float
    republish_rate: int
    republish_every: float
    transfer_host: str
    store_master: str
    store_metadata: str
    store_segment_bytes: int
    store_protocol: str
    store_devices: str


assert [s.name for s in SETTINGS] == [f.name for f in dataclasses.fields(Config)]

_STORE_INSTEAD = (
    "daemons no longer follow each other as peers; they share entries through a Mooncake "
    "Store: run a mooncake_master and start every daemon with --store-master HOST:PORT "
    "--store-metadata URL (docs/operations.md, Several nodes)"
)


@dataclass(frozen=True)
class Removed:
    """A setting of the peer mesh, which the Mooncake Store replaced (docs/design.md §13): a
    daemon given one refuses to start, saying what replaces it, rather than start without the
    cluster its operator asked for."""

    name: str
    flag: str
    instead: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


REMOVED: tuple[Removed, ...] = (
    Removed("peers", "--peer", _STORE_INSTEAD),
    Removed("peer_refresh", "--peer-refresh", _STORE_INSTEAD),
    Removed("peer_token_file", "--peer-token-file", _STORE_INSTEAD),
    Removed("peer_tls_ca", "--peer-tls-ca", _STORE_INSTEAD),
    Removed("peer_tls_cert", "--peer-tls-cert", _STORE_INSTEAD),
    Removed("peer_tls_key", "--peer-tls-key", _STORE_INSTEAD),
    Removed("transfer_protocol", "--transfer-protocol", "the store's is --store-protocol"),
    Removed("transfer_devices", "--transfer-devices", "the store's is --store-devices"),
)


class ConfigError(ValueError):
    """A setting could not be parsed; the message names the setting and where it came from."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; every default is None so that 'not given' can be told apart."""
    parser.add_argument("--config", type=Path, metavar="FILE", help="TOML file of settings")
    parser.add_argument(
        "--print-config", action="store_true", help="print the effective settings and exit"
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="with --print-config: print the table of every setting as Markdown (for the docs)",
    )
    for setting in SETTINGS:
        parser.add_argument(
            setting.flag,
            dest=setting.name,
            metavar=setting.metavar or None,
            help=f"{setting.help} [env {setting.env}; default {setting.show(setting.default)}]",
        )
    for gone in REMOVED:  # accepted, to be refused by `load` saying what replaces them
        parser.add_argument(gone.flag, dest=gone.name, action="append", help=argparse.SUPPRESS)


def load(
    flags: Mapping[str, Any], environ: Mapping[str, str], config_file: Path | None
) -> tuple[Config, dict[str, str]]:
    """The effective configuration and, per setting, where its value came from."""
    file_values: dict[str, Any] = {}
    if config_file is not None:
        try:
            text = config_file.read_text()
            file_values = _modes_as_written(text, tomllib.loads(text))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
    given = functools.partial(_given, flags, environ, file_values, config_file)
    for gone in REMOVED:
        if (found := given(gone.name, gone.flag, gone.env)) is not None:
            raise ConfigError(f"{gone.name} from {found[0]} is no longer a setting: {gone.instead}")
    if config_file is not None:
        names = [s.name for s in SETTINGS]
        unknown = sorted(set(file_values) - set(names))
        if unknown:
            listed = ", ".join(_with_nearest(name, names) for name in unknown)
            raise ConfigError(f"unknown settings in {config_file}: {listed}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        found = given(setting.name, setting.flag, setting.env)
        if found is None:
            values[setting.name] = setting.default
            sources[setting.name] = "default"
            continue
        source, raw = found
        try:
            values[setting.name] = setting.parse(raw)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{setting.name} from {source}: {exc}") from exc
        sources[setting.name] = source
    if values["socket"] is None:
        values["socket"] = daemon_socket_path()
    budget, pool_limit = values["max_bytes"], values["max_pool_bytes"]
    if budget is not None and pool_limit is not None and pool_limit > budget:
        raise ConfigError(
            f"max_pool_bytes ({format_size(pool_limit)}, {sources['max_pool_bytes']}) is over "
            f"max_bytes ({format_size(budget)}, {sources['max_bytes']}): no pool could be that "
            "large; lower --max-pool-bytes or raise --max-bytes"
        )
    if bool(values["store_master"]) != bool(values["store_metadata"]):
        raise ConfigError(
            "store_master and store_metadata go together: the master's HOST:PORT and its "
            "metadata server's URL (e.g. http://HOST:PORT/metadata)"
        )
    return Config(**values), sources


def _given(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    file_values: Mapping[str, Any],
    config_file: Path | None,
    name: str,
    flag: str,
    env: str,
) -> tuple[str, Any] | None:
    """Where a setting was given first (its flag, its ECD_* variable, the TOML file) and as
    what; None if nowhere."""
    for source, raw in (
        (f"flag {flag}", flags.get(name)),
        (f"env {env}", environ.get(env)),
        (f"file {config_file}", file_values.get(name)),
    ):
        if raw is not None:
            return source, raw
    return None


# ECD_* names read by others than `ecd serve`: the client library, and the Makefile's test knobs
# (a daemon the tests start inherits them).
OTHER_ENV = ("ECD_ADDRESS", "ECD_TOKEN", "ECD_TOKEN_NAME", "ECD_TLS_CA", "ECD_REQUIRE_GPU")
OTHER_ENV_PREFIXES = ("ECD_FAULT_", "ECD_FUZZ_", "ECD_LOAD_", "ECD_GPU_")


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """A line per ECD_* variable nobody reads (a typo, most likely), with the nearest setting."""
    known = [s.env for s in SETTINGS]
    lines = []
    for name in sorted(environ):
        if (
            not name.startswith(ENV_PREFIX)
            or name in known
            or name in OTHER_ENV
            or name.startswith(OTHER_ENV_PREFIXES)
        ):
            continue
        lines.append(_with_nearest(name, known))
    return lines


def _with_nearest(name: str, known: list[str]) -> str:
    """An unknown name, with the known one nearest to it if one is near (a typo, most likely)."""
    near = difflib.get_close_matches(name, known, n=1)
    return name + (f" (did you mean {near[0]}?)" if near else "")


def _modes_as_written(text: str, values: dict[str, Any]) -> dict[str, Any]:
    """Modes given as TOML numbers, as they were written: TOML reads `socket_mode = 660` as the
    decimal 660 (mode 0o1224) and `0o660` as 432, and only the text tells them apart, so the
    parser gets "660" or "0o660" and reads both as octal."""
    written = dict(values)
    for setting in SETTINGS:
        if setting.name.endswith("_mode") and isinstance(values.get(setting.name), int):
            match = re.search(rf"^[ \t]*{setting.name}[ \t]*=[ \t]*([+\w]+)", text, re.MULTILINE)
            if match:
                written[setting.name] = match.group(1)
    return written


def describe(config: Config, sources: Mapping[str, str]) -> str:
    """The --print-config table: name, value, source."""
    rows = [(s.name, s.show(getattr(config, s.name)), sources[s.name]) for s in SETTINGS]
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    return "\n".join(f"{n:<{width}}  {v:<{vwidth}}  {s}" for n, v, s in rows)


def reference() -> str:
    """Every setting as a Markdown table (flag, environment variable, default, meaning), for
    docs/operations.md; the TOML key is the setting's name. Regenerate it with
    `ecd serve --print-config --markdown` (tests/ops/test_docs.py fails while they differ)."""
    lines = [
        "| setting (TOML key) | flag | environment | default | meaning |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| `{s.name}` | `{s.flag}` | `{s.env}` | `{s.show(s.default)}` | "
        f"{s.help.replace('|', '/')} |"
        for s in SETTINGS
    ]
    return "\n".join(lines)
