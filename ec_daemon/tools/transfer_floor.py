"""The floor a remote hit can reach, for `ecd bench --spawn --suite cluster`: Mooncake's own
`transfer_engine_bench` reading a block of the same size between two of its processes over TCP
(a target lending its buffer, an initiator reading from it: P2P handshake, one request a batch,
one thread), with no master, no store client and no copy out. On loopback, or between two hosts
(`Side`: the test hosts' network namespaces, tests/link_figures.py).

Measured in the same sitting as the remote hit it is compared with: on this project's shared
machine the same read takes 3 ms idle and 15-35 ms loaded, so a floor from another time says
nothing about a hit's overhead (docs/performance.md, *The cluster tier*)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ec_daemon.cluster.mooncake import INSTALL_HINT
from ec_daemon.tools.spawn import free_port

START_TIMEOUT_S = 20.0
HANDSHAKE = re.compile(r"P2P handshake, listening on [\d.]+:(\d+)")
DATA_PORT = re.compile(r"TcpTransport: listen on port (\d+)")
COMPLETED = re.compile(r"Test completed: duration ([\d.]+), batch count (\d+)")


def bench_binary() -> str:
    """The mooncake package's own `transfer_engine_bench`: the command of that name the wheel
    puts beside the interpreter is a Python wrapper that runs it as a child, which a kill of the
    wrapper would leave running."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"transfer_engine_bench comes with the mooncake package: {INSTALL_HINT}")
    return str(Path(spec.submodule_search_locations[0]) / "transfer_engine_bench")


@dataclass(frozen=True)
class Side:
    """Where the target or the initiator runs: the address the other reaches it at, and the
    argv prefix that runs a command there (none: this host)."""

    address: str = "127.0.0.1"
    launcher: tuple[str, ...] = ()


LOOPBACK = Side()


def bench_command(mode: str, side: Side, nbytes: int, *flags: str, binary: str) -> list[str]:
    """`transfer_engine_bench` as a target or an initiator over TCP on `side`, with a buffer of
    two blocks of `nbytes` (the initiator reads into its own, from the target's). Its server
    name's port is only a name: with a P2P handshake it listens on ports it picks."""
    return [
        *side.launcher,
        binary,
        f"--mode={mode}",
        "--protocol=tcp",
        "--metadata_server=P2PHANDSHAKE",
        f"--local_server_name={side.address}:{free_port()}",
        f"--buffer_size={2 * nbytes}",
        *flags,
    ]


def handshake_port(log: Path, proc: subprocess.Popen[bytes]) -> int:
    """The target's handshake port, once its log says it listens on it and on its data port
    (it logs each once listening); RuntimeError, with its log, if it does not within
    START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        text = log.read_text(errors="replace")
        handshake, data = HANDSHAKE.search(text), DATA_PORT.search(text)
        if handshake and data:
            return int(handshake.group(1))
        time.sleep(0.05)
    raise RuntimeError(f"transfer_engine_bench's target did not start: {log.read_text()}")


def read_ms(
    nbytes: int,
    seconds: int = 1,
    binary: str = "",
    target: Side = LOOPBACK,
    initiator: Side = LOOPBACK,
) -> float:
    """Milliseconds one read of `nbytes` by `initiator` from `target` takes, as the mean over
    `seconds` of reads one after another (the transfer engine's own count of them); `binary`:
    the package's own by default."""
    binary = binary or bench_binary()
    workdir = Path(tempfile.mkdtemp(prefix="ecd-bench-floor-"))
    log = workdir / "target.log"
    try:
        with log.open("wb") as out:
            process = subprocess.Popen(
                bench_command("target", target, nbytes, binary=binary), stdout=out, stderr=out
            )
        try:
            handshake = handshake_port(log, process)
            done = subprocess.run(
                bench_command(
                    "initiator",
                    initiator,
                    nbytes,
                    f"--segment_id={target.address}:{handshake}",
                    f"--block_size={nbytes}",
                    "--batch_size=1",
                    "--threads=1",
                    f"--duration={seconds}",
                    binary=binary,
                ),
                capture_output=True,
                text=True,
                timeout=seconds + 30,
            )
        finally:
            process.kill()
            process.wait()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    completed = COMPLETED.search(done.stdout + done.stderr)
    if done.returncode != 0 or completed is None or not int(completed.group(2)):
        raise RuntimeError(f"transfer_engine_bench's initiator read nothing: {done.stderr[-2000:]}")
    return float(completed.group(1)) / int(completed.group(2)) * 1e3
