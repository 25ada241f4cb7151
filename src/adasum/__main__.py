"""``python -m adasum``: the experiment command line (see ``adasum --help``)."""

import sys

from adasum.experiments.cli import main

sys.exit(main())
