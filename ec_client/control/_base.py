"""What Client and AsyncClient share (tests/unit/test_client_twins.py): the constructor and its
settings, the session's state, what is owed and the views of pools, and the answers that never
wait on the daemon. Each twin performs the I/O of the session's plans its own way: Client with
blocking calls and threads, AsyncClient with grpc.aio on its event loop.
"""

from __future__ import annotations

from collections.abc import Callable

from ec_client.control import _wire
from ec_client.control._connection import Options
from ec_client.control._session import SessionState
from ec_client.control.outbox import Outbox, OutboxBatch, batch_sender
from ec_client.control.ready_view import ReadyView, Views
from ec_client.control.tls import TLSFiles
from ec_protocol.types import PoolInfo, Role, StepResult


class BaseClient:
    def __init__(
        self,
        target: str | None = None,
        *,
        name: str | None = None,
        role: Role | str = Role.BOTH,
        connect_timeout_s: float = 5.0,
        call_timeout_s: float = 30.0,
        token: str | None = None,
        tls: TLSFiles | None = None,
        keepalive: bool = True,
        linger_s: float = 0.001,
        from_env: bool = True,
        wait_for_daemon_s: float = 0.0,
    ) -> None:
        """Connect within connect_timeout_s and open a session (AsyncClient: at `start()`,
        sending nothing before); where no daemon is (no socket, nothing listening, TLS refused),
        UNAVAILABLE at once, or after waiting up to wait_for_daemon_s for one to start.
        wait_for_daemon_s is the client's patience for every call too: one that finds no daemon
        (a restart) waits that long for it to come back, then carries on (0: fails at once;
        a get's wait_ms ending first answers None). `role`
        limits what the session may do (see Role); `token` defaults to ECD_TOKEN or
        ECD_TOKEN_FILE, `tls` to ECD_TLS_CA / ECD_TLS_CERT / ECD_TLS_KEY (unless from_env is
        False). `linger_s`: how long what is owed (commits of
        puts, releases of gets) waits for a call to ride on before it goes alone (see `outbox`)."""
        self.options = Options.make(
            target,
            name,
            role,
            connect_timeout_s,
            call_timeout_s,
            token,
            tls,
            from_env,
            wait_for_daemon_s,
        )
        self._state = SessionState(self.options)
        self._views = Views(self._follow)
        self.outbox = Outbox(batch_sender(self._send_batch_from_thread), linger_s)
        self._begin(keepalive)

    # ---- what each twin does its own way -------------------------------------------------------

    def _begin(self, keepalive: bool) -> None:
        """The rest of the constructor: Client connects and opens the session, AsyncClient
        keeps what `start()` does that with."""
        raise NotImplementedError

    def _follow(self, engine_id: str) -> ReadyView:
        """A new ReadyView of a pool (the views make one per pool, on first ask)."""
        raise NotImplementedError

    def _send_batch_from_thread(
        self, batch: OutboxBatch, call: _wire.Call[StepResult]
    ) -> StepResult:
        """A Step of what is owed, from owed's thread: answered when it returns."""
        raise NotImplementedError

    # ---- session -------------------------------------------------------------------------------

    @property
    def session_id(self) -> str:
        return self._state.session_id

    @property
    def boot_epoch(self) -> str:
        return self._state.boot_epoch

    @property
    def lease_ttl_s(self) -> float:
        return self._state.lease_ttl_s

    @property
    def max_batch(self) -> int:
        """The most items the daemon takes in one request (told when the session opened; 0 if
        it did not say): a larger batch goes as several, one round trip each."""
        return self._state.max_batch

    @property
    def target(self) -> str:
        return self.options.target

    def on_restart(self, callback: Callable[[str], None]) -> None:
        """Call `callback(new_boot_epoch)` after the client re-established itself on a restarted
        daemon (new session, pools reopened)."""
        self._state.on_restart.append(callback)

    # ---- pools ---------------------------------------------------------------------------------

    def pool_info(self, engine_id: str) -> PoolInfo:
        """What the daemon said about a pool this client opened (refreshed after a restart)."""
        return self._state.pool_info(engine_id)
