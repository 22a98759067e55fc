"""A virtual data-parallel world: N Lion Cub workers in one process, for convergence at many workers.

``VirtualLionCub(params, workers=N, **options)`` steps N workers' momenta and one copy of the
parameters through the library's own aggregations (:mod:`ds_lioncub.simulate.world`), bit-identical
to LionCub on N real ranks; ``python -m ds_lioncub.simulate`` trains a model with it beside exact Lion.
"""

from ds_lioncub.simulate.world import NETWORK_OPTIONS, AgreementStats, VirtualLionCub

__all__ = ["NETWORK_OPTIONS", "AgreementStats", "VirtualLionCub"]
