"""`ecd bench`: its suites (`bench`) and the cluster suite (`bench_cluster`)."""
