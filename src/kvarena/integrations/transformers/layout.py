"""What a transformers model keeps in its cache, declared as kvarena fields.

transformers' cache layers receive tensors whose shapes the modeling code
decides, and which differ from the serving engines' layouts the presets
describe (vLLM keeps a Mamba conv state as ``[kernel - 1, dim]``;
transformers keeps ``[dim, kernel]`` and updates it in place). So the
integration declares exactly what the model hands its cache:

- ``full_attention`` layers page ``k`` and ``v`` (``[block, heads, dim]`` per
  block), read back as the ``[B, heads, T, dim]`` attention takes;
- ``sliding_attention`` / ``chunked_attention`` layers keep a ring of
  ``window`` tokens per request in the STATE entry;
- ``linear_attention`` / ``conv`` layers keep their conv and recurrent states
  in the STATE entry, in the dtype the model computes them in (the recurrent
  state is float32 even in a bf16 model: transformers' kernels accumulate it
  in float32, and a bf16 state changes tokens);
- ``dummy`` layers (MLP, MoE, KV-sharing consumers) keep nothing.

The layer types come from transformers' own reading of the config
(``layer_types`` where the config has it, possibly non-periodic), so a layout
follows the model it will serve, and every declaration is checked against a
real ``DynamicCache`` by the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...checks import check_count
from ...errors import InvalidValueError
from ...layout import EntryField
from ...models import ModelCache, ServingOptions
from ...models.config import MAX_DIM, ConfigReader, UnknownModelError
from ...models.shapes import (
    MAMBA2_NEMOTRON_FIELDS,
    MAMBA2_PREFIXED_FIELDS,
    gdn_conv_channels,
    head_dim,
    mamba2_conv_channels,
)

PAGED, RING, LINEAR, NONE = "paged", "ring", "linear", "none"
_KIND_OF = {
    "full_attention": PAGED,
    "sliding_attention": RING,
    "chunked_attention": RING,
    "linear_attention": LINEAR,
    "conv": LINEAR,
    "dummy": NONE,
}
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LinearStates:
    """One linear-attention layer's per-request states, as transformers keeps them."""

    conv_shape: tuple[int, ...]  # [channels, kernel]
    recurrent_shape: tuple[int, ...] | None  # None: a conv-only layer (LFM2's short conv)
    recurrent_dtype: torch.dtype = torch.float32


def _qwen3_next(c: ConfigReader) -> LinearStates:
    nk, nv = c.integer("linear_num_key_heads"), c.integer("linear_num_value_heads")
    dk, dv = c.integer("linear_key_head_dim"), c.integer("linear_value_head_dim")
    channels = gdn_conv_channels(key_heads=nk, key_dim=dk, value_heads=nv, value_dim=dv)
    return LinearStates((channels, c.integer("linear_conv_kernel_dim", lo=2)), (nv, dk, dv))


def _mamba2_like(
    heads: str, head_dim: str, state: str, groups: str = "n_groups", kernel: str = "conv_kernel"
) -> Callable[[ConfigReader], LinearStates]:
    """Mamba2 layers' states, read from the field names a family gives them."""

    def states(c: ConfigReader) -> LinearStates:
        h, d, n = c.integer(heads), c.integer(head_dim), c.integer(state)
        channels = mamba2_conv_channels(heads=h, head_dim=d, groups=c.integer(groups), state=n)
        return LinearStates((channels, c.integer(kernel, lo=2)), (h, d, n))

    return states


def _jamba(c: ConfigReader) -> LinearStates:
    # Mamba (1): a conv over the inner channels, and a [channels, state] SSM state.
    inner = c.integer("mamba_expand") * c.integer("hidden_size")
    return LinearStates(
        (inner, c.integer("mamba_d_conv", lo=2)), (inner, c.integer("mamba_d_state"))
    )


def _kimi_linear(c: ConfigReader) -> LinearStates:
    h, d = c.integer("linear_num_heads"), c.integer("linear_head_dim")
    return LinearStates((3 * h * d, c.integer("linear_conv_kernel_dim", lo=2)), (h, d, d))


LINEAR_FAMILIES: dict[str, Callable[[ConfigReader], LinearStates]] = {
    "qwen3_next": _qwen3_next,
    "qwen3_5_text": _qwen3_next,  # Qwen3.5 keeps Qwen3-Next's Gated DeltaNet
    "qwen3_5_moe_text": _qwen3_next,
    "mamba2": _mamba2_like("num_heads", "head_dim", "state_size"),
    "nemotron_h": _mamba2_like(*MAMBA2_NEMOTRON_FIELDS),
    "kimi_linear": _kimi_linear,
    # IBM's Granite 4.0 hybrids and Bamba: Mamba2 layers with fields of their own.
    "granitemoehybrid": _mamba2_like(*MAMBA2_PREFIXED_FIELDS),
    "bamba": _mamba2_like(*MAMBA2_PREFIXED_FIELDS),
    "jamba": _jamba,
    # LFM2's gated short convolutions: a conv over the hidden channels, no recurrence.
    "lfm2": lambda c: LinearStates(
        (c.integer("hidden_size"), c.integer("conv_L_cache", lo=2)), None
    ),
}
"""model_type -> the states of its linear-attention layers (checked against transformers)."""


def _kv_shapes(model_type: str, c: ConfigReader) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per-token ``(heads, dim)`` of what an attention layer hands ``Cache.update``."""
    if c.has("kv_lora_rank"):  # MLA (DeepSeek, Kimi): the latent and the shared RoPE key
        return (1, c.integer("kv_lora_rank")), (1, c.integer("qk_rope_head_dim"))
    heads = (
        c.integer("num_key_value_heads")
        if c.has("num_key_value_heads")
        else c.integer("num_attention_heads")
    )
    dim = head_dim(c)
    return (heads, dim), (heads, dim)


def model_dtype(config: Any, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype the model computes in: ``dtype`` when given, else the config's,
    else torch's default dtype — what ``from_config`` builds a model in when
    the config names none (never a silent bfloat16)."""
    value = dtype if dtype is not None else getattr(config, "dtype", None)
    if value is None:
        return torch.get_default_dtype()
    if isinstance(value, str):
        if value not in _DTYPES:
            raise InvalidValueError(f"dtype {value!r} unsupported; legal: {sorted(_DTYPES)}")
        return _DTYPES[value]
    if value not in _DTYPES.values():
        raise InvalidValueError(f"dtype {value} unsupported; legal: {sorted(_DTYPES)}")
    return value


@dataclass(frozen=True)
class HfLayout:
    """The kvarena declaration of one transformers model's cache.

    ``kinds[i]`` is layer ``i``'s kind and ``group[i]`` its index among the
    layers of that kind (its layer index in the kind's fields).
    """

    model_type: str
    kinds: tuple[str, ...]
    group: tuple[int, ...]
    window: int
    dtype: torch.dtype
    model: ModelCache

    @property
    def counts(self) -> dict[str, int]:
        return {k: self.kinds.count(k) for k in (PAGED, RING, LINEAR)}


def hf_layout(
    config: Any,
    *,
    dtype: torch.dtype | str | None = None,
    block_size: int = 16,
    rollback_tokens: int = 0,
) -> HfLayout:
    """The layout of ``config``'s (a transformers ``PretrainedConfig``) cache.

    ``rollback_tokens`` makes ``crop`` possible (assisted decoding): each
    sliding ring gets that many more rows, so a crop of up to
    ``rollback_tokens + 1`` tokens still finds the window it must keep, and
    linear-attention layers get a rollback entry per request, holding their
    states from before the last forward."""
    rollback = check_count(rollback_tokens, "rollback_tokens", hi=MAX_DIM)
    from transformers.cache_utils import get_layer_types_and_kwargs

    if not hasattr(config, "get_text_config"):
        raise InvalidValueError(
            f"config must be a transformers PretrainedConfig, got {type(config).__name__}"
        )
    text = config.get_text_config(decoder=True)
    model_type = str(getattr(text, "model_type", "") or "")
    c = ConfigReader(text.to_dict(), model_type or "config")
    types, kwargs = get_layer_types_and_kwargs(text)
    unknown = sorted({t for t in types if t not in _KIND_OF})
    if unknown:
        raise UnknownModelError(
            f"{model_type}: layer types {unknown} have no kvarena layout; supported: "
            f"{', '.join(sorted(_KIND_OF))}"
        )
    kinds = tuple(_KIND_OF[t] for t in types)
    windows = {int(kw["sliding_window"]) for kw, k in zip(kwargs, kinds, strict=True) if k == RING}
    if len(windows) > 1:
        raise UnknownModelError(f"{model_type}: sliding layers with different windows {windows}")
    window = windows.pop() if windows else 0
    if window and not 1 < window <= MAX_DIM:
        raise UnknownModelError(
            f"{model_type}: sliding_window must be in 2..{MAX_DIM}, got {window}"
        )
    seen: dict[str, int] = {}
    group = []
    for k in kinds:
        group.append(seen.get(k, 0))
        seen[k] = seen.get(k, 0) + 1
    n_paged, n_ring, n_linear = (kinds.count(k) for k in (PAGED, RING, LINEAR))
    dt = model_dtype(config, dtype)
    (hk, dk), (hv, dv) = _kv_shapes(model_type, c) if n_paged or n_ring else ((1, 1), (1, 1))
    page = (
        [
            EntryField("k", n_paged, (block_size, hk, dk), dt),
            EntryField("v", n_paged, (block_size, hv, dv), dt),
        ]
        if n_paged
        else []
    )
    state = (
        [
            EntryField("k_window", n_ring, (window + rollback, hk, dk), dt),
            EntryField("v_window", n_ring, (window + rollback, hv, dv), dt),
        ]
        if n_ring
        else []
    )
    if n_linear:
        if model_type not in LINEAR_FAMILIES:
            raise UnknownModelError(
                f"{model_type}: kvarena does not know its linear-attention states; known: "
                f"{', '.join(sorted(LINEAR_FAMILIES))}"
            )
        lin = LINEAR_FAMILIES[model_type](c)
        state.append(EntryField("conv_state", n_linear, lin.conv_shape, dt))
        if lin.recurrent_shape is not None:
            state.append(
                EntryField("recurrent_state", n_linear, lin.recurrent_shape, lin.recurrent_dtype)
            )
    model = ModelCache(
        name=str(getattr(config, "_name_or_path", "") or model_type),
        family=f"transformers:{model_type}",
        # A rollback entry per request holds the linear states from before a
        # verified draft, for crop to replay the accepted tokens from.
        options=ServingOptions(block_size=block_size, spec_tokens=int(bool(rollback and n_linear))),
        page_fields=tuple(page),
        state_fields=tuple(state),
        attention_layers=n_paged,
        state_layers=n_ring + n_linear,
        recurrent_layers=n_linear,
        state_bytes_per_layer=0,
    )
    return HfLayout(model_type, kinds, tuple(group), window, dt, model)
