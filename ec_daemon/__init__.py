"""ecd: the encoder-cache daemon (pools, allocator, index, sessions, gRPC service, CLI)."""
