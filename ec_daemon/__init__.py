"""ecd: the encoder-cache daemon. Its layers import one way only, each the ones below it
(tests/unit/test_layering.py): `cli` (the `ecd` command) -> `tools` (the operator tools) ->
`server` (gRPC and the operations side) -> `cluster` (the cluster tier) -> `core` (the cache
itself: synchronous pure Python, no gRPC, no asyncio)."""
