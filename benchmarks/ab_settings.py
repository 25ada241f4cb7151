"""Settings of `adasum.all_reduce` against each other and NCCL, alternated in one run (`ab.alternate`), on GPUs.

Each variant is ``label:field=value,...`` over `adasum.settings.Settings` fields (``label`` alone: the defaults),
applied with `adasum.settings.override` around the variant's calls on its own tensors (a schedule-shaping field
makes a plan and a graph of its own); ``transport=NAME`` is passed to `adasum.all_reduce` instead. Variants that
change the schedule need not give the same bits; each must give ranks bitwise equal.

    torchrun --standalone --nproc-per-node 2 benchmarks/ab_settings.py \\
        --variants d two:one_shot_bytes=0 one:transport=one-shot --cases flat-20:fp32,resnet50:bf16
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

import torch

import adasum
from adasum.settings import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab import alternate, finish, start  # noqa: E402


def parse(variant: str) -> tuple[str, dict[str, object]]:
    """(label, the settings it changes) of ``label:field=value,...``."""
    label, _, rest = variant.partition(":")
    changes: dict[str, object] = {}
    for item in filter(None, rest.split(",")):
        field, value = item.split("=", 1)
        try:
            changes[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            changes[field] = value
    return label, changes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", nargs="+", default=["d"])
    p.add_argument("--cases", default="flat-20:fp32,flat-24:fp32,resnet50:bf16",
                   help="layout:dtype, layout one of resnet50, bert-large, flat-<log2 elements>")
    args = p.parse_args()
    rank, world, dev, log = start()

    def with_settings(changes: dict[str, object]):
        settings = {k: v for k, v in changes.items() if k != "transport"}
        transport = changes.get("transport")

        def run(tensors) -> None:
            with override(**settings):
                adasum.all_reduce(tensors, transport=transport)
        return run

    variants = dict(parse(v) for v in args.variants)
    log("variants: " + "; ".join(f"{k} {v or 'defaults'}" for k, v in variants.items()))
    for case in args.cases.split(","):
        alternate({k: with_settings(v) for k, v in variants.items()}, case, rank, world, dev, log, same_bits=False)
        adasum.release()
        torch.cuda.empty_cache()
    finish()


if __name__ == "__main__":
    main()
