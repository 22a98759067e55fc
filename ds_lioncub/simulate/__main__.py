"""``python -m ds_lioncub.simulate``: see :mod:`ds_lioncub.simulate.cli`."""

import sys

from ds_lioncub.simulate.cli import main

sys.exit(main())
