"""Tests of the benchmark harness: netcluster, bench_comm's and bench_train's bookkeeping, short real runs."""
