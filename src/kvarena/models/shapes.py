"""What every family shares: dtypes, TP splits, KV and Mamba2 fields, and the ModelCache builder."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import InvalidValueError
from ..layout import EntryField
from .config import ConfigError, ConfigReader
from .options import _DTYPES, ModelCache, ServingOptions


def _dtype_name(c: ConfigReader, key: str) -> str:
    """A dtype named by config field ``key`` ("auto" passes through), checked."""
    name = c.string(key)
    if name.startswith("torch."):  # str(torch.bfloat16) in configs saved from objects
        name = name[len("torch.") :]
    if name != "auto" and name not in _DTYPES:
        raise ConfigError(f"{c.where}: {key} {name!r} unsupported; legal: {sorted(_DTYPES)}")
    return name


def _config_dtype(c: ConfigReader) -> str | None:
    """The config's ``torch_dtype`` (or transformers 5's ``dtype``), None when it names none."""
    for key in ("torch_dtype", "dtype"):
        if c.has(key):
            name = _dtype_name(c, key)
            if name == "auto":
                raise ConfigError(
                    f"{c.where}: {key} 'auto' names no dtype; legal: {sorted(_DTYPES)}"
                )
            return name
    return None


def _model_dtype(c: ConfigReader, o: ServingOptions) -> torch.dtype:
    """The dtype the model computes in: the serving option, else the config's,
    else float32 (what transformers builds a model in when the config names none)."""
    if o.dtype != "auto":
        return _DTYPES[o.dtype]
    return _DTYPES[_config_dtype(c) or "float32"]


def _kv_dtype(opts: ServingOptions, model: torch.dtype, *, packed_mla: bool = False) -> torch.dtype:
    if opts.kv_dtype == "auto":
        return model
    if opts.kv_dtype == "fp8":
        return torch.float8_e4m3fn
    if opts.kv_dtype == "fp8_ds_mla":
        if not packed_mla:
            raise InvalidValueError(
                "kv_dtype 'fp8_ds_mla' is an MLA format; use 'fp8' for this model"
            )
        return torch.uint8
    return _DTYPES[opts.kv_dtype]


def _state_dtype(opts: ServingOptions, default: torch.dtype) -> torch.dtype:
    return default if opts.state_dtype == "auto" else _DTYPES[opts.state_dtype]


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise InvalidValueError(f"{what} = {n} is not divisible by tensor-parallel size {tp}")
    return n // tp


def _kv_heads(n: int, tp: int) -> int:
    """KV heads per rank: split when TP divides them, one replicated head a rank
    when TP is a multiple of them (vLLM's QKV projection: ``tp / n`` replicas of
    each head); any other TP size is refused, as vLLM refuses it."""
    if tp >= n:
        if tp % n:
            raise InvalidValueError(
                f"num_key_value_heads = {n} and tensor-parallel size {tp}: the heads must "
                "split evenly over the ranks or each be replicated on a whole number of them"
            )
        return 1
    return _split(n, tp, "num_key_value_heads")


def _block(opts: ServingOptions, default: int) -> int:
    return opts.block_size or default


def _kv_fields(
    layers: int, block: int, heads: int, head_dim: int, dtype: torch.dtype
) -> list[EntryField]:
    return [
        EntryField("k", layers, (block, heads, head_dim), dtype),
        EntryField("v", layers, (block, heads, head_dim), dtype),
    ]


MAMBA2_NEMOTRON_FIELDS = (
    "mamba_num_heads",
    "mamba_head_dim",
    "ssm_state_size",
    "n_groups",
    "conv_kernel",
)
"""Where Nemotron-H's config names its Mamba2 heads, head dim, state size, groups
and conv kernel."""
MAMBA2_PREFIXED_FIELDS = (
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_d_state",
    "mamba_n_groups",
    "mamba_d_conv",
)
"""The same, as Granite 4.0 hybrids, Bamba and Falcon-H1 name them."""


def _mamba2_states(
    c: ConfigReader, o: ServingOptions, layers: int, model: torch.dtype, names: tuple[str, ...]
) -> list[EntryField]:
    """Mamba2 states of ``layers`` layers, read from the fields ``names`` says."""
    heads, head_dim, state, groups, kernel = names
    return _mamba2_fields(
        layers=layers,
        heads=c.integer(heads),
        head_dim=c.integer(head_dim),
        state=c.integer(state),
        groups=c.integer(groups),
        kernel=c.integer(kernel, lo=2),
        tp=o.tp,
        conv_dtype=model,
        ssm_dtype=_ssm_dtype(c, o, model),
    )


def _attention_pages(
    c: ConfigReader, o: ServingOptions, layers: int, block: int, model: torch.dtype
) -> list[EntryField]:
    """K and V pages of a hybrid's ``layers`` GQA attention layers; none (and no
    attention field read) when it has none."""
    if not layers:
        return []
    heads = _kv_heads(c.integer("num_key_value_heads"), o.tp)
    return _kv_fields(layers, block, heads, head_dim(c), _kv_dtype(o, model))


def _per_layer(fields: list[EntryField]) -> int:
    return sum(f.bytes_per_layer for f in fields)


def mamba2_conv_channels(*, heads: int, head_dim: int, groups: int, state: int) -> int:
    """Channels of a Mamba2 conv state: the heads' inner channels and each group's B and C."""
    return heads * head_dim + 2 * groups * state


def gdn_conv_channels(*, key_heads: int, key_dim: int, value_heads: int, value_dim: int) -> int:
    """Channels of a Gated DeltaNet conv state (Qwen3-Next): q and k over the key
    heads, v over the value heads."""
    return 2 * key_heads * key_dim + value_heads * value_dim


def _mamba2_fields(
    *,
    layers: int,
    heads: int,
    head_dim: int,
    state: int,
    groups: int,
    kernel: int,
    tp: int,
    conv_dtype: torch.dtype,
    ssm_dtype: torch.dtype,
) -> list[EntryField]:
    """Mamba2's conv and SSM states, split over ``tp`` ranks as vLLM splits them.

    The conv state holds the heads' channels and each group's B and C. A rank
    needs the groups of its own heads: groups that ``tp`` divides split with
    the heads; a single group is replicated on every rank (vLLM and SGLang
    count it ``tp`` times: mamba2-2.7b at TP 8 keeps 640 + 2 x 128 channels
    a rank, not (5,120 + 256) / 8); any other count is refused, as vLLM's
    Mamba2 mixer refuses it.
    """
    if groups % tp:
        if groups != 1:
            raise InvalidValueError(
                f"mamba n_groups = {groups} is not divisible by tensor-parallel size {tp} "
                "(only a single group is replicated over the ranks)"
            )
        groups = tp
    conv_dim = _split(
        mamba2_conv_channels(heads=heads, head_dim=head_dim, groups=groups, state=state),
        tp,
        "mamba conv dim",
    )
    return [
        EntryField("conv_state", layers, (kernel - 1, conv_dim), conv_dtype),
        EntryField(
            "ssm_state", layers, (_split(heads, tp, "mamba heads"), head_dim, state), ssm_dtype
        ),
    ]


def _model(
    name: str,
    family: str,
    o: ServingOptions,
    block: int,
    page: list[EntryField],
    state: list[EntryField],
    *,
    attention: int,
    state_layers: int,
    recurrent: int = 0,
    align: int = 16,
    notes: tuple[str, ...] = (),
) -> ModelCache:
    """A family's answer, with the block size it resolved written into the options."""
    return ModelCache(
        name=name,
        family=family,
        options=replace(o, block_size=block),
        page_fields=tuple(page),
        state_fields=tuple(state),
        attention_layers=attention,
        state_layers=state_layers,
        recurrent_layers=recurrent,
        state_bytes_per_layer=_per_layer(state) if recurrent else 0,
        kernel_block_align=align,
        notes=notes,
    )


# -- families --------------------------------------------------------------------


def head_dim(c: ConfigReader) -> int:
    """``head_dim`` when the config names it, else hidden size over attention heads."""
    if c.has("head_dim"):
        return c.integer("head_dim")
    hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
    if hidden % heads:
        raise ConfigError(
            f"{c.where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    return hidden // heads


def _ssm_dtype(c: ConfigReader, o: ServingOptions, model: torch.dtype) -> torch.dtype:
    """Mamba's SSM state: the serving option, else the config's
    ``mamba_ssm_cache_dtype`` (vLLM honours it too), else the model dtype."""
    if o.state_dtype == "auto" and c.has("mamba_ssm_cache_dtype"):
        name = _dtype_name(c, "mamba_ssm_cache_dtype")
        if name != "auto":
            return _DTYPES[name]
    return _state_dtype(o, model)
