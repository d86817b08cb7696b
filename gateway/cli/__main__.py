"""`python -m gateway.cli` runs the `platform` command."""

import sys

from gateway.cli import main

sys.exit(main())
