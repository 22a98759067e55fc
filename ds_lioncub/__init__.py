"""ds_lioncub: Lion Cub, communication-efficient distributed Lion, and its compressed backend."""

from ds_lioncub.comm import CommStats, CompressedBackend
from ds_lioncub.config import LionCubConfig, LionCubConfigError, parse_config
from ds_lioncub.deepspeed_integration import register as register_with_deepspeed
from ds_lioncub.optimizer import LionCub

__version__ = "0.1.0"

register_with_deepspeed()

__all__ = ["CommStats", "CompressedBackend", "LionCub", "LionCubConfig", "LionCubConfigError", "parse_config"]
