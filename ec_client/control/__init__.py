"""The clients that talk to the daemon: `Client` (blocking, `client`) and `AsyncClient` (`aio`)
over the same plans (`_session`), request building and reply parsing (`_wire`), channels and
options (`_connection`, `tls`), what is owed with nobody waiting (`outbox`) and a pool's READY
keys followed through Watch (`ready_view`). No torch."""
