"""Public path of the FSDP2 integration: ``adasum.fsdp.enable(model, mesh)`` (implemented in
`adasum.integrations.fsdp`)."""

from adasum.checks.agreement import check_not_sharded
from adasum.integrations.fsdp import FSDPState, enable

__all__ = ["FSDPState", "check_not_sharded", "enable"]
