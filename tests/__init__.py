"""ds_lioncub's test suite (a package so that rank subprocesses can import tests.support and tests.workers)."""
