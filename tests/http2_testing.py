"""HTTP/2 by hand, for tests that must see or write the frames themselves: gRPC calls whose
frames are mangled (the fuzz suite), and the order of the frames a stopping daemon sends."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4


def frame(kind: int, flags: int, stream: int, payload: bytes, length: int | None = None) -> bytes:
    size = len(payload) if length is None else length
    header = (
        size.to_bytes(3, "big") + bytes([kind, flags]) + (stream & 0x7FFFFFFF).to_bytes(4, "big")
    )
    return header + payload


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def grpc_headers(path: bytes) -> bytes:
    return b"".join(
        literal(name, value)
        for name, value in (
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", path),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
        )
    )


def grpc_call(
    path: bytes, message: bytes, compressed: int = 0, declared: int | None = None
) -> bytes:
    """A whole gRPC call on stream 1: the connection preface, SETTINGS, HEADERS, one DATA."""
    prefix = bytes([compressed]) + (len(message) if declared is None else declared).to_bytes(
        4, "big"
    )
    return (
        PREFACE
        + frame(SETTINGS, 0, 0, b"")
        + frame(HEADERS, END_HEADERS, 1, grpc_headers(path))
        + frame(DATA, END_STREAM, 1, prefix + message)
    )


@dataclass(frozen=True)
class Frame:
    """One frame as read: its header's fields and its payload."""

    kind: int
    flags: int
    stream: int
    payload: bytes


def read_frames(sock: socket.socket) -> Iterator[Frame]:
    """The frames the peer sends, in order, until it closes the connection; its SETTINGS and
    PINGs are acknowledged as a client does (grpc sends no PING while one is unanswered)."""
    buffer = b""
    while True:
        while len(buffer) >= 9 and len(buffer) >= 9 + int.from_bytes(buffer[:3], "big"):
            size = int.from_bytes(buffer[:3], "big")
            stream = int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
            read = Frame(buffer[3], buffer[4], stream, buffer[9 : 9 + size])
            buffer = buffer[9 + size :]
            if read.kind in (SETTINGS, PING) and not read.flags & ACK:
                sock.sendall(
                    frame(read.kind, ACK, 0, b"" if read.kind == SETTINGS else read.payload)
                )
            yield read
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return
        if not chunk:
            return
        buffer += chunk
