r"""SlowMo: slow momentum over periodically combined models (Wang et al., ICLR 2020).

Every worker takes tau steps of a base optimizer (learning rate gamma_t) from the anchor
x_{t,0}; then, per parameter::

    x_bar     = combine of the workers' x_{t,tau}       (exact average, or a reducer of the deltas)
    u_{t+1}   = beta u_t + (x_{t,0} - x_bar) / gamma_t   (slow momentum buffer)
    x_{t+1,0} = x_{t,0} - alpha gamma_t u_{t+1}          (every worker restarts here)

alpha = 1, beta = 0 is local SGD (periodic averaging).
"""

from __future__ import annotations

import torch


def slow_momentum_update(
    anchor: torch.Tensor,
    combined: torch.Tensor,
    momentum: torch.Tensor,
    lr: float,
    slow_lr: float,
    slow_momentum: float,
) -> None:
    """The outer step for one parameter, in place on `anchor` (x_{t,0} -> x_{t+1,0}) and `momentum`.

    `combined` is x_bar. With ``lr == 0`` (warm-up from zero) there is no division: the momentum
    only decays (u = beta u) and the anchor moves to x_bar, so nothing becomes NaN.

    >>> slow_momentum_update(anchor, averaged, buffer, lr=0.1, slow_lr=1.0, slow_momentum=0.5)
    """
    if lr == 0:
        momentum.mul_(slow_momentum)
        anchor.copy_(combined)
        return
    momentum.mul_(slow_momentum).add_(anchor - combined, alpha=1.0 / lr)
    anchor.add_(momentum, alpha=-slow_lr * lr)
