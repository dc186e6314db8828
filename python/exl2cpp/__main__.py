"""`python -m exl2cpp`: the same command line as the `exl2cpp` script."""

import sys

from .cli import main

sys.exit(main())
