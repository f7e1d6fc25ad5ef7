"""The operator tools behind `ecd bench`: private daemons (`spawn`) and a Mooncake master with
daemons in its store (`spawn_store`) as child processes, and the daemon's own time per item
(`costs`)."""
