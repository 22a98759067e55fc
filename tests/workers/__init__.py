"""One rank of each multi-process job the tests start (run by path, with PYTHONPATH from tests.support.launch)."""
