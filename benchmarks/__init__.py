"""Benchmarks for ds_lioncub (run from the repository root, e.g. ``python -m benchmarks.netcluster``)."""
