"""``python -m adasum``: the experiment command line (see ``adasum --help``)."""

import sys

from adasum.experiments.cli import main

if __name__ == "__main__":
    sys.exit(main())
