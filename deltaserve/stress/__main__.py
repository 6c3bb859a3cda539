"""`python -m deltaserve.stress`: the same as `deltaserve stress`."""

import sys

from deltaserve.stress.cli import main

sys.exit(main())
