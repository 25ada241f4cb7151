"""How to combine across workers, behind one interface (`base.Reducer`): `Sum`, `Mean`
(`simple`), `Adasum` (`adasum`), `AdaCons` (`adacons`). The built-in reducers are registered here
by name for `get_reducer`; `register` adds more."""

from adasum.reducers.adacons import AdaCons
from adasum.reducers.adasum import Adasum
from adasum.reducers.base import Reducer, ShardGroups, get_reducer, register
from adasum.reducers.simple import Mean, Sum

for _cls in (Sum, Mean, Adasum, AdaCons):
    register(_cls.name, _cls)

__all__ = ["AdaCons", "Adasum", "Mean", "Reducer", "ShardGroups", "Sum", "get_reducer", "register"]
