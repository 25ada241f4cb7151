"""Public path of the Lightning integration (optional extra: ``pip install 'adasum[lightning]'``):
``adasum.lightning.AdasumCallback``, ``AdasumStatistics`` (logs the per-step statistics) and the
strategies ``"ddp_adasum"`` and ``"ddp_adasum_delta"``, registered with Lightning when this module is
imported (implemented in `adasum.integrations.lightning`)."""

from adasum.integrations.lightning import AdasumCallback, AdasumDDPStrategy, AdasumDeltaStrategy, AdasumStatistics

__all__ = ["AdasumCallback", "AdasumDDPStrategy", "AdasumDeltaStrategy", "AdasumStatistics"]
