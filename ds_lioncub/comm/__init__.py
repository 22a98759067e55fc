"""The compressed communication backend under LionCub."""

from ds_lioncub.comm.backend import CompressedBackend, legacy_padded_numel
from ds_lioncub.comm.packing import pack_signs, unpack_signs
from ds_lioncub.comm.transport import CommStats, TorchTransport

__all__ = ["CompressedBackend", "CommStats", "TorchTransport", "legacy_padded_numel", "pack_signs", "unpack_signs"]
