"""``python -m lowdiff_store`` runs the CLI."""

import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI loads: no traceback
    sys.stderr.write("lowdiff-store: interrupted\n")
    sys.exit(130)

try:
    rc = main()
    sys.stdout.flush()
except KeyboardInterrupt:  # Ctrl-C after main returned (as the process ends): still 130
    sys.stderr.write("lowdiff-store: interrupted\n")
    rc = 130
sys.exit(rc)
