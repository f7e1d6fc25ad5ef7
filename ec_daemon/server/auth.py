"""Who may call what: bearer tokens and per-pool access lists.

- With a token file, every EncoderCache RPC must carry `authorization: Bearer <token>` naming a
  known token (UNAUTHENTICATED otherwise). The health service and reflection stay open, so
  probes and grpcurl need no secret; neither reveals cache contents.
- With an access list as well, each RPC needs a grant for its action on its pool
  (PERMISSION_DENIED otherwise): produce (Allocate, Commit, Abort), consume (Acquire, Lookup,
  ListEntries, Watch and Stats of one pool), admin (Evict, Delete, DropPool, and Stats or Watch of
  every pool at once). An OpenPool that creates the pool needs produce (a consumer that could
  create pools could fill the daemon's budget with pools it can neither fill nor drop); one that
  attaches needs produce or consume. Session RPCs (KeepAlive, CloseSession, Release) need no
  pool grant: a session answers only to the caller that opened it.
- A session is bound to its opener's `identity`: its token, and with mutual TLS its client
  certificate. Every call naming a session from another identity is answered as a call naming a
  session that does not exist (ec_daemon.core.sessions), so another token that learned a session ID
  can neither use the session nor tell that it exists. With neither tokens nor client
  certificates (the Unix socket alone) every caller is the same identity: whoever may connect
  may do anything, sessions included (docs/security.md).

Without an access list every token may do anything (evict, delete, drop every pool): the daemon
refuses a token file without one unless `--trust-all-tokens` says so, and warns when it does.
SIGHUP reads both files again (Guard.update): tokens removed are refused from their next call on.

Token file: one token per line, `NAME TOKEN` (or a bare `TOKEN`, named "default"); a word that
starts with `#` starts a comment, a `#` inside a token is part of it (ec_protocol.token_file, which
clients read too).
Access list (TOML):

    [[rule]]
    pools = ["qwen-vl-*"]          # shell-style patterns of engine_id
    produce = ["encoder"]          # names from the token file; "*" is every name
    consume = ["encoder", "decoder"]
    admin = ["ops"]                # admin implies produce and consume
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import hmac
import logging
import ssl
import stat
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ec_daemon.core.errors import Code, CoreError
from ec_protocol import token_file

log = logging.getLogger("ecd.auth")


class Action(enum.Enum):
    SESSION = "session"
    PRODUCE = "produce"
    CONSUME = "consume"
    ADMIN = "admin"


# The action each RPC performs. OpenPool is special-cased: produce to create, produce or consume
# to attach.
RPC_ACTIONS: dict[str, Action] = {
    "OpenSession": Action.SESSION,
    "KeepAlive": Action.SESSION,
    "CloseSession": Action.SESSION,
    "Release": Action.SESSION,
    "OpenPool": Action.SESSION,  # produce to create, produce or consume to attach: checked apart
    "Step": Action.SESSION,  # each part as its own RPC: the service names them
    "Allocate": Action.PRODUCE,
    "Commit": Action.PRODUCE,
    "Abort": Action.PRODUCE,
    "Acquire": Action.CONSUME,
    "Lookup": Action.CONSUME,
    "ListEntries": Action.CONSUME,
    "Watch": Action.CONSUME,
    "Stats": Action.CONSUME,
    "Evict": Action.ADMIN,
    "Delete": Action.ADMIN,
    "DropPool": Action.ADMIN,
}


@dataclass(frozen=True)
class Caller:
    """Who makes a call, as far as its token says: the name its grants are looked up by, and the
    token itself (part of its `identity`). Both empty when tokens are off."""

    name: str = ""
    token: str = ""


def identity(caller: Caller, auth_context: Mapping[str, Iterable[bytes]]) -> bytes:
    """What a session is bound to: the caller's token (when tokens are on) and its client
    certificate (with mutual TLS: grpc's `x509_pem_cert`), each as a SHA-256 digest so that the
    session table holds no secret. b"" with neither: every caller is then the same one.

    The token rather than its name: two lines of the token file may share a name, and a token
    revoked (removed from the file, then SIGHUP or a restart) should not leave its sessions to
    another."""
    parts = []
    if caller.token:
        parts.append(b"token:" + hashlib.sha256(caller.token.encode()).digest())
    for pem in auth_context.get("x509_pem_cert", ()):
        der = ssl.PEM_cert_to_DER_cert(pem.decode())
        parts.append(b"cert:" + hashlib.sha256(der).digest())
    return b"".join(parts)


class AuthConfigError(ValueError):
    """A token file or access list that cannot be used; the message names the file and line."""


def load_tokens(path: Path) -> dict[str, str]:
    """token -> name. Warns when others may read the file: the tokens are secrets."""
    try:
        others_read = path.stat().st_mode & stat.S_IROTH
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise AuthConfigError(f"cannot read token file {path}: {why}") from exc
    if others_read:
        log.warning(
            "token file is readable by every user of this machine: chmod o-r it",
            extra={"path": str(path)},
        )
    try:
        entries = token_file.parse(text, str(path))
    except ValueError as exc:
        raise AuthConfigError(str(exc)) from exc
    tokens: dict[str, str] = {}
    for name, token in entries:
        if len(token) < 16:
            raise AuthConfigError(f"{path}: token of {name!r} is shorter than 16 chars")
        tokens[token] = name
    if not tokens:
        raise AuthConfigError(f"{path}: no tokens")
    return tokens


@dataclass(frozen=True)
class Rule:
    pools: tuple[str, ...]
    grants: Mapping[Action, frozenset[str]]

    def allows(self, name: str, action: Action, engine_id: str) -> bool:
        if not any(fnmatch.fnmatchcase(engine_id, p) for p in self.pools):
            return False
        for granted in (action, Action.ADMIN):
            names = self.grants.get(granted, frozenset())
            if name in names or "*" in names:
                return True
        return False


def load_rules(path: Path) -> list[Rule]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AuthConfigError(f"cannot read access list {path}: {exc}") from exc
    rules = []
    for i, raw in enumerate(data.get("rule", [])):
        unknown = set(raw) - {"pools", "produce", "consume", "admin"}
        if unknown or not raw.get("pools"):
            raise AuthConfigError(
                f"{path}: rule {i + 1} needs `pools` and may have produce/consume/admin; "
                f"unknown keys: {sorted(unknown)}"
            )
        grants = {
            action: frozenset(raw.get(action.value, []))
            for action in (Action.PRODUCE, Action.CONSUME, Action.ADMIN)
        }
        rules.append(Rule(tuple(raw["pools"]), grants))
    return rules


def guard_from_files(
    token_file: Path | None, acl_file: Path | None, trust_all_tokens: bool = False
) -> Guard:
    """The guard of these files; AuthConfigError naming the file and what is wrong with it."""
    tokens = load_tokens(token_file) if token_file else None
    if tokens is not None and acl_file is None and not trust_all_tokens:
        raise AuthConfigError(
            f"token file {token_file} without an access list makes every token an admin (any "
            "token could evict, delete and drop every pool): add --acl-file with the grants of "
            "each token name (docs/security.md), or --trust-all-tokens if every token holder is "
            "trusted with everything"
        )
    if acl_file is not None and trust_all_tokens:
        raise AuthConfigError(
            "--trust-all-tokens lets every token do anything, --acl-file grants each its own: "
            "give one of them"
        )
    return Guard(tokens, load_rules(acl_file) if acl_file else None)


@dataclass(frozen=True)
class Changes:
    """What a reload changed, by token name (a log may show names, never tokens)."""

    added: tuple[str, ...]  # names that had no token before
    removed: tuple[str, ...]  # names that have no token now
    rotated: tuple[str, ...]  # names kept whose tokens changed
    rules: int | None  # rules of the access list now; None without one


def bearer(header: str) -> str:
    """The token of an `authorization: Bearer <token>` header; "" for any other header."""
    scheme, _, token = header.partition(" ")
    return token if scheme.lower() == "bearer" else ""


def match(known: Iterable[str], token: str) -> str | None:
    """The known token equal to `token`, compared in constant time; None if none is."""
    for candidate in known:
        if hmac.compare_digest(candidate.encode(), token.encode()):
            return candidate
    return None


class Guard:
    """Checks each call; with no token file it lets everything through."""

    def __init__(self, tokens: Mapping[str, str] | None, rules: Sequence[Rule] | None) -> None:
        if rules is not None and tokens is None:
            raise AuthConfigError("an access list needs a token file to name the callers")
        self._tokens = dict(tokens or {})
        self._rules = list(rules) if rules is not None else None

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    @property
    def rules(self) -> int | None:
        return len(self._rules) if self._rules is not None else None

    def update(self, new: Guard) -> Changes:
        """Take the tokens and rules of `new` (a reload). A token removed is unknown from its
        next call on; a session opened with it is bound to it (`identity`), so no other token
        takes it over: its calls are refused until its lease runs out."""
        before, after = _tokens_by_name(self._tokens), _tokens_by_name(new._tokens)
        self._tokens, self._rules = new._tokens, new._rules
        return Changes(
            added=tuple(sorted(after.keys() - before.keys())),
            removed=tuple(sorted(before.keys() - after.keys())),
            rotated=tuple(sorted(n for n in before.keys() & after.keys() if before[n] != after[n])),
            rules=self.rules,
        )

    def check(
        self,
        rpc: str,
        engine_id: str,
        metadata: Sequence[tuple[str, str | bytes]],
        actions: Sequence[Action] = (),
    ) -> Caller:
        """The caller; raises CoreError UNAUTHENTICATED or PERMISSION_DENIED.

        `actions`: what the call does when it is not one fixed action (a Step's parts, an OpenPool
        that creates: produce); each must be granted. Otherwise the RPC's own action (an
        OpenPool that attaches: produce or consume)."""
        if not self._tokens:
            return Caller()
        caller = self._identify(metadata)
        name = caller.name
        if self._rules is None:
            return caller
        if rpc == "OpenPool" and not actions:
            self._require(name, rpc, engine_id, (Action.PRODUCE, Action.CONSUME))
        for action in actions or (RPC_ACTIONS[rpc],):
            if action is not Action.SESSION:
                # Without a pool the call concerns every pool at once: an admin's business.
                self._require(name, rpc, engine_id, (action if engine_id else Action.ADMIN,))
        return caller

    def _require(self, name: str, rpc: str, engine_id: str, wanted: tuple[Action, ...]) -> None:
        if not any(r.allows(name, a, engine_id or "*") for r in self._rules or () for a in wanted):
            what = " or ".join(a.value for a in wanted)
            where = f"pool {engine_id!r}" if engine_id else "every pool"
            hint = (
                "; creating a pool needs produce, attaching to one produce or consume"
                if rpc == "OpenPool"
                else ""
            )
            raise CoreError(
                Code.PERMISSION_DENIED,
                f"{name!r} may not {what} in {where} ({rpc}): no rule grants it{hint}",
            )

    def _identify(self, metadata: Sequence[tuple[str, str | bytes]]) -> Caller:
        token = bearer(next((str(v) for k, v in metadata if k == "authorization"), ""))
        if not token:
            raise CoreError(
                Code.UNAUTHENTICATED,
                "missing bearer token: send `authorization: Bearer <token>` "
                "(ec_client: token= or ECD_TOKEN / ECD_TOKEN_FILE)",
            )
        known = match(self._tokens, token)
        if known is None:
            raise CoreError(Code.UNAUTHENTICATED, "unknown bearer token")
        return Caller(self._tokens[known], known)


def _tokens_by_name(tokens: Mapping[str, str]) -> dict[str, set[str]]:
    """name -> its tokens (several lines may share a name)."""
    names: dict[str, set[str]] = {}
    for token, name in tokens.items():
        names.setdefault(name, set()).add(token)
    return names
