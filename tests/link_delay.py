"""A link's latency for the test hosts (tests/hosts_testing.py), where the kernel has no netem
(this machine's has no sch_netem, nor modules to load): run inside a host's network namespace,
it takes the packets an iptables rule queues (`-j NFQUEUE --queue-num N`) and lets each go
`--delay-ms` after it was queued, in order, over nfnetlink_queue (netlink, no library). The
queue keeps GSO packets whole (a TCP send of 64 KiB is one packet, not 45), and fails open: a
packet that finds the queue full goes at once rather than being dropped.

    python tests/link_delay.py --queue 0 --delay-ms 0.5   # prints "ready" once bound
"""

from __future__ import annotations

import argparse
import collections
import select
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT_BATCH, NFQNL_MSG_CONFIG = 0, 3, 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND, NFQNL_COPY_META = 1, 1
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NF_ACCEPT = 1
QUEUE_MAXLEN = 65536
RECEIVE_BUFFER = 16 << 20
SO_RCVBUFFORCE = 33  # Linux; the socket module does not name it


def _attribute(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attributes: list[bytes], flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + b"".join(attributes)  # nfgenmsg
    header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0)
    return header + body


def _configure(sock: socket.socket, queue: int, *attributes: bytes) -> None:
    """One config request; raises OSError if the kernel refuses it."""
    sock.send(_message(NFQNL_MSG_CONFIG, queue, list(attributes), NLM_F_REQUEST | NLM_F_ACK))
    reply = sock.recv(65536)
    _, kind = struct.unpack_from("=IH", reply)
    if kind == NLMSG_ERROR:
        [error] = struct.unpack_from("=i", reply, 16)
        if error:
            raise OSError(-error, f"nfnetlink_queue refused a config of queue {queue}")


def bind(queue: int) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
    sock.bind((0, 0))
    _configure(sock, queue, _attribute(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
    _configure(sock, queue, _attribute(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)))
    _configure(sock, queue, _attribute(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)))
    flags = struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO)
    _configure(sock, queue, _attribute(NFQA_CFG_MASK, flags), _attribute(NFQA_CFG_FLAGS, flags))
    return sock


def packet_ids(data: bytes) -> list[int]:
    """The ids of the queued packets a read of the socket holds."""
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at = offset + 20  # past nlmsghdr and nfgenmsg
            while at + 4 <= offset + length:
                size, attribute = struct.unpack_from("=HH", data, at)
                if attribute & 0x3FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, at + 4)[0])
                at += max(4, (size + 3) & ~3)
        offset += max(16, (length + 3) & ~3)
    return ids


def delay(sock: socket.socket, queue: int, delay_s: float) -> None:
    """Forever: each packet queued goes `delay_s` after it came. Packet ids rise in queue order,
    so the packets due are a prefix of those held, and one batch verdict (every id up to the
    last due) lets them go."""
    held: collections.deque[tuple[float, int]] = collections.deque()
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select([sock], [], [], timeout)
        if readable:
            came = time.monotonic()
            for packet in packet_ids(sock.recv(RECEIVE_BUFFER)):
                held.append((came + delay_s, packet))
        now = time.monotonic()
        last = None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            verdict = _attribute(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue, [verdict]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args()
    sock = bind(args.queue)
    print("ready", flush=True)
    delay(sock, args.queue, args.delay_ms / 1e3)


if __name__ == "__main__":
    sys.exit(main())
