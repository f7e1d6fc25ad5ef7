"""Test support for the end-to-end suite: real vLLM engines as separate OS processes.

`Engine` starts tests/e2e/e2e_engine.py in a process of its own, with vLLM's CPU workarounds
(vllm_cpu.py, through site/sitecustomize.py) in every process the engine starts, and talks to
it over a socket pair. Its logs (vLLM's, the connector's) go to a file that a failure prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from e2e_engine import MAX_TOKENS
from ecd_testing import Daemon
from vllm_cpu import FLAG as CPU_WORKAROUNDS

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHM = Path("/dev/shm")
START_TIMEOUT_S = 300.0  # imports alone take ~10 s per process on an idle 2-core machine
CALL_TIMEOUT_S = 300.0
CAPACITY = 64 << 20  # bytes: ECCPUConnector's ec_cpu_bytes takes no units
# The suite's daemons' flags (conftest.py's daemon fixture says why --pending-timeout is 300).
DAEMON_FLAGS = ("--max-bytes", "512MiB", "--log-level", "debug", "--pending-timeout", "300")


@dataclass(frozen=True)
class EngineSpec:
    """What one engine is built from (sent to its process as JSON)."""

    model: str
    role: str | None = None  # ec_producer / ec_consumer / ec_both; None: no connector
    address: str | None = None
    pool: str | None = None
    dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)
    # ECDaemonConnector (ecd), or vLLM's ECCPUConnector (one engine's own cache) to compare with
    connector: str = "ECDaemonConnector"
    max_model_len: int = 256  # a prompt holds one image's tokens: 16 with the tiny model
    # A file holding the seconds each encoder call sleeps first (test only: e2e_engine.py).
    encode_delay_file: str | None = None
    # vLLM's request stats (its time to first token): off by default, as vLLM's LLM has them.
    log_stats: bool = False

    def to_json(self) -> str:
        spec = asdict(self)
        if self.connector == "ECCPUConnector":
            spec["extra"] = {"ec_cpu_bytes": CAPACITY, **self.extra}
        elif self.role is not None:
            spec["extra"] = {
                "ecd_address": self.address,
                "ec_cpu_bytes": CAPACITY,
                **({"ecd_pool": self.pool} if self.pool else {}),
                **self.extra,
            }
        return json.dumps(spec)


@dataclass(frozen=True)
class Generated:
    """The answer to `Engine.generate`: per request (one image each) its greedy tokens,
    latency and time to first token (as vLLM measured it, when it did), and how many encoder
    outputs the engine computed and steps it ran meanwhile."""

    tokens: list[list[int]]
    latency_s: list[float]
    encoded: int
    ttft_s: list[float | None] = field(default_factory=list)
    steps: int = 0


class Leftovers:
    """What an engine's processes would leave on the machine once killed (the suite SIGKILLs
    engines on purpose, and a close ends with a SIGKILL of whatever is left of one): vLLM's
    IPC sockets, which go in a directory of the engine's own here (VLLM_RPC_BASE_PATH); the
    shared-memory segments its processes create (/dev/shm/psm_*, Python's
    multiprocessing.shared_memory, a few hundred MiB each), their named semaphores
    (/dev/shm/sem.mp-*) and the file its workers meet at (vllm_dist_*, in the temporary
    directory), all unlinked only by a shutdown that runs to its end. `remove`, once the
    engine's processes are gone, takes away the directory, and the segments and files that
    appeared since the engine started that no live process has open or mapped: another
    engine's, running, are left alone. Named semaphores younger than START_TIMEOUT_S stay: the
    process that creates one maps it under a temporary name (glibc's sem_open), so no scan can
    see it in use until a child opens it by name, and unlinking it before then failed the start
    of an engine another test (another suite's run) was starting ("FileNotFoundError" in
    SemLock._rebuild); a few 32-byte files of a killed engine stay instead."""

    FILES = (SHM / "psm_*", SHM / "sem.mp-*", Path(tempfile.gettempdir()) / "vllm_dist_*")
    SEMAPHORES = "sem.mp-"

    def __init__(self) -> None:
        self.rpc_dir = tempfile.mkdtemp(prefix="vllm-rpc-")  # short: socket paths are limited
        self._before = self._files()

    def remove(self) -> None:
        shutil.rmtree(self.rpc_dir, ignore_errors=True)
        new = self._files() - self._before
        young = time.time() - START_TIMEOUT_S
        for path in new - self._in_use(new):
            with contextlib.suppress(FileNotFoundError):
                if Path(path).name.startswith(self.SEMAPHORES) and os.stat(path).st_mtime > young:
                    continue
                os.unlink(path)

    def _files(self) -> set[str]:
        return {str(path) for pattern in self.FILES for path in pattern.parent.glob(pattern.name)}

    @staticmethod
    def _in_use(paths: set[str]) -> set[str]:
        """Those of `paths` some live process has open or mapped."""
        used: set[str] = set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
                maps = (proc / "maps").read_text()
                used.update(path for path in paths if path in maps)
                for fd in (proc / "fd").iterdir():
                    with contextlib.suppress(OSError):
                        if (target := os.readlink(fd)) in paths:
                            used.add(target)
        return used


def engine_env(leftovers: Leftovers) -> dict[str, str]:
    """The environment of an engine's processes (an `LLM` engine's or a server's): the CPU
    workarounds in each, vLLM's IPC sockets in the directory `leftovers` takes away."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE / "site"), str(HERE), str(REPO)]),
        CPU_WORKAROUNDS: "1",
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        # collective_rpc sends engine.count_encoder_outputs to the worker by pickle.
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_RPC_BASE_PATH": leftovers.rpc_dir,
        # vLLM's CPU worker pins its threads to one core by default, the same core (0) in
        # every engine: two engines' workers then share that core while the rest of the
        # machine idles, and a worker's shared-memory reader busy-polls (sched_yield) for a
        # second after each step it is sent, so an engine stepping even 20 times a second
        # (one that holds a request for another's encode) keeps its worker spinning on the
        # core the other engine's worker encodes on (its step took 16-23 s instead of 3 s
        # here, and past vLLM's 300 s execute_model timeout in some runs). Unpinned, the
        # kernel spreads them.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def kill_group(proc: subprocess.Popen[bytes], leftovers: Leftovers | None) -> None:
    """SIGKILL the process group `proc` leads (an engine started with start_new_session: its
    engine core and worker too) and, once every process of it has exited (a SIGKILL is
    delivered at once, but a process takes a moment to exit and let go of its mappings), take
    away what they left (`leftovers`, for a group that runs vLLM). Exited, not reaped: a
    container's init may never reap the orphans."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10.0
    while _group_running(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if leftovers is not None:
        leftovers.remove()


def _group_running(pgid: int) -> bool:
    """Whether a process of the group `pgid` has not exited yet (zombies have)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so after its ")"
            state, _, pgrp = stat.read_text().rpartition(")")[2].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                return True
    return False


def log_tail(path: Path, lines: int = 80) -> str:
    """The last lines of an engine's log, for a failure's message."""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class EngineFailed(RuntimeError):
    """The engine process reported an error, or died; the message holds its log's tail."""


class Engine:
    def __init__(self, spec: EngineSpec, log_dir: Path, name: str) -> None:
        self.spec = spec
        self.log_path = log_dir / f"engine-{name}.log"
        self.answers: list[Generated] = []  # every generate's, for the suite's report
        self._leftovers = Leftovers()
        ours, theirs = socket.socketpair()
        env = engine_env(self._leftovers)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import e2e_engine; e2e_engine.main()",
                    spec.to_json(),
                    str(theirs.fileno()),
                ],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # one process group: kill() reaches vLLM's children
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=[theirs.fileno()],
            )
        theirs.close()
        self._conn = Connection(ours.detach())
        try:
            started = self._answer(START_TIMEOUT_S)
        except BaseException:
            self.kill()  # a start that failed leaves no engine behind
            raise
        self.start_s: float = started["start_s"]

    def generate(self, *images: int, max_tokens: int = MAX_TOKENS) -> Generated:
        """One request per image, in turn, each waited for (with max_tokens=1, its latency is
        its time to first token)."""
        answer = Generated(**self._call("generate", list(images), max_tokens))
        self.answers.append(answer)
        return answer

    def reset_caches(self) -> None:
        """Empty vLLM's own encoder cache and prefix cache: the next request of a seen image
        asks the connector (vLLM skips a repeated image in one engine by itself) and prefills
        anew, so that a hit's figure measures the cache, not vLLM's reuse of the encode's KV
        blocks."""
        self._call("reset_caches")

    def close(self, timeout_s: float = 120.0) -> int:
        """Shut the engine down as its user would (vLLM's shutdown, the connector's too)."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):  # it died meanwhile
                self._conn.send(("quit", ()))
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill()  # whatever of the engine's process group is left
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the engine's process group (its engine core and worker too), and take away
        what they leave."""
        kill_group(self.proc, self._leftovers)
        self._conn.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _call(self, command: str, *args: Any) -> Any:
        self._conn.send((command, args))
        return self._answer(CALL_TIMEOUT_S)

    def _answer(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.2):
            if self.proc.poll() is not None and not self._conn.poll(0):
                raise EngineFailed(
                    f"engine exited with {self.proc.returncode}:\n{log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise EngineFailed(f"engine silent for {timeout_s} s:\n{log_tail(self.log_path)}")
        status, answer = self._conn.recv()
        if status == "error":
            raise EngineFailed(f"{answer}\nengine log:\n{log_tail(self.log_path)}")
        return answer


class Engines:
    """Starts engines for one test (on its daemon unless told otherwise) and shuts down those
    still running when it ends."""

    def __init__(self, model: str, daemon: Daemon, log_dir: Path) -> None:
        self.model, self.daemon, self.log_dir = model, daemon, log_dir
        self.started: list[Engine] = []

    def start(self, role: str | None, pool: str | None = "e2e", **spec: Any) -> Engine:
        spec.setdefault("address", self.daemon.address)
        spec.setdefault("model", self.model)
        engine = Engine(
            EngineSpec(role=role, pool=pool, **spec),
            self.log_dir,
            f"{len(self.started)}-{role}",
        )
        self.started.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.started:
            engine.close()
            print(f"engine log: {engine.log_path}")
