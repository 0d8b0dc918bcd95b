"""Model presets: cache declarations derived from Hugging Face configs.

:mod:`.options` holds the serving options and the :class:`ModelCache` record,
:mod:`.config` the checked config reader, :mod:`.loading` where a config comes
from and which family reads it, :mod:`.shapes` what families share (dtypes,
TP splits, KV and Mamba2 fields), the ``*_families`` modules one group of
families each, and :mod:`.presets` the registry from family to builder and
:func:`model_cache`, the one entry point.
"""

from .config import ConfigError, ConfigReader, UnknownModelError
from .loading import PRESETS, detect_family, load_config
from .options import KV_DTYPES, STATE_DTYPES, ModelCache, ServingOptions
from .presets import model_cache

__all__ = [
    "KV_DTYPES",
    "PRESETS",
    "STATE_DTYPES",
    "ConfigError",
    "ConfigReader",
    "ModelCache",
    "ServingOptions",
    "UnknownModelError",
    "detect_family",
    "load_config",
    "model_cache",
]
