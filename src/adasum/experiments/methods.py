"""The training methods the experiments compare, by name.

Every method is a row of three answers (how to combine, what is combined, what happens after): which reducer
combines across workers, what is combined (gradients, or model deltas after `local_steps` local
steps), and which outer step follows (SlowMo's slow momentum, or DiLoCo's outer Nesterov SGD over the
pseudo-gradients, `adasum.diloco_outer`). Learning-rate scaling is part of the recipe.

AdaCons's learning rate: the library's AdaCons (``scale="mean_norm"``) is a weighted mean of the
workers' gradients whose weights sum to 1, rescaled to the mean's length: ``|m| sum_i c_i g_i/|g_i|``
(the paper's unit-length direction times ``|m|``). When the workers' gradients agree it *is* the
mean, so it gets the mean's recipe, Horovod's linear scaling (lr x P), and then takes the very step
of ``mean-scaled``; when their gradients are orthogonal (noise-dominated) its step is up to sqrt(P)
times shorter than the mean's (tests/test_adacons_lr.py shows both on toy gradients).

==================  ========  =========  ===========  ============  ===============================
name                reducer   combines   local steps  slow moment.  learning rate
==================  ========  =========  ===========  ============  ===============================
sequential          (none)    gradient   1            no            lr, one worker
mean-scaled         mean      gradient   1            no            lr x P (Horovod's recipe)
mean                mean      gradient   1            no            lr
sum                 sum       gradient   1            no            lr
adasum              adasum    gradient   1            no            lr
adasum-delta        adasum    delta      1            no            lr (optimizer deltas)
adacons             adacons   gradient   1            no            lr x P (a weighted mean)
localsgd            mean      delta      tau          no            lr
adasum-localsgd     adasum    delta      tau          no            lr
slowmo              mean      delta      tau          yes           lr
diloco              mean      delta      tau          Nesterov      lr (outer lr 0.7, momentum 0.9)
adasum-diloco       adasum    delta      tau          Nesterov      lr (outer lr 0.7, momentum 0.9)
adacons-diloco      adacons   delta      tau          Nesterov      lr (outer lr 0.7, momentum 0.9)
streaming-diloco    mean      delta      tau          Nesterov      lr (2 fragments, delay 1, mixing 0.5)
==================  ========  =========  ===========  ============  ===============================

The DiLoCo rows take ``--outer-lr``, ``--outer-momentum``, ``--communication-dtype`` (bf16, fp16, fp8) and
``--error-feedback``; ``streaming-diloco`` also ``--fragments``, ``--delay`` and ``--mixing``.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from adasum.options import Mode
from adasum.reducers import Reducer, get_reducer


@dataclass(frozen=True)
class Method:
    """How one method trains: reducer name, what is combined, local steps, slow momentum, LR recipe."""

    name: str
    reducer: str
    combine: Mode = "gradient"
    local: bool = False
    slow_momentum: bool = False
    outer: bool = False  # DiLoCo's outer optimizer over the pseudo-gradients
    streaming: bool = False  # Streaming DiLoCo's fragments
    linear_lr_scaling: bool = False
    single_worker: bool = False
    description: str = ""

    def workers(self, requested: int) -> int:
        """The worker count this method runs with when `requested` are asked for."""
        return 1 if self.single_worker else requested

    def learning_rate(self, lr: float, workers: int) -> float:
        """The learning rate the optimizer gets for base rate `lr` at `workers` workers."""
        return lr * workers if self.linear_lr_scaling else lr


METHODS: Mapping[str, Method] = MappingProxyType({
    m.name: m
    for m in [
        Method("sequential", "mean", single_worker=True, description="one worker, per-worker batch"),
        Method("mean-scaled", "mean", linear_lr_scaling=True, description="gradient mean, lr x P"),
        Method("mean", "mean", description="gradient mean, lr unscaled"),
        Method("sum", "sum", description="gradient sum"),
        Method("adasum", "adasum", description="Adasum of gradients"),
        Method("adasum-delta", "adasum", combine="delta", description="Adasum of optimizer deltas"),
        Method("adacons", "adacons", linear_lr_scaling=True, description="AdaCons of gradients, lr x P"),
        Method("localsgd", "mean", combine="delta", local=True, description="local SGD, model average"),
        Method(
            "adasum-localsgd", "adasum", combine="delta", local=True, description="local SGD, Adasum of model deltas"
        ),
        Method("slowmo", "mean", combine="delta", local=True, slow_momentum=True, description="SlowMo over local SGD"),
        Method("diloco", "mean", combine="delta", local=True, outer=True, description="DiLoCo, mean pseudo-gradient"),
        Method("adasum-diloco", "adasum", combine="delta", local=True, outer=True, description="DiLoCo, Adasum"),
        Method("adacons-diloco", "adacons", combine="delta", local=True, outer=True, description="DiLoCo, AdaCons"),
        Method(
            "streaming-diloco", "mean", combine="delta", local=True, outer=True, streaming=True,
            description="Streaming DiLoCo, mean",
        ),
    ]
})


def get_method(name: str) -> Method:
    """A method by name (see the module table).

    >>> get_method("mean-scaled").learning_rate(0.01, 16)
    0.16
    """
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}{did_you_mean(name, METHODS)}; choose from {', '.join(METHODS)}")
    return METHODS[name]


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of `choices` to a mistyped `word`, or ``""``.

    >>> did_you_mean("adsum", ["adasum", "mean"])
    " (did you mean 'adasum'?)"
    """
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_methods(text: str) -> list[Method]:
    """Methods from a comma-separated list of names, in order, without repeats."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no method given; pass one or more method names separated by commas (e.g. adasum,mean)")
    return [get_method(n) for n in dict.fromkeys(names)]


def method_reducer(method: Method) -> Reducer:
    """The reducer object of `method`; a clear error where that reducer is not available."""
    if method.reducer == "adacons":
        try:  # registers "adacons" when the module exists
            importlib.import_module("adasum.adacons")
        except ModuleNotFoundError as error:
            if error.name != "adasum.adacons":
                raise
    try:
        return get_reducer(method.reducer)
    except ValueError:
        raise ValueError(
            f"method {method.name!r} needs the {method.reducer!r} reducer, which this installation "
            "of adasum does not provide yet; choose another method"
        ) from None
