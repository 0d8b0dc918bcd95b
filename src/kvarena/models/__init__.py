"""Field declarations of real models' per-request states."""

from .states import (
    REFERENCE_STATES,
    deepseek_v4_flash_state,
    mamba2_state,
    qwen3_next_gdn_state,
)

__all__ = ["REFERENCE_STATES", "deepseek_v4_flash_state", "mamba2_state", "qwen3_next_gdn_state"]
