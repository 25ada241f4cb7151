"""``python -m adasum``: the experiment command line (see ``adasum --help``)."""

from adasum.experiments.cli import run

if __name__ == "__main__":
    run()
