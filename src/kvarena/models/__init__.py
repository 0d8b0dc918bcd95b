"""Model presets: cache declarations derived from Hugging Face configs."""

from .config import ConfigError, ConfigReader
from .presets import (
    KV_DTYPES,
    PRESETS,
    STATE_DTYPES,
    ModelCache,
    ServingOptions,
    UnknownModelError,
    detect_family,
    load_config,
    model_cache,
)

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
