"""Bytes written straight to the daemon's Unix socket: garbage, a truncated HTTP/2 preface, a
valid preface followed by junk frames, and gRPC calls whose frames or messages are mangled.

Whatever arrives, the daemon stays up and SERVING, answers real clients as before (Stats and the
metrics page after every case), and closes what it opened for the hostile connections (its file
descriptors return to where they were).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import grpc
import pytest
from ecd_testing import Daemon, running_daemon
from fuzz_testing import CASES, RAW, Observer, fuzz_settings
from http2_testing import DATA, PREFACE, SETTINGS, frame, grpc_call
from hypothesis import given
from hypothesis import strategies as st
from workload_testing import daemon_fds

from ec_daemon.tools.spawn import free_port
from ec_protocol._proto.ecd.v1 import ecd_pb2 as pb

METHODS = [
    f"/{pb.DESCRIPTOR.services_by_name['EncoderCache'].full_name}/{m.name}".encode()
    for m in pb.DESCRIPTOR.services_by_name["EncoderCache"].methods
] + [b"/grpc.health.v1.Health/Check"]


def send_raw(daemon: Daemon, payload: bytes, read_s: float = 0.5, until: bytes = b"") -> bytes:
    """Write payload on a fresh connection and read what comes back: until `until` arrives, if
    given (our side stays open, so a call is answered rather than cancelled), else after closing
    our side; in any case until the daemon closes or read_s passes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(read_s)
        s.connect(str(daemon.socket))
        try:
            s.sendall(payload)
            if not until:
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon hung up on us first: fine
        received = b""
        deadline = time.monotonic() + read_s
        try:
            while time.monotonic() < deadline and not (until and until in received):
                chunk = s.recv(65536)
                if not chunk:
                    break
                received += chunk
        except OSError:
            pass
        return received


# ---- what is sent ------------------------------------------------------------------------------

GARBAGE = st.binary(max_size=2048)
TRUNCATED_PREFACE = st.builds(
    lambda n, tail: PREFACE[:n] + tail, st.integers(0, len(PREFACE) - 1), st.binary(max_size=64)
)
FRAMES = st.lists(
    st.builds(
        frame,
        st.one_of(st.integers(0, 9), st.integers(0, 255)),
        st.integers(0, 255),
        st.one_of(st.integers(0, 7), st.integers(0, 2**31 - 1)),
        st.binary(max_size=64),
        st.one_of(st.none(), st.integers(0, 2**24 - 1)),
    ),
    min_size=1,
    max_size=6,
).map(b"".join)
PREFACE_AND_JUNK = st.builds(
    lambda settings, frames: PREFACE + settings + frames,
    st.sampled_from([b"", frame(SETTINGS, 0, 0, b"")]),
    FRAMES,
)
# Paths are valid UTF-8 here: one that is not ends grpc.aio's server, and with it the daemon, for
# its supervisor to restart (see the test below); that would end this module's daemon.
PATHS = st.one_of(
    st.sampled_from(METHODS), st.text(max_size=30).map(lambda t: ("/" + t).encode()[:120])
)
MANGLED_CALLS = st.builds(
    grpc_call,
    PATHS,
    st.binary(max_size=200),
    st.sampled_from([0, 0, 1, 2]),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),
)
HOSTILE = {
    "socket garbage": GARBAGE,
    "socket truncated preface": TRUNCATED_PREFACE,
    "socket preface + junk frames": PREFACE_AND_JUNK,
    "socket mangled gRPC call": MANGLED_CALLS,
}


# ---- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def target(metrics_port: int) -> Iterator[Daemon]:
    metrics = ("--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port))
    with running_daemon("--max-bytes", "64MiB", "--lease-ttl", "2", *metrics) as daemon:
        yield daemon


def test_a_hand_built_grpc_call_reaches_the_service(target: Daemon) -> None:
    """The framing the fuzzers mangle is right: sent whole, it opens a real session."""
    with target.client(name="observer") as c:
        before = c.stats().sessions
        request = pb.OpenSessionRequest(client_name="raw").SerializeToString()
        reply = send_raw(target, grpc_call(METHODS[0], request), until=b"grpc-status")
        assert b"grpc-status" in reply, "no answer to a well-formed call"
        assert c.stats().sessions == before + 1


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_bytes_never_harm_the_daemon(target: Daemon, metrics_port: int, kind: str) -> None:
    with target.client(name="observer") as c:
        c.open_pool("bystander", 4096, 64 * 4096)
        baseline = daemon_fds(target.proc.pid)  # type: ignore[union-attr]
        observer = Observer(c.stats, metrics_port)

        @fuzz_settings(RAW)
        @given(payload=HOSTILE[kind])
        def attack(payload: bytes) -> None:
            CASES[kind] += 1
            until = b"grpc-status" if kind == "socket mangled gRPC call" else b""
            send_raw(target, payload, read_s=0.15, until=until)
            assert target.running, target.log()[-3000:]
            observer.after(payload)

        attack()
        observer.finish()
        assert c.health() == "SERVING"
        assert c.lookup("bystander", ["k"])[0].nbytes == 0  # a real client is served as before

        def fds_back() -> bool:
            return daemon_fds(target.proc.pid) <= baseline  # type: ignore[union-attr]

        deadline = time.monotonic() + 5
        while not fds_back() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fds_back(), f"{daemon_fds(target.proc.pid)} fds, {baseline} before"  # type: ignore[union-attr]


def test_a_daemon_under_hostile_bytes_keeps_its_epoch(target: Daemon) -> None:
    with target.client(name="observer") as c:
        epoch = c.boot_epoch
        for payload in (b"\0" * 4096, PREFACE + frame(DATA, 0, 0, b"x", length=2**24 - 1)):
            send_raw(target, payload)
        assert c.stats().boot_epoch == epoch


def test_a_call_whose_path_is_not_utf8_does_not_leave_a_deaf_daemon() -> None:
    with running_daemon("--max-bytes", "64MiB") as daemon:
        send_raw(daemon, grpc_call(b"/\xaf\xff", b""), until=b"grpc-status")

        def serving_or_gone() -> bool:
            if not daemon.running:
                return True
            try:
                with grpc.insecure_channel(daemon.address) as channel:
                    grpc.channel_ready_future(channel).result(timeout=1.0)
                return True
            except grpc.FutureTimeoutError:
                return False

        # Two answers in a row, each read once: a daemon whose server died is running while it
        # exits (accepting nothing for a moment), and a check made again after the one that
        # ended the wait could land in that moment (a loaded machine did). A deaf daemon never
        # gives one.
        deadline = time.monotonic() + 10  # a loaded machine: the check itself takes seconds
        in_a_row = 0
        while in_a_row < 2 and time.monotonic() < deadline:
            in_a_row = in_a_row + 1 if serving_or_gone() else 0
            time.sleep(0.1)
        assert in_a_row == 2, "the daemon runs but accepts no connection"
        if not daemon.running:
            assert daemon.proc is not None and daemon.proc.returncode != 0
