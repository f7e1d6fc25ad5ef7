"""Test support for the fault, fuzz and load suites: self-checking tensor contents, real client
processes (pre-warmed, so a trial does not wait for torch to import), and the checks every trial
ends with.

Contents: the bytes stored under a key are a function of the key (and a version), so any reader
can check any entry without being told what was written: word 0 holds the version, word i > 0
holds seed(key, version) XOR i. A mixed-up key, a shifted or swapped block, a torn write or a
stale version all show up as a mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from ecd_testing import REPO, assert_blocks_accounted

from ec_client import Client, EntryState
from ec_protocol.types import Key, key_bytes

T = TypeVar("T")

# How many trials each randomized fault kind runs, and the seed they draw their random points from.
FAULT_TRIALS = int(os.environ.get("ECD_FAULT_TRIALS", "2"))
FAULT_SEED = int(os.environ.get("ECD_FAULT_SEED") or random.SystemRandom().randrange(1 << 32))


def trial_rng(kind: str, trial: int) -> tuple[random.Random, str]:
    """The random source of one trial, and how to replay it (for failure messages)."""
    replay = f"replay with ECD_FAULT_SEED={FAULT_SEED} (trial {trial} of {kind})"
    return random.Random(f"{FAULT_SEED}-{kind}-{trial}"), replay


# Figures measured by the suites (e.g. seconds from a client's death to its blocks being free),
# printed at the end of the run by the suites' conftest and written to JSON when asked.
FIGURES: dict[str, list[float]] = defaultdict(list)


# How often something happened over the trials, e.g. kills that landed mid-batch: [yes, total].
TALLIES: dict[str, list[int]] = defaultdict(lambda: [0, 0])


def record_figure(name: str, value: float) -> None:
    FIGURES[name].append(value)


def record_tally(name: str, happened: bool) -> None:
    TALLIES[name][0] += happened
    TALLIES[name][1] += 1


# ---- contents ----------------------------------------------------------------------------------


def _seed(key: Key, version: int) -> np.uint64:
    digest = hashlib.sha256(key_bytes(key) + version.to_bytes(8, "little")).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def expected_bytes(key: Key, nbytes: int, version: int = 0) -> bytes:
    """What an entry of `nbytes` stored under `key` (written as `version`) must contain."""
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64) ^ _seed(key, version)
    if words.size:
        words[0] = np.uint64(version)
    return words.tobytes()[:nbytes]


def stored_version(raw: bytes) -> int:
    """The version an entry's bytes claim (word 0); check it with expected_bytes."""
    return int.from_bytes(raw[:8].ljust(8, b"\0"), "little")


def tensor_bytes(tensor: Any) -> bytes:
    """The raw bytes of a torch tensor (any dtype)."""
    import torch

    return bytes(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def make_tensor(key: Key, nbytes: int, dtype: str = "uint8", version: int = 0) -> Any:
    """A tensor whose bytes are expected_bytes(key, nbytes, version): 2-D when it divides."""
    import torch

    dt = getattr(torch, dtype)
    itemsize = torch.empty((), dtype=dt).element_size()
    assert nbytes % itemsize == 0, f"{nbytes} bytes is not a whole number of {dtype}"
    flat = torch.frombuffer(bytearray(expected_bytes(key, nbytes, version)), dtype=torch.uint8)
    items = nbytes // itemsize
    rows = next((r for r in (64, 16, 4, 2) if items % r == 0), 1)
    return flat.view(dt).reshape(rows, items // rows)


def check_entry_bytes(key: Key, raw: bytes, version: int | None = 0) -> str | None:
    """None if `raw` is what `key` must hold (any version if version is None), else why not."""
    claimed = stored_version(raw) if version is None else version
    if raw == expected_bytes(key, len(raw), claimed):
        return None
    expected = expected_bytes(key, len(raw), claimed)
    first = next(i for i, (a, b) in enumerate(zip(raw, expected, strict=True)) if a != b)
    return f"{key_bytes(key)!r}: {len(raw)} bytes differ from version {claimed} at byte {first}"


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# ---- checks ------------------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, period_s: float = 0.01
) -> float:
    """Poll until predicate() holds; returns the seconds it took. Fails after timeout_s."""
    started = time.monotonic()
    while not predicate():
        elapsed = time.monotonic() - started
        assert elapsed < timeout_s, f"timed out after {timeout_s:.1f} s waiting for {what}"
        time.sleep(period_s)
    return time.monotonic() - started


def ready_keys(client: Client, engine_id: str) -> dict[bytes, int]:
    """READY key -> nbytes, from the daemon's listing."""
    return {
        e.key: e.spec.nbytes for e in client.iter_entries(engine_id) if e.state is EntryState.READY
    }


def read_back(
    client: Client,
    engine_id: str,
    keys: Iterable[bytes],
    version: int | None = 0,
) -> int:
    """Read `keys` through a real Consumer (CRC-verified where the producer stored one) and check
    every byte against expected_bytes. All must hit. Returns how many were checked."""
    from ec_client import Consumer

    consumer = Consumer(client, engine_id, verify=True)
    wanted = sorted(keys)
    for batch in chunks(wanted, 64):
        got = consumer.get_many(list(batch))
        for key in batch:
            tensor = got[key]
            assert tensor is not None, f"{key!r} was READY but its Acquire missed"
            problem = check_entry_bytes(key, tensor_bytes(tensor), version)
            assert problem is None, problem
    client.flush()  # the pins go back in the background once the copies landed
    return len(wanted)


def assert_intact(client: Client, engine_id: str, version: int | None = 0) -> dict[bytes, int]:
    """What must hold after every trial: the daemon serves, nothing is PENDING or pinned, every
    block is accounted for once, and every READY entry reads back bit-identical. Returns the
    READY keys with their sizes."""
    client.flush()  # this client's own commits and releases, sent in the background
    assert client.health() == "SERVING"
    [pool] = client.stats(engine_id).pools
    assert pool.entries_pending == 0, f"{pool.entries_pending} entries still PENDING"
    assert pool.pins == 0, f"{pool.pins} pins still held"
    assert_blocks_accounted(client, engine_id)
    ready = ready_keys(client, engine_id)
    assert pool.entries_ready == len(ready)
    read_back(client, engine_id, ready, version)
    # Reading took pins and gave them back.
    assert client.stats(engine_id).pools[0].pins == 0
    return ready


def settled(client: Client, engine_id: str) -> bool:
    """Nothing PENDING or pinned, and every removed entry's blocks free: an entry deleted while
    a reader lock-pinned it stays held until the daemon's next sweep after the lock goes
    (docs/design.md §4), a moment after its reader died."""
    [pool] = client.stats(engine_id).pools
    return pool.entries_pending == 0 and pool.pins == 0 and pool.held_blocks == 0


# ---- client processes --------------------------------------------------------------------------

# A client process imports torch and the client library, says "warm", then runs the job it is
# sent on stdin: {"code": ..., "vars": {...}}. `say` prints a line the test can wait for.
CLIENT_PRELUDE = """
import json, os, random, sys, time
import torch
from ec_client import AllocateItem, Client, Consumer, EntryState, PoolMapping, Producer, PutStatus
from ec_client import Status
from workload_testing import expected_bytes, make_tensor, tensor_bytes, check_entry_bytes

def say(*words):
    print(*words, flush=True)

say("warm")
_job = json.loads(sys.stdin.readline())
globals().update(_job["vars"])
exec(compile(_job["code"], "<client job>", "exec"))
"""


class ClientProcess:
    """A real client process (its own interpreter, session, mappings). Lines it prints are
    collected by a thread so a test can wait for one with a timeout."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT_PRELUDE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        self.said: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_stdout, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for reader in self._readers:
            reader.start()
        self.killed_at: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def describe(self) -> str:
        return f"client process {self.pid} (exit {self.proc.poll()}):\n{''.join(self.stderr)}"

    def expect(self, *words: str, timeout_s: float = 60.0) -> str:
        """Wait for a line starting with one of `words`; earlier lines are kept in `said`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise AssertionError(
                    f"no {words} after {timeout_s} s from {self.describe()}"
                ) from None
            if line is None:
                self.lines.put(None)
                raise AssertionError(f"exited before saying {words}: {self.describe()}")
            self.said.append(line)
            if any(line == word or line.startswith(word + " ") for word in words):
                return line

    def run(self, code: str, **variables: Any) -> ClientProcess:
        """Start the job (the process must be warm: see Interpreters)."""
        assert self.proc.stdin is not None
        job = {"code": textwrap.dedent(code), "vars": variables}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self

    def send(self, line: str) -> None:
        """A line for the running job to read from stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time of the kill, once the process is gone."""
        self.killed_at = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.drain()
        return self.killed_at

    def drain(self) -> list[str]:
        """Every line it printed that no expect() consumed (after it exited)."""
        for reader in self._readers:
            reader.join(10)
        while True:
            line = self.lines.get()
            if line is None:
                self.lines.put(None)
                return self.said
            self.said.append(line)

    def finish(self, timeout_s: float = 60.0) -> list[str]:
        """Wait for a clean exit; every line it printed."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running after {timeout_s} s: {self.describe()}") from None
        assert code == 0, self.describe()
        return self.drain()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


class Interpreters:
    """Client processes started ahead of need: taking one returns a process that has (nearly)
    finished importing torch, and starts the next in the background."""

    def __init__(self, spares: int = 1) -> None:
        self._spares = [ClientProcess() for _ in range(spares)]
        self._taken: list[ClientProcess] = []

    def take(self) -> ClientProcess:
        proc = self._spares.pop(0)
        self._spares.append(ClientProcess())
        proc.expect("warm")
        self._taken.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._spares + self._taken:
            proc.close()


def daemon_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
