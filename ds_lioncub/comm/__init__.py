"""The compressed communication backend under LionCub."""

from ds_lioncub.comm.backend import CompressedBackend, legacy_padded_numel
from ds_lioncub.comm.packing import pack_signs, unpack_signs
from ds_lioncub.comm.transport import CommStats, MpiSetupError, MpiTransport, TorchTransport, make_transport

__all__ = [
    "CompressedBackend",
    "CommStats",
    "MpiSetupError",
    "MpiTransport",
    "TorchTransport",
    "legacy_padded_numel",
    "make_transport",
    "pack_signs",
    "unpack_signs",
]
