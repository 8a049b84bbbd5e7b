"""``python -m mooncake_keys``: the command line (see :mod:`mooncake_keys.cli`)."""

import sys

from .cli import main

sys.exit(main())
