"""``python tests/stop_at.py STEP ARGS...``: ``adasum ARGS`` whose every rank exits (status 3) right after global
step STEP, as a job stopped there (a preemption): the last checkpoint is the one written before."""

import os
import sys

from adasum.experiments.cli import run

if __name__ == "__main__":
    step, *args = sys.argv[1:]

    def stop(rank: int, global_step: int) -> None:
        if global_step == int(step):
            sys.stderr.flush()
            os._exit(3)

    run(args, on_step=stop)
