"""Public path of the Accelerate integration (optional extra: ``pip install 'adasum[accelerate]'``):
``adasum.accelerate.enable(model)`` on the prepared model (implemented in
`adasum.integrations.accelerate`)."""

from adasum.integrations.accelerate import enable

__all__ = ["enable"]
