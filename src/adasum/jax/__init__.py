"""Adasum and AdaCons for JAX: a collective over one named mesh axis and optax transformations.

Needs the jax extra (``pip install 'adasum[jax]'``, from a checkout ``pip install '.[jax]'``: jax and
optax); without them ``import adasum.jax`` raises ImportError saying so. ``import adasum`` alone never
imports JAX.

>>> import adasum.jax, optax
>>> opt = optax.chain(adasum.jax.adasum("data"), optax.sgd(0.1))   # update inside jax.shard_map
>>> grads = adasum.jax.all_reduce(grads, "data")                   # the bare collective  # doctest: +SKIP
"""

from adasum.extras import require

require("jax", "optax", extra="jax", user="adasum.jax")

import warnings  # noqa: E402
from typing import Any  # noqa: E402

from adasum.jax.collective import all_reduce, vary  # noqa: E402
from adasum.jax.transforms import AdaConsState, AdasumOptaxState, adacons, adacons_weights, adasum  # noqa: E402

__all__ = ["AdaConsState", "AdasumOptaxState", "adacons", "adacons_weights", "adasum", "all_reduce", "vary"]


def __getattr__(name: str) -> Any:
    if name == "AdasumState":  # the former name, which `adasum.ddp.AdasumState` (the DDP hook's state) also has
        warnings.warn(
            "adasum.jax.AdasumState is renamed adasum.jax.AdasumOptaxState (adasum.ddp.AdasumState is the DDP "
            "hook's state); the old name will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        return AdasumOptaxState
    raise AttributeError(f"module 'adasum.jax' has no attribute {name!r}")
