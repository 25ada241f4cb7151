r"""Adasum and AdaCons as optax gradient transformations over a named mesh axis.

Both combine whatever reaches them across the devices of `axis_name`, so where they sit in an
``optax.chain`` decides *what* is combined:

* ``optax.chain(adasum.jax.adasum("data"), optax.sgd(lr))`` combines the gradients, then every device
  takes the same SGD step (the paper's usage).
* ``optax.chain(optax.adam(lr), adasum.jax.adasum("data"))`` combines the optimizer's updates (weight
  deltas), each device keeping its own Adam moments: Horovod's ``DistributedOptimizer(op=Adasum)``.

Call ``update`` inside ``jax.shard_map`` (or ``jax.pmap``) over `axis_name`, with each device's own
updates: in ``shard_map`` take gradients with respect to ``adasum.jax.vary(params, axis_name)``
(``jax.grad`` with respect to replicated parameters returns their sum over the axis).

AdaCons (Choukroun, Azoulay, Kisilev, arXiv 2411.03742), with the rules of the PyTorch
`adasum.reducers.adacons` (``m`` the mean, ``N`` devices)::

    a_i = <g_i, m> / |g_i|                      (0 for |g_i|^2 below sqrt(tiny))
    s_t = beta s_{t-1} + (1 - beta) sort(a)     (s_1 = sort(a)); worker at sorted position k gets s_t[k]
    c_i = max(a_i, 0) / sum_j max(a_j, 0)       (1/N each if that sum is not positive)
    d   = |m| sum_i c_i g_i / |g_i|             (scale="mean_norm"; scale="unit" drops |m|)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from adasum.jax.collective import accumulation_dtype, all_reduce, axis_size, check_leaves, check_per_device, zero_norm
from adasum.options import Scale, check_count, check_option


class AdasumOptaxState(NamedTuple):
    """The state of `adasum` (empty: Adasum keeps no state). Named apart from `adasum.ddp.AdasumState`, the DDP
    hook's state; ``adasum.jax.AdasumState``, its former name, is a deprecated alias."""


def adasum(axis_name: Any, *, per_leaf: bool = True, accumulate: Any = None) -> optax.GradientTransformation:
    """Combine the updates across `axis_name` with Adasum (`adasum.jax.all_reduce`).

    Args:
      axis_name: the mesh axis to combine over.
      per_leaf: one pair of coefficients per leaf (default) or one for the whole tree.
      accumulate: dtype of the dot products (None: float64 with x64 enabled, else float32).

    Returns:
      An ``optax.GradientTransformation`` with an empty `AdasumOptaxState`.

    >>> import adasum.jax, optax
    >>> opt = optax.chain(adasum.jax.adasum("data"), optax.sgd(0.1))
    >>> updates, state = opt.update(grads, state)          # inside jax.shard_map over "data"  # doctest: +SKIP
    """

    def init(params: Any) -> AdasumOptaxState:
        del params
        return AdasumOptaxState()

    def update(updates: Any, state: AdasumOptaxState, params: Any = None) -> tuple[Any, AdasumOptaxState]:
        del params
        return all_reduce(updates, axis_name, per_leaf=per_leaf, accumulate=accumulate), state

    return optax.GradientTransformation(init, update)


class AdaConsState(NamedTuple):
    """AdaCons' sorted-coefficient momentum ``[segments, devices]`` and how many updates ran."""

    sorted_momentum: jax.Array
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


def adacons_weights(
    dots: jax.Array, sq_norms: jax.Array, mean_sq: jax.Array, state: AdaConsState, beta: float, scale: Scale
) -> tuple[jax.Array, AdaConsState]:
    """The factor each device's update is multiplied by before the sum, and the new state.

    Args:
      dots: ``<g_i, m>`` per segment and device, ``[S, N]``.
      sq_norms: ``|g_i|^2``, ``[S, N]``.
      mean_sq: ``|m|^2`` per segment, ``[S]``.
      state: the momentum state (``count == 0``: the first call, no smoothing).
      beta: the momentum.
      scale: "mean_norm" or "unit" (anything else: ValueError).

    Returns:
      ``(weights [S, N], new state)``; the aggregate is ``sum_i weights_i g_i``.
    """
    check_option("scale", scale, Scale)
    tiny = zero_norm(dots.dtype)
    nonzero = sq_norms >= tiny
    norms = jnp.sqrt(jnp.where(nonzero, sq_norms, 1.0))
    a = jnp.where(nonzero, dots / norms, 0.0)
    idx = jnp.argsort(a, axis=-1, stable=True)  # idx[k]: the device at sorted position k
    ordered = jnp.take_along_axis(a, idx, axis=-1)
    smoothed_sorted = jnp.where(state.count == 0, ordered, beta * state.sorted_momentum + (1 - beta) * ordered)
    smoothed = jnp.take_along_axis(smoothed_sorted, jnp.argsort(idx, axis=-1), axis=-1)  # the inverse permutation
    clipped = jnp.maximum(smoothed, 0.0)
    total = clipped.sum(-1, keepdims=True)
    positive = total > 0
    c = jnp.where(positive, clipped / jnp.where(positive, total, 1.0), 1.0 / a.shape[-1])
    weights = jnp.where(nonzero, c / norms, 0.0)
    if scale == "mean_norm":
        weights = weights * jnp.sqrt(mean_sq)[:, None]
    new_state = AdaConsState(smoothed_sorted.astype(state.sorted_momentum.dtype), state.count + 1)
    return weights, new_state


def adacons(
    axis_name: Any,
    momentum: float = 0.0,
    *,
    per_leaf: bool = False,
    scale: Scale = "mean_norm",
    accumulate: Any = None,
    devices: int | None = None,
) -> optax.GradientTransformation:
    """Combine the updates across `axis_name` with AdaCons (module docstring for the math).

    Communication per update: two all-reduces of the tree (``psum``, one collective each) and the
    gather of ``2 x S`` scalars per device (S = 1, or the number of leaves with `per_leaf`), done as a
    psum of an ``[N, 2, S]`` array in which each device fills its own row.

    Args:
      axis_name: the mesh axis to combine over.
      momentum: the subspace momentum beta in [0, 1) (the paper's demo uses 0.99).
      per_leaf: coefficients per leaf instead of one set for the whole tree.
      scale: "mean_norm" (identical updates combine to themselves; for SGD) or "unit" (the paper's
        ``|d| <= 1``, for scale-invariant optimizers).
      accumulate: dtype of the dot products and coefficients (None: float64 with x64, else float32).
      devices: the size of `axis_name` (an int >= 1), needed only when ``init`` runs outside the mapped
        function; where given, ``init`` uses it also inside.

    Returns:
      An ``optax.GradientTransformation`` whose state is an `AdaConsState`.

    >>> import adasum.jax, optax
    >>> opt = optax.chain(adasum.jax.adacons("data", momentum=0.99), optax.sgd(0.1))
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}; pass momentum= a number in [0, 1), e.g. 0.9")
    check_option("scale", scale, Scale)
    if devices is not None:
        check_count("adasum.jax.adacons", "devices", devices)

    def init(params: Any) -> AdaConsState:
        leaves = jax.tree.leaves(params)
        check_leaves(leaves, "adasum.jax.adacons")
        if devices is not None:
            n = devices
        else:
            try:
                n = axis_size(axis_name, "adasum.jax.adacons init")
            except ValueError as e:
                raise ValueError(f"{e}; or pass adacons(..., devices=N) to init outside it") from None
        segments = len(leaves) if per_leaf else 1
        acc = accumulation_dtype(accumulate)
        return AdaConsState(jnp.zeros((segments, n), acc), jnp.zeros((), jnp.int32))

    def update(updates: Any, state: AdaConsState, params: Any = None) -> tuple[Any, AdaConsState]:
        del params
        leaves, treedef = jax.tree.flatten(updates)
        check_leaves(leaves, "adasum.jax.adacons")
        n = axis_size(axis_name, "adasum.jax.adacons")
        if state.sorted_momentum.shape[-1] != n:
            raise ValueError(f"AdaCons state is for {state.sorted_momentum.shape[-1]} devices, axis "
                             f"{axis_name!r} has {n}; call init again inside the mapped function, or build "
                             f"adacons(..., devices={n}) and call its init")
        segments = len(leaves) if per_leaf else 1
        if state.sorted_momentum.shape[0] != segments:
            raise ValueError(
                f"adasum.jax.adacons: the state has momentum for {state.sorted_momentum.shape[0]} segments, "
                f"these updates need {segments} ({'one per leaf' if per_leaf else 'one for the whole tree'}); "
                f"call init for the state with the same per_leaf and a tree of the same leaves"
            )
        if not leaves:
            return updates, state
        check_per_device(leaves, axis_name, "adasum.jax.adacons")
        acc = accumulation_dtype(accumulate)
        mean = [m / n for m in jax.lax.psum(leaves, axis_name)]
        partials = jnp.stack([
            jnp.stack([jnp.vdot(g.astype(acc), m.astype(acc)) for g, m in zip(leaves, mean)]),
            jnp.stack([jnp.vdot(g.astype(acc), g.astype(acc)) for g in leaves]),
            jnp.stack([jnp.vdot(m.astype(acc), m.astype(acc)) for m in mean]),
        ])  # [3, leaves]
        if not per_leaf:
            partials = partials.sum(1, keepdims=True)
        # gather every device's (<g_i, m>, |g_i|^2) as rows of a psum: unlike all_gather, JAX knows
        # its result is the same on every device, so the new state can leave shard_map replicated
        me = jax.lax.axis_index(axis_name)
        rows = jax.lax.dynamic_update_index_in_dim(jnp.zeros((n, 2, partials.shape[1]), acc), partials[:2], me, 0)
        gathered = jax.lax.psum(rows, axis_name)  # [N, 2, S]
        weights, state = adacons_weights(gathered[:, 0].T, gathered[:, 1].T, partials[2], state, momentum, scale)
        mine = weights[:, me]  # [S]
        scaled = []
        for i, g in enumerate(leaves):
            compute = jnp.promote_types(g.dtype, jnp.float32)
            w = mine[i if per_leaf else 0].astype(compute)
            scaled.append((g.astype(compute) * w).astype(g.dtype))
        return jax.tree.unflatten(treedef, jax.lax.psum(scaled, axis_name)), state

    return optax.GradientTransformation(init, update)
