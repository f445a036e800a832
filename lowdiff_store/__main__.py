"""``python -m lowdiff_store`` runs the CLI."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI loads: no traceback
    sys.stderr.write("lowdiff-store: interrupted\n")
    sys.exit(130)

sys.exit(main())
