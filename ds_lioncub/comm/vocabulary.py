"""The option values the compressed collectives understand, spelled once.

``ds_lioncub.config`` builds its validated options from these Literals, and the collectives check
the same tuples, so a value is accepted in one place exactly when it is accepted in the other.
"""

from __future__ import annotations

from typing import Literal, get_args

TieBreak = Literal["alternate", "positive"]
Quantizer = Literal["sign", "l1"]
Aggregation = Literal["vote", "mean"]
KbitAlgorithm = Literal["allreduce", "alltoall"]
KbitWidth = Literal[2, 4, 8]
CommBackendName = Literal["torch", "mpi"]

TIE_BREAKS: tuple[str, ...] = get_args(TieBreak)
QUANTIZERS: tuple[str, ...] = get_args(Quantizer)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KBIT_ALGORITHMS: tuple[str, ...] = get_args(KbitAlgorithm)
KBIT_WIDTHS: tuple[int, ...] = get_args(KbitWidth)
COMM_BACKENDS: tuple[str, ...] = get_args(CommBackendName)
