"""``python tests/kill_at.py RANK STEP MARKER ARGS...``: ``adasum ARGS`` whose rank RANK SIGKILLs itself after
global step STEP unless MARKER exists (`adasum.experiments.checkpoint.kill_at`, passed as ``on_step``)."""

import sys

from adasum.experiments.checkpoint import kill_at
from adasum.experiments.cli import run

if __name__ == "__main__":
    rank, step, marker, *args = sys.argv[1:]
    run(args, on_step=kill_at(int(rank), int(step), marker))
