"""The cache itself: pool files, the allocator, eviction, each pool's index, sessions, the pools
a daemon serves and `store`, the synchronous API with one method per RPC. Pure Python with an
injectable clock, no gRPC and no asyncio, so it is unit-tested alone; it imports nothing else of
the daemon."""
