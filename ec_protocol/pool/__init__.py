"""The pool file, which the daemon writes and clients map: its format (`layout`), the lock pins
on its slots that make a local hit cost no round trip (`slot_locks`), and a session's life mark,
a lock that ends with its process (`life_marks`). Shared with the daemon, so free of torch and
gRPC."""
