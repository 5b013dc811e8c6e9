"""``python -m qsync_lab`` runs the ``qsync-lab`` command line."""

import sys

from qsync_lab.cli import main

sys.exit(main())
