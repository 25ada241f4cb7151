"""Adasum and AdaCons for JAX: a collective over one named mesh axis and optax transformations.

Needs ``pip install 'adasum[jax]'`` (jax and optax); ``import adasum`` alone never imports JAX.

>>> import adasum.jax, optax
>>> opt = optax.chain(adasum.jax.adasum("data"), optax.sgd(0.1))   # update inside jax.shard_map
>>> grads = adasum.jax.all_reduce(grads, "data")                   # the bare collective  # doctest: +SKIP
"""

from adasum.jax.collective import all_reduce, vary
from adasum.jax.transforms import AdaConsState, AdasumState, adacons, adacons_weights, adasum

__all__ = ["AdaConsState", "AdasumState", "adacons", "adacons_weights", "adasum", "all_reduce", "vary"]
