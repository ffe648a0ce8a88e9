"""``python -m longattn``: the ``longattn`` command line."""

import sys

from .cli import main

sys.exit(main())
