"""The gRPC server over the core and its operations side: `service` (the handlers: check the
caller, validate, call the store, answer), `wire` and `validate` (messages in and out), `auth`,
`events` (the asyncio waits and Watch streams), `server` (startup, listeners, shutdown),
`config`, `checks`, `metrics`, `logs`, `systemd` and `reflection`."""
