"""How clients reach the daemon: options (target, name, role, timeouts, token, TLS files), the
channel options, and what to tell a user the daemon cannot be reached. The rules for each call
live in `_session`."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from ec_client.control.tls import TLSFiles
from ec_protocol import token_file
from ec_protocol.address import default_target
from ec_protocol.errors import EcdError
from ec_protocol.types import Role

MAX_MESSAGE_BYTES = 64 << 20
# Delays between tries while the daemon is away: doubled from the first up to the last.
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a daemon restart instead of grpc's default of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True)
class Options:
    target: str
    name: str
    role: Role
    connect_timeout_s: float
    call_timeout_s: float
    metadata: tuple[tuple[str, str], ...]
    tls: TLSFiles | None = None
    # How long any call (and the constructor) waits for a daemon that is not there to come back:
    # the client's patience through a restart. 0: a call fails at once while none is there.
    wait_for_daemon_s: float = 0.0

    @classmethod
    def make(
        cls,
        target: str | None,
        name: str | None,
        role: Role | str,
        connect_timeout_s: float,
        call_timeout_s: float,
        token: str | None,
        tls: TLSFiles | None = None,
        from_env: bool = True,
        wait_for_daemon_s: float = 0.0,
    ) -> Options:
        """from_env: a token or TLS files not given come from ECD_TOKEN, ECD_TOKEN_FILE and
        ECD_TLS_*."""
        if from_env:
            token = token or os.environ.get("ECD_TOKEN") or _token_from_file()
            tls = tls or TLSFiles.from_env()
        if token is not None:
            try:
                token_file.check_token(
                    token, "the bearer token (token=, ECD_TOKEN, ECD_TOKEN_FILE)"
                )
            except ValueError as exc:
                raise EcdError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return cls(
            target=target or default_target(),
            name=name or f"pid-{os.getpid()}",
            role=Role(role),
            connect_timeout_s=connect_timeout_s,
            call_timeout_s=call_timeout_s,
            metadata=(("authorization", f"Bearer {token}"),) if token else (),
            tls=tls,
            wait_for_daemon_s=wait_for_daemon_s,
        )

    def cut_off(self, method: str) -> EcdError:
        return EcdError(
            grpc.StatusCode.CANCELLED,
            f"ecd at {self.target} cut {method} off, as it does to calls still running when it "
            "shuts down: the call may or may not have taken effect",
            "shutting_down",
        )

    def gone_at_shutdown(self, method: str, waited_s: float) -> EcdError:
        return EcdError(
            grpc.StatusCode.UNAVAILABLE,
            f"ecd at {self.target} shut down during {method} and was not back within "
            f"{waited_s:g} s",
            "shutting_down",
        )

    def unreachable(self, problem: str | None = None, waited_s: float = 0.0) -> EcdError:
        """The error for a daemon not reached, after waiting `waited_s` for it: `problem` (what
        connection_problem found), else the question to ask."""
        if problem:
            waited = f" for {waited_s:g} s" if waited_s else ""
            return EcdError(
                grpc.StatusCode.UNAVAILABLE, f"cannot reach ecd at {self.target}{waited}: {problem}"
            )
        return EcdError(
            grpc.StatusCode.UNAVAILABLE,
            f"cannot reach ecd at {self.target} within {waited_s or self.connect_timeout_s:g} s: "
            "is the daemon running (make run, or systemctl status ecd) and is ECD_ADDRESS right?",
        )

    def waited_out(self, problem: str | None) -> str:
        """Why a call that asked to wait (Acquire's wait_ms) is answered as if it waited in vain:
        the daemon was away until its wait ran out."""
        return f"ecd at {self.target} was away until the wait ran out" + (
            f": {problem}" if problem else ""
        )


def _token_from_file() -> str | None:
    path = os.environ.get("ECD_TOKEN_FILE")
    if not path:
        return None
    try:
        return token_file.client_token(Path(path), os.environ.get("ECD_TOKEN_NAME"))
    except (OSError, ValueError) as exc:
        raise EcdError(grpc.StatusCode.INVALID_ARGUMENT, f"ECD_TOKEN_FILE: {exc}") from None


# ---- why a daemon cannot be reached --------------------------------------------------------------

PROBE_TIMEOUT_S = 1.0
# What a call gets when it never reached the daemon: worth a probe of the connection, to say why.
UNREACHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# What an HTTP/2 client sends first; a gRPC server answers with its SETTINGS frame.
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def unix_socket_path(target: str) -> str | None:
    """The socket path of a `unix:PATH` or `unix:///PATH` target; None for other targets."""
    if target.startswith("unix://"):
        return target[len("unix://") :]
    if target.startswith("unix:"):
        return target[len("unix:") :]
    return None


def _host_port(target: str) -> tuple[str, int] | None:
    """(host, port) of a TCP target (`host:port`, `dns:///host:port`, `ipv4:...`, `[::1]:port`)."""
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        target = target.removeprefix(prefix)
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def connection_problem(options: Options) -> str | None:
    """What stops a connection to the daemon, found with one plain connection (and for TLS, one
    handshake) of at most about a second: the socket is missing or refused, the TLS handshake
    failed and why, the daemon expects TLS the client does not speak. None when nothing is
    found: the daemon answers, or the cause lies beyond what a connection shows."""
    path = unix_socket_path(options.target)
    if path is not None:
        return _unix_problem(path)
    address = _host_port(options.target)
    if address is None:
        return None
    try:
        raw = socket.create_connection(address, timeout=PROBE_TIMEOUT_S)
    except OSError as exc:
        return f"cannot connect to {address[0]}:{address[1]}: {exc.strerror or exc}"
    with raw:
        return _tls_problem(raw, address[0], options.tls) if options.tls else _plain_problem(raw)


def _unix_problem(path: str) -> str | None:
    if not os.path.exists(path):
        return (
            f"no socket at {path}: the daemon is not running there (start it: ecd serve, make "
            "run, systemctl start ecd), or ECD_ADDRESS / --address names another socket"
        )
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(PROBE_TIMEOUT_S)
        try:
            sock.connect(path)
        except PermissionError:
            return (
                f"permission denied on {path}: run as the daemon's user or in its socket group "
                "(socket_group, socket_mode 0660)"
            )
        except ConnectionRefusedError:
            return f"nothing listens on {path}: the daemon that made it has stopped"
        except OSError as exc:
            return f"cannot connect to {path}: {exc.strerror or exc}"
    return None


def _plain_problem(raw: socket.socket) -> str | None:
    try:
        raw.sendall(_HTTP2_PREFACE)
        if raw.recv(1):
            return None
    except OSError:
        return None
    return (
        "the daemon closed a plaintext connection at once: it serves TLS; give the client the CA "
        "that signed its certificate (ECD_TLS_CA, or tls=TLSFiles(ca=...))"
    )


def _tls_problem(raw: socket.socket, host: str, tls: TLSFiles) -> str | None:
    try:
        context = ssl.create_default_context(cafile=str(tls.ca) if tls.ca else None)
        if tls.cert is not None:
            context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot use the client's TLS files: {exc}"
    context.set_alpn_protocols(["h2"])
    try:
        with context.wrap_socket(raw, server_hostname=host) as conn:
            conn.sendall(_HTTP2_PREFACE)
            answered = bool(conn.recv(1))
    except ssl.SSLCertVerificationError as exc:
        return (
            f"the TLS handshake failed: the daemon's certificate did not verify "
            f"({exc.verify_message}): it is not signed by the CA the client trusts "
            f"({tls.ca or 'the system CAs'}), or does not name {host}"
        )
    except ssl.SSLError as exc:
        return f"the TLS handshake failed: {exc.reason or exc} (is the daemon serving TLS here?)"
    except OSError:
        return None
    if answered:
        return None
    return (
        "the daemon closed the connection after the TLS handshake: it requires a client "
        "certificate it trusts (mutual TLS): set ECD_TLS_CERT and ECD_TLS_KEY"
        if tls.cert is None
        else "the daemon closed the connection after the TLS handshake: it does not trust the "
        "client's certificate (ECD_TLS_CERT)"
    )


def await_daemon(options: Options, wait_s: float) -> None:
    """Return once a connection shows nothing stopping it; retried for wait_s (a daemon
    starting alongside this process), then UNAVAILABLE naming what stops it. With wait_s 0, a
    missing socket or a refused connection fails at once instead of after a connect timeout."""
    deadline = time.monotonic() + wait_s
    delay = FIRST_BACKOFF_S
    while (problem := connection_problem(options)) is not None:
        if time.monotonic() + delay > deadline:
            raise options.unreachable(problem)
        time.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)


_channels: dict[tuple[int, str, TLSFiles | None], grpc.Channel] = {}
_channels_lock = threading.Lock()


def shared_channel(options: Options) -> grpc.Channel:
    """The process's channel to this target: one per target per process (a forked child gets
    its own), so every Client in a process shares its connection."""
    key = (os.getpid(), options.target, options.tls)
    with _channels_lock:
        channel = _channels.get(key)
        if channel is None:
            channel = _channels[key] = (
                grpc.insecure_channel(options.target, options=CHANNEL_OPTIONS)
                if options.tls is None
                else grpc.secure_channel(
                    options.target, options.tls.credentials(), options=CHANNEL_OPTIONS
                )
            )
        return channel


def forget_shared_channel(target: str) -> None:
    """Close this process's channels to `target`: the next Client there connects anew, rather
    than through a channel still backing off (up to MAX_BACKOFF_S) from a daemon that went away.
    For `ecd bench --suite restart`, which kills its daemon and times a new client's first call;
    every Client of the target must be closed."""
    with _channels_lock:
        for key in [key for key in _channels if key[:2] == (os.getpid(), target)]:
            _channels.pop(key).close()


def aio_channel(options: Options) -> grpc.aio.Channel:
    """A new grpc.aio channel: these belong to the event loop that made them, so each
    AsyncClient owns one."""
    if options.tls is None:
        return grpc.aio.insecure_channel(options.target, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(
        options.target, options.tls.credentials(), options=CHANNEL_OPTIONS
    )
