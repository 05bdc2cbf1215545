"""`python -m cortexc`: the command line (`cortexc.cli`)."""

import sys

from cortexc.cli import main

sys.exit(main())
