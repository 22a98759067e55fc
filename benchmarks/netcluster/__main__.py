import sys

from benchmarks.netcluster.cli import main

sys.exit(main())
