"""Public path of the Lightning integration (optional extra: ``pip install 'adasum[lightning]'``):
``adasum.lightning.AdasumCallback`` and the strategies ``"ddp_adasum"`` and ``"ddp_adasum_delta"``,
registered with Lightning when this module is imported (implemented in
`adasum.integrations.lightning`)."""

from adasum.integrations.lightning import AdasumCallback, AdasumDDPStrategy, AdasumDeltaStrategy

__all__ = ["AdasumCallback", "AdasumDDPStrategy", "AdasumDeltaStrategy"]
