"""``python -m ds_lioncub.planner``: see :mod:`ds_lioncub.planner.cli`."""

import sys

from ds_lioncub.planner.cli import main

sys.exit(main())
