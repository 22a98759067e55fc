"""ds_lioncub: Lion Cub, communication-efficient distributed Lion, and its compressed backend.

Importing the package registers ``"type": "LionCub"`` with DeepSpeed (:func:`ds_lioncub.integration.register`).
"""

# _deepspeed_import first imports DeepSpeed, its import-time messages on stderr (stdout is a tool's output).
from ds_lioncub import _deepspeed_import, _moved  # noqa: F401
from ds_lioncub._version import __version__
from ds_lioncub.comm import CommStats, CompressedBackend
from ds_lioncub.config import LionCubConfig, parse_config
from ds_lioncub.errors import (
    LionCubConfigError,
    LionCubError,
    LionCubSetupError,
    MissingDependencyError,
    MpiSetupError,
    NonFiniteGradientError,
    UnsupportedParameterError,
)
from ds_lioncub.integration import register as register_with_deepspeed
from ds_lioncub.optimizer import LionCub

__all__ = [
    "__version__",
    "CommStats",
    "CompressedBackend",
    "LionCub",
    "LionCubConfig",
    "LionCubConfigError",
    "LionCubError",
    "LionCubSetupError",
    "MissingDependencyError",
    "MpiSetupError",
    "NonFiniteGradientError",
    "UnsupportedParameterError",
    "parse_config",
    "register_with_deepspeed",
]

_moved.install()  # the module paths that moved into sub-packages keep importing
register_with_deepspeed()
