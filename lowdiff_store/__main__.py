"""``python -m lowdiff_store`` runs the CLI."""

import sys

from .cli import main

sys.exit(main())
