"""``python -m shoal``: the ``shoal`` command."""

import sys

from .cli import main

sys.exit(main())
