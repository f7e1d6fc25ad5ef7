"""The cluster tests' test hosts (docs/design.md §13): each node (a daemon and its clients), each
master and etcd on a host of its own, a Linux network namespace with its own address on one
bridge, so that a process reaches another only over its host's link, which a test can slow, make
lossy or cut, and heal.

Layout: a `switch` namespace holds the bridge; each host is a namespace whose `eth0` is one end
of a veth pair, the other end on the bridge. Nothing is made in the machine's own namespace, so
tests send traffic only between the hosts they made, and deleting the namespaces takes every
link with them. Namespaces are named `ecd-hosts-<pid>-<serial>-<host>`: two runs never collide,
and a run sweeps away, at its start, those of runs whose process is gone (a crashed run's).

Links: `shape` delays and drops what a host receives (iptables in its namespace: a `statistic`
match drops, an NFQUEUE rule hands packets to tests/link_delay.py, which lets each go on after
the delay: this machine's kernel has no netem); the round trip between two hosts is the sum of
their delays. On receipt, not on sending: a packet held on its sender's host still counts
against its TCP socket's small-queue limit (about 1 ms of its rate), which throttled a 20 ms
link to 0.3 MB/s; held on the receiver's, it does not (8 MiB in 0.2 s).

Cuts: `cut` drops everything between two hosts, or between a host and every other (iptables in
the host's namespace: packets vanish, as in a partition, rather than being refused); `heal`
undoes it. Daemons' Unix sockets are on the shared filesystem: tests reach them as usual.

Needs root and iproute2's `ip` and iptables (`make test-hosts` installs them); tests that use
the `hosts` fixture skip, saying why, where a namespace cannot be made.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cluster_testing import Master, started
from ecd_testing import Daemon, running_daemon

from ec_daemon.cluster.listening import listeners

PREFIX = "ecd-hosts-"
SUBNET = "10.47.0"  # each run's hosts are alone on their bridge: every run may use it
LINK_DELAY = Path(__file__).with_name("link_delay.py")
_serials = itertools.count()


@dataclass(frozen=True)
class Host:
    """One test host: a network namespace whose `eth0` has `address`."""

    name: str
    netns: str
    address: str

    @property
    def launcher(self) -> tuple[str, ...]:
        """Runs a command on this host (prefix its argv)."""
        return ("ip", "netns", "exec", self.netns)


def hosts_missing() -> str:
    """Why test hosts cannot be made here; empty when they can (a namespace still may fail)."""
    if os.geteuid() != 0:
        return "the test hosts (network namespaces) need root: run the tests as root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"the test hosts need `{tool}` (iproute2, iptables): run make test-hosts as root"
    return ""


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _remove_namespace(netns: str) -> None:
    """Kill every process in `netns` but this one (tests/link_figures.py enters a host), then
    delete it (with its links)."""
    for pid in _run("ip", "netns", "pids", netns).split():
        if int(pid) == os.getpid():
            continue
        with suppress(ProcessLookupError):  # gone since the listing
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> list[str]:
    """Remove the namespaces of runs whose process is gone; returns their names. Only names
    with the suite's prefix are touched, and never a live run's."""
    swept = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        found = re.match(rf"{re.escape(PREFIX)}(\d+)-", name)
        if found and not _alive(int(found.group(1))):
            _remove_namespace(name)
            swept.append(name)
    return swept


@dataclass
class Hosts:
    """The test hosts of one test (`running_hosts()`, the `hosts` fixture)."""

    serial: int = field(default_factory=lambda: next(_serials))
    hosts: list[Host] = field(default_factory=list)
    delayers: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    cuts: set[tuple[str, ...]] = field(default_factory=set)

    @property
    def switch(self) -> str:
        return self.netns("switch")

    def netns(self, name: str) -> str:
        return f"{PREFIX}{os.getpid()}-{self.serial}-{name}"

    def start(self) -> None:
        _run("ip", "netns", "add", self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")

    def add(self, name: str) -> Host:
        """A new host on the bridge, its link up, unshaped and uncut."""
        host = Host(name, self.netns(name), f"{SUBNET}.{len(self.hosts) + 1}")
        self.hosts.append(host)
        port = f"p{len(self.hosts)}"  # its end on the bridge, in the switch's namespace
        _run("ip", "netns", "add", host.netns)
        _run("ip", "-n", self.switch, "link", "add", port, "type", "veth",
             "peer", "name", "eth0", "netns", host.netns)  # fmt: skip
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.netns, "link", "set", "eth0", "up")
        _run("ip", "-n", host.netns, "link", "set", "lo", "up")
        # what it receives goes through its own chain, which `shape` rewrites; cuts go before it
        self.iptables(host, "-N", "ECD-SHAPE")
        self.iptables(host, "-A", "INPUT", "-i", "eth0", "-j", "ECD-SHAPE")
        return host

    def iptables(self, host: Host, *rule: str) -> None:
        _run(*host.launcher, "iptables", "-w", *rule)

    def popen(self, host: Host, *argv: str, stdout: int | None = None) -> subprocess.Popen[str]:
        """`argv` started on `host`; its namespace's teardown kills it if the test did not."""
        return subprocess.Popen([*host.launcher, *argv], text=True, stdout=stdout)

    def shape(self, host: Host, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """From now on, what `host` receives from the others waits `delay_ms` and is dropped with
        probability `loss` (0 to 1); 0 and 0 make its link plain again."""
        self.iptables(host, "-F", "ECD-SHAPE")
        if (delayer := self.delayers.pop(host.name, None)) is not None:
            delayer.kill()
            delayer.wait()
        if loss:
            self.iptables(host, "-A", "ECD-SHAPE", "-m", "statistic", "--mode", "random",
                          "--probability", str(loss), "-j", "DROP")  # fmt: skip
        if delay_ms:
            delayer = self.popen(host, sys.executable, str(LINK_DELAY), "--delay-ms",
                                 str(delay_ms), stdout=subprocess.PIPE)  # fmt: skip
            self.delayers[host.name] = delayer
            assert delayer.stdout is not None
            if delayer.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the link delay of {host.name} did not start")
            self.iptables(host, "-A", "ECD-SHAPE", "-j", "NFQUEUE", "--queue-num", "0")

    def _cut_rules(self, host: Host, other: Host | None) -> list[tuple[str, ...]]:
        if other is None:
            return [("INPUT", "-i", "eth0", "-j", "DROP"), ("OUTPUT", "-o", "eth0", "-j", "DROP")]
        return [
            ("INPUT", "-s", other.address, "-j", "DROP"),
            ("OUTPUT", "-d", other.address, "-j", "DROP"),
        ]

    def cut(self, host: Host, other: Host | None = None) -> None:
        """Drop everything between `host` and `other` (every other host if None), both ways."""
        key = (host.name, other.name if other else "")
        if key in self.cuts:
            raise ValueError(f"{host.name} is cut from {other.name if other else 'all'} already")
        for rule in self._cut_rules(host, other):
            self.iptables(host, "-I", *rule)
        self.cuts.add(key)

    def heal(self, host: Host, other: Host | None = None) -> None:
        """Undo `cut(host, other)`."""
        key = (host.name, other.name if other else "")
        if key not in self.cuts:
            raise ValueError(f"{host.name} is not cut from {other.name if other else 'all'}")
        for rule in self._cut_rules(host, other):
            self.iptables(host, "-D", *rule)
        self.cuts.remove(key)

    def close(self) -> None:
        """Every process on the hosts killed, every namespace (and so every link) deleted."""
        for delayer in self.delayers.values():
            delayer.kill()
            delayer.wait()
        for netns in [host.netns for host in self.hosts] + [self.switch]:
            _remove_namespace(netns)

    def namespaces(self) -> list[str]:
        """This Hosts' namespaces that exist now."""
        mine = self.netns("")
        return [
            line.split()[0]
            for line in _run("ip", "netns", "list").splitlines()
            if line.startswith(mine)
        ]


@contextmanager
def running_hosts() -> Iterator[Hosts]:
    """Test hosts on a bridge, all torn down on exit whatever happened; skips the test, saying
    why, where they cannot be made."""
    if missing := hosts_missing():
        pytest.skip(missing)
    sweep()
    hosts = Hosts()
    try:
        try:
            hosts.start()
        except RuntimeError as exc:
            pytest.skip(f"a network namespace cannot be made here: {exc}")
        yield hosts
    finally:
        hosts.close()


@dataclass
class HostMaster(Master):
    """A `mooncake_master` on a test host, every listener on its address. The test process
    cannot connect into the host's namespace: it reads the master's listening sockets (its
    /proc/PID/net is its namespace's) instead."""

    host: str = "127.0.0.1"

    def wait_listening(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        wanted = {self.rpc_port, self.http_port}
        while not wanted <= {listener.port for listener in listeners(self.proc.pid)}:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"not listening on {wanted}: {self.log_path.read_text()}")
            time.sleep(0.05)


@contextmanager
def master_on(host: Host, *args: str) -> Iterator[Master]:
    """A `mooncake_master` on `host` (more of its flags in `args`), killed on exit."""
    with started(HostMaster(args=args, launcher=host.launcher, host=host.address)) as master:
        yield master


@contextmanager
def node_on(host: Host, master: Master, *args: str) -> Iterator[Daemon]:
    """A daemon on `host` joined to `master`, telling the other nodes `host`'s address; it must
    exit 0 on SIGTERM at the end, as `store_daemon`'s."""
    with running_daemon(*master.flags(host.address), *args, launcher=host.launcher) as daemon:
        yield daemon
        assert daemon.stop() == 0, daemon.log()
