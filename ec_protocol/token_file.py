"""The token file format, read by the daemon (--token-file: every token it accepts) and by
clients (ECD_TOKEN_FILE: the token to send), so that a client can be pointed at the file the
daemon reads.

One token per line, `NAME TOKEN`, or a bare `TOKEN` (named "default"); a word that starts with
`#` starts a comment, to the end of the line. A `#` inside a word is part of it: a token is read
whole, never cut at a `#`.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_NAME = "default"


def check_token(token: str, what: str) -> None:
    """ValueError unless the token can travel in an `authorization: Bearer` header."""
    if not token or not token.isprintable() or any(c.isspace() for c in token):
        raise ValueError(f"{what} is empty or holds spaces or control characters")


def parse(text: str, source: str) -> list[tuple[str, str]]:
    """(name, token) of each line; ValueError naming the source and line of a malformed one."""
    entries = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split()
        comment = next((i for i, w in enumerate(words) if w.startswith("#")), len(words))
        fields = words[:comment]
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(
                f"{source}:{number}: expected `NAME TOKEN` or `TOKEN`, found {len(fields)} words "
                "(a comment starts with a word that starts with `#`)"
            )
        name, token = fields if len(fields) == 2 else (DEFAULT_NAME, fields[0])
        entries.append((name, token))
    return entries


def client_token(path: Path, name: str | None) -> str:
    """The token a client sends: the file's only token, or the one called `name`."""
    entries = parse(path.read_text(), str(path))
    names = ", ".join(n for n, _ in entries)
    if name is not None:
        chosen = [token for n, token in entries if n == name]
        if not chosen:
            raise ValueError(f"{path} has no token named {name!r} (it has: {names or 'none'})")
        return chosen[0]
    if len(entries) != 1:
        raise ValueError(
            f"{path} holds {len(entries)} tokens ({names or 'none'}): set ECD_TOKEN_NAME to the "
            "one this client uses, or point ECD_TOKEN_FILE at a file holding only its token"
        )
    return entries[0][1]
