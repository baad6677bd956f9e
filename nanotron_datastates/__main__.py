"""`python -m nanotron_datastates ...`: the `nanotron-datastates` command."""

import sys

from .cli import main

sys.exit(main())
