"""The cluster under faults, checked as Jepsen checks a database (docs/guarantees.md): three nodes
and a master on test hosts (tests/hosts_testing.py) take a random workload (puts, gets with and
without waits, first encodes of one key asked on every node at once, evictions from small pools)
while a schedule kills and restarts daemons and the master, cuts nodes from the master and from
each other, and slows (50 ms) or drops (1%) what a node receives. Every operation goes into a
history that tests/checker_testing.py checks once the faults are healed.

Replayable: ECD_CHECKER_SEED fixes the workload and the schedule (printed on every run);
ECD_CHECKER_SECONDS sets the long profile's length (make test-cluster-faults)."""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field

import pytest
import torch
from checker_testing import Fault, History, Op, digest, violations
from cluster_testing import NAMESPACE, POOL, Master, cluster_stats
from ecd_testing import Daemon, wait_until
from hosts_testing import Host, Hosts, master_on, node_on

from ec_client import Client, Consumer, EntryState, Producer, Status
from ec_client.data.producer import PutStatus
from ec_daemon.cluster.republish import MARK_EVERY_S

NODES = ("n1", "n2", "n3")
ROWS = 16  # a value: 16 rows of 2048 bf16, 16 blocks
KEYS = 48  # the keys puts and gets pick from: 768 blocks, three times a pool
SMALL_POOL = {**POOL, "capacity_bytes": 1 << 20}  # 256 blocks: 16 values, so puts evict
WAIT_MS = 1500
PULL_TIMEOUT_S = 2.0  # each node's --pull-timeout: a read cut off misses within it
# Each node's --republish-every: a node walks its pool this often, putting back what the store
# lacks (an entry whose value was in a killed node's segment, gone at the master's client TTL).
REPUBLISH_EVERY_S = 2.0
CLIENT_TTL_S = 10.0  # the master's --client_ttl (Mooncake's default)


def value(key: str, writer: str, attempt: int) -> torch.Tensor:
    """The bytes `writer` puts under `key` at its `attempt`th put: its own, whoever reads them."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{key}/{writer}/{attempt}".encode()))
    return torch.randn(ROWS, 2048, generator=generator).to(torch.bfloat16)


def seen(tensor: torch.Tensor | None) -> tuple[str, str]:
    if tensor is None:
        return "none", ""
    return "value", digest(tensor.contiguous().view(torch.uint8).numpy().tobytes())


@dataclass
class Node:
    """A daemon on a test host and a client of its own per caller, opened again after a restart."""

    name: str
    host: Host
    daemon: Daemon
    lock: threading.Lock = field(default_factory=threading.Lock)  # restarts
    clients: dict[str, Client] = field(default_factory=dict)

    def client(self, caller: str) -> Client:
        if caller not in self.clients:
            client = self.daemon.client(name=caller, call_timeout_s=10)
            try:
                client.open_pool("shared", **SMALL_POOL, cluster_namespace=NAMESPACE)
            except BaseException:
                client.close(flush_timeout_s=0)
                raise
            self.clients[caller] = client
        return self.clients[caller]

    def drop(self, caller: str) -> None:
        """Forget `caller`'s client (after an error: its daemon may have died)."""
        if (client := self.clients.pop(caller, None)) is not None:
            with suppress(Exception):
                client.close(flush_timeout_s=0)

    def restart(self) -> None:
        with self.lock:
            self.daemon.start()


@dataclass
class Run:
    hosts: Hosts
    master: Master
    master_host: Host
    nodes: list[Node]
    rng: random.Random
    history: History = field(default_factory=History)
    record_lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: dict[tuple[str, str], int] = field(default_factory=dict)

    def record(self, op: Op) -> None:
        with self.record_lock:
            self.history.ops.append(op)

    def op(
        self,
        kind: str,
        node: Node,
        caller: str,
        key: str,
        call: Callable[[Client], tuple[str, str]],
        wait_ms: int = 0,
        written: str = "",
    ) -> str:
        """Run `call` on `node`'s client for `caller` and record it: its outcome and value, or
        "error" (and the value it was writing) if it raised. Timed from the call: a client made
        first (after an error: its daemon may be restarting) waits for the daemon and its
        OpenPool, which is no part of the operation's wait."""
        start = time.monotonic()
        try:
            client = node.client(caller)
            start = time.monotonic()
            outcome, got = call(client)
        except Exception:
            outcome, got = "error", written
            node.drop(caller)
            time.sleep(0.1)  # its daemon may be down: not a spin
        self.record(Op(kind, node.name, key, start, time.monotonic(), outcome, got, wait_ms))
        return outcome

    def put(self, node: Node, caller: str, key: str) -> str:
        attempt = self.attempts[(key, node.name)] = self.attempts.get((key, node.name), 0) + 1
        tensor = value(key, node.name, attempt)
        written = seen(tensor)[1]

        def call(client: Client) -> tuple[str, str]:
            status = Producer(client, "shared").put(key, tensor)
            ok = status in (PutStatus.COMMITTING, PutStatus.STORED)
            return ("ok" if ok else status.value), written

        return self.op("put", node, caller, key, call, written=written)

    def get(self, node: Node, caller: str, key: str, wait_ms: int, kind: str = "get") -> str:
        return self.op(
            kind, node, caller, key,
            lambda c: seen(Consumer(c, "shared", watch=False).get(key, wait_ms=wait_ms)),
            wait_ms,
        )  # fmt: skip

    def encode(self, node: Node, key: str) -> None:
        """As an engine does: a Step's Acquire; if it grants the encode (a miss), put; if another
        node writes it (pending), wait for it."""

        def acquire(client: Client) -> tuple[str, str]:
            [answer] = client.step("shared", acquires=[key.encode()]).acquires
            if answer.status is Status.HIT:  # the pin goes back: the checks read by gets
                client.step("shared", releases=[answer.lease_id])
            return answer.status.value, ""

        answer = self.op("acquire", node, "race", key, acquire)
        if answer == Status.MISS.value:
            self.put(node, "race", key)
        elif answer == Status.PENDING.value:
            self.get(node, "race", key, WAIT_MS)

    def work(self, node: Node, until: float, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < until:
            key = f"k{rng.randrange(KEYS)}"
            roll = rng.random()
            if roll < 0.4:
                self.put(node, "worker", key)
            elif roll < 0.7:
                self.get(node, "worker", key, 0)
            else:
                self.get(node, "worker", key, WAIT_MS)

    def race(self, until: float, seed: int) -> None:
        """Every so often a new key asked for on every node at once."""
        rng = random.Random(seed)
        serial = 0
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            while time.monotonic() < until:
                serial += 1
                key = f"race-{seed}-{serial}"
                list(pool.map(self.encode, self.nodes, [key] * len(self.nodes)))
                time.sleep(rng.uniform(0.1, 0.5))

    def fault(self, kind: str, hold_s: float) -> None:
        """Inject one fault of `kind`, hold it `hold_s`, heal it; recorded with what it touched."""
        node, other = self.rng.sample(self.nodes, 2)
        start = time.monotonic()
        touched: set[str] = {node.name}
        if kind == "kill-node":
            with node.lock:
                node.daemon.kill()
            time.sleep(hold_s)
            node.restart()
        elif kind == "kill-master":
            touched = {"master"}
            self.master.stop()
            time.sleep(hold_s)
            self.master.start()
        elif kind == "cut-master":
            touched.add("master")
            self.hosts.cut(node.host, self.master_host)
            time.sleep(hold_s)
            self.hosts.heal(node.host, self.master_host)
        elif kind == "cut-node":
            touched.add(other.name)
            self.hosts.cut(node.host, other.host)
            time.sleep(hold_s)
            self.hosts.heal(node.host, other.host)
        else:  # "delay" or "loss": what the node receives
            self.hosts.shape(node.host, **({"delay_ms": 50} if kind == "delay" else {"loss": 0.01}))
            time.sleep(hold_s)
            self.hosts.shape(node.host)
        self.history.faults.append(Fault(kind, frozenset(touched), start, time.monotonic()))

    def schedule(self, until: float) -> None:
        kinds = ("kill-node", "kill-master", "cut-master", "cut-node", "delay", "loss")
        turn = 0
        while time.monotonic() < until:
            kind = kinds[turn % len(kinds)] if turn < len(kinds) else self.rng.choice(kinds)
            self.fault(kind, self.rng.uniform(0.5, 2.0))
            turn += 1
            time.sleep(self.rng.uniform(0.2, 1.0))

    def final(self) -> None:
        """After healing: each key some node holds read on every node. Who holds a key is asked
        just before its reads: the reads of the keys before it brought values into each node's
        small pool, evicting others. First every node connected, and a mark check's period
        (docs/design.md §13): a master restarted last, without HA, has an empty directory until
        each node's next check finds its mark gone and republishes; and the values a killed
        daemon's segment held leave the store a client TTL after the kill, put back by the
        nodes that hold them at their next walk."""
        for node in self.nodes:
            wait_until(lambda n=node: cluster_stats(n.client("final")).connected, 30)
        kills = [fault.start for fault in self.history.faults if fault.kind == "kill-node"]
        lost_at = max(kills, default=0.0) + CLIENT_TTL_S
        time.sleep(max(MARK_EVERY_S, lost_at - time.monotonic() + REPUBLISH_EVERY_S) + 1.0)
        for key in sorted({op.key for op in self.history.ops}):
            holders = {
                node.name
                for node in self.nodes
                if node.client("final").lookup("shared", [key])[0].state is EntryState.READY
            }
            if holders:
                self.history.held[key] = holders
                for node in self.nodes:
                    self.get(node, "final", key, 10_000, kind="final")


@contextmanager
def cluster(hosts: Hosts) -> Iterator[tuple[Master, Host, list[Node]]]:
    on_master = hosts.add("master")
    with master_on(on_master) as master, ExitStack() as stack:
        nodes = []
        for name in NODES:
            host = hosts.add(name)
            daemon = stack.enter_context(
                node_on(
                    host,
                    master,
                    "--pull-timeout",
                    str(PULL_TIMEOUT_S),
                    "--republish-every",
                    str(REPUBLISH_EVERY_S),
                )
            )
            nodes.append(Node(name, host, daemon))
        for node in nodes:
            wait_until(lambda n=node: cluster_stats(n.client("final")).connected, 30)
        try:
            yield master, on_master, nodes
        finally:
            for node in nodes:
                for caller in list(node.clients):
                    node.drop(caller)


def run_checked(hosts: Hosts, seconds: float, seed: int, min_ops: int, min_faults: int) -> None:
    print(f"checker: seed {seed} (ECD_CHECKER_SEED={seed} replays it), {seconds:.0f} s")
    with cluster(hosts) as (master, on_master, nodes):
        run = Run(hosts, master, on_master, nodes, random.Random(seed))
        until = time.monotonic() + seconds
        with ThreadPoolExecutor(len(nodes) + 1) as threads:
            jobs = [threads.submit(run.work, node, until, seed + i) for i, node in enumerate(nodes)]
            jobs.append(threads.submit(run.race, until, seed))
            run.schedule(until)
            for job in jobs:
                job.result()
        run.final()
    history = run.history
    found = violations(history, NODES)
    kinds = sorted({fault.kind for fault in history.faults})
    errors = sum(op.outcome == "error" for op in history.ops)
    answered = len(history.ops) - errors
    asked = [op.outcome for op in history.ops if op.kind == "acquire"]
    print(
        f"checker: {len(history.ops)} ops ({errors} errors; first encodes asked "
        f"{len(asked)}: {asked.count('miss')} granted, {asked.count('pending')} pending, "
        f"{asked.count('hit')} hit), "
        f"{len(history.faults)} faults "
        f"({', '.join(kinds)}), {len(history.held)} keys held after healing, "
        f"{len(found)} violations"
    )
    for violation in found:
        print(f"checker: violation: {violation}")
    for line in excerpt(history, found):
        print(f"checker: {line}")
    assert found == []
    assert answered >= min_ops and len(history.faults) >= min_faults


def excerpt(history: History, found: list[str]) -> list[str]:
    """The faults, and the last operations on each key a violation names, in time order."""
    keys = {op.key for op in history.ops if any(repr(op.key) in line for line in found)}
    if not keys:
        return []
    ops = [op for op in history.ops if op.key in keys][-24:]
    since = ops[0].start
    events = [(op.start, f"{op.start - since:8.3f} {op}") for op in ops]
    events += [(f.start, f"{f.start - since:8.3f} {f}") for f in history.faults if f.end >= since]
    return [line for _, line in sorted(events)]


def seed() -> int:
    return int(os.environ.get("ECD_CHECKER_SEED") or random.randrange(1 << 30))


def test_a_short_run_under_every_kind_of_fault_breaks_no_guarantee(hosts: Hosts) -> None:
    # the schedule's first turns take each kind in turn: four at least (kills restart slowly)
    run_checked(hosts, seconds=15, seed=seed(), min_ops=150, min_faults=4)


@pytest.mark.cluster_faults
@pytest.mark.timeout(float(os.environ.get("ECD_CHECKER_SECONDS", "180")) + 300)
def test_a_long_run_under_random_faults_breaks_no_guarantee(hosts: Hosts) -> None:
    seconds = float(os.environ.get("ECD_CHECKER_SECONDS", "180"))
    run_checked(hosts, seconds, seed(), min_ops=int(10 * seconds), min_faults=int(seconds / 3))
