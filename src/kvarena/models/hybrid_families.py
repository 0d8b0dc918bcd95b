"""Hybrids of attention and recurrent layers: Qwen3-Next, Mamba2, Nemotron-H, Granite 4.0, Bamba, Falcon-H1, Jamba, LFM2."""

from __future__ import annotations

from collections.abc import Callable

from ..layout import EntryField
from .config import MAX_LAYERS, ConfigError, ConfigReader
from .options import ModelCache, ServingOptions
from .shapes import (
    MAMBA2_NEMOTRON_FIELDS,
    MAMBA2_PREFIXED_FIELDS,
    _attention_pages,
    _block,
    _config_dtype,
    _kv_dtype,
    _kv_fields,
    _kv_heads,
    _mamba2_fields,
    _mamba2_states,
    _model,
    _model_dtype,
    _split,
    _ssm_dtype,
    _state_dtype,
    gdn_conv_channels,
    head_dim,
)

_LINEAR_KINDS = ("full_attention", "linear_attention")
"""The layer kinds of linear-attention hybrids (Qwen3-Next, Kimi-Linear)."""


def _qwen3_next_layers(c: ConfigReader) -> tuple[int, int]:
    """(attention layers, Gated DeltaNet layers) from ``layer_types`` (transformers 5)
    or ``full_attention_interval`` (the original config)."""
    layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
    if c.has("layer_types"):
        attn = c.layer_kinds(layers, _LINEAR_KINDS).count("full_attention")
        return attn, layers - attn
    interval = c.integer("full_attention_interval", hi=MAX_LAYERS)
    attn = layers // interval  # every interval-th layer is full attention
    return attn, layers - attn


def _qwen3_next(name: str, root: ConfigReader, o: ServingOptions) -> ModelCache:
    # Qwen3.5 keeps Qwen3-Next's layers, its multimodal config under text_config.
    c = root.sub("text_config", optional=True) or root
    attn, gdn = _qwen3_next_layers(c)
    model = _model_dtype(c if _config_dtype(c) else root, o)
    block = _block(o, 16)
    page = _kv_fields(
        attn,
        block,
        _kv_heads(c.integer("num_key_value_heads"), o.tp),
        head_dim(c),
        _kv_dtype(o, model),
    )
    nk, nv = c.integer("linear_num_key_heads"), c.integer("linear_num_value_heads")
    dk, dv = c.integer("linear_key_head_dim"), c.integer("linear_value_head_dim")
    conv_dim = _split(
        gdn_conv_channels(key_heads=nk, key_dim=dk, value_heads=nv, value_dim=dv),
        o.tp,
        "GDN conv dim",
    )
    kernel = c.integer("linear_conv_kernel_dim", lo=2)
    state = [
        EntryField("conv_state", gdn, (kernel - 1, conv_dim), model),
        EntryField(
            "recurrent_state",
            gdn,
            (_split(nv, o.tp, "linear value heads"), dk, dv),
            _state_dtype(o, model),
        ),
    ]
    return _model(
        name, "qwen3_next", o, block, page, state, attention=attn, state_layers=gdn, recurrent=gdn
    )


def _mamba2(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    # Hugging Face's Mamba2Config, or mamba_ssm's (d_model, n_layer, ssm_cfg).
    ssm = c.sub("ssm_cfg", optional=True) or ConfigReader({}, f"{c.where}.ssm_cfg")
    hidden = c.first_int(("hidden_size", "d_model"))
    layers = c.first_int(("num_hidden_layers", "n_layer"), hi=MAX_LAYERS)
    expand = c.integer("expand") if c.has("expand") else ssm.integer("expand", default=2)
    head_dim = c.integer("head_dim") if c.has("head_dim") else ssm.integer("headdim", default=64)
    if c.has("num_heads"):
        heads = c.integer("num_heads")
    else:
        if expand * hidden % head_dim:
            raise ConfigError(
                f"{c.where}: expand x hidden_size = {expand * hidden} is not a multiple of "
                f"head_dim {head_dim}"
            )
        heads = expand * hidden // head_dim
    model = _model_dtype(c, o)
    state = _mamba2_fields(
        layers=layers,
        heads=heads,
        head_dim=head_dim,
        state=c.integer("state_size")
        if c.has("state_size")
        else ssm.integer("d_state", default=128),
        groups=c.integer("n_groups") if c.has("n_groups") else ssm.integer("ngroups", default=1),
        kernel=c.integer("conv_kernel", lo=2)
        if c.has("conv_kernel")
        else ssm.integer("d_conv", lo=2, default=4),
        tp=o.tp,
        conv_dtype=model,
        ssm_dtype=_ssm_dtype(c, o, model),
    )
    return _model(
        name,
        "mamba2",
        o,
        _block(o, 16),
        [],
        state,
        attention=0,
        state_layers=layers,
        recurrent=layers,
    )


_NEMOTRON_BLOCKS = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
    "moe": "E",
}


def _nemotron_pattern(c: ConfigReader) -> str:
    """The layer pattern from ``hybrid_override_pattern`` (the original config) or
    ``layers_block_type`` (transformers 5), as one letter per layer."""
    if c.has("hybrid_override_pattern") or not c.has("layers_block_type"):
        return c.string("hybrid_override_pattern")
    kinds = c.str_list("layers_block_type")
    unknown = sorted(set(kinds) - set(_NEMOTRON_BLOCKS))
    if unknown:
        raise ConfigError(
            f"{c.where}: layers_block_type holds {unknown}; legal: {sorted(_NEMOTRON_BLOCKS)}"
        )
    return "".join(_NEMOTRON_BLOCKS[k] for k in kinds)


def _nemotron_h(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    pattern = _nemotron_pattern(c)
    if len(pattern) > MAX_LAYERS or set(pattern) - set("M*-E"):
        raise ConfigError(
            f"{c.where}: hybrid_override_pattern must be at most {MAX_LAYERS} of 'M' (Mamba2), "
            f"'*' (attention), '-' (MLP) and 'E' (MoE), got {pattern[:40]!r}"
        )
    mamba, attn = pattern.count("M"), pattern.count("*")
    model = _model_dtype(c, o)
    block = _block(o, 16)
    page = _attention_pages(c, o, attn, block, model)
    state = _mamba2_states(c, o, mamba, model, MAMBA2_NEMOTRON_FIELDS)
    return _model(
        name,
        "nemotron_h",
        o,
        block,
        page,
        state,
        attention=attn,
        state_layers=mamba,
        recurrent=mamba,
    )


_HYBRID_KINDS = {
    "mamba": False,
    "linear_attention": False,
    "attention": True,
    "full_attention": True,
}
"""A Mamba2 hybrid's ``layer_types`` (the hub's words and transformers 5's):
True for an attention layer."""


def _hybrid_attention_layers(c: ConfigReader, layers: int) -> int:
    """How many layers attend: ``layer_types`` (Granite 4.0), else
    ``attn_layer_indices`` (Bamba), else none (every layer Mamba2, as
    transformers builds either config without them)."""
    if c.has("layer_types"):
        kinds = c.layer_kinds(layers, tuple(_HYBRID_KINDS))
        return sum(_HYBRID_KINDS[k] for k in kinds)
    if c.has("attn_layer_indices"):
        return len(c.layer_indices("attn_layer_indices", layers))
    return 0


def _mamba2_hybrid(
    family: str, *, parallel: bool = False
) -> Callable[[str, ConfigReader, ServingOptions], ModelCache]:
    """Mamba2 layers beside attention layers, with ``mamba_*`` fields (IBM
    Granite 4.0's ``granitemoehybrid``, Bamba), or inside every attention layer
    (``parallel``: TII's Falcon-H1, whose layers run both side by side): the
    attention layers page, each Mamba2 layer keeps a conv and an SSM state per
    request, shaped as for Nemotron-H."""

    def build(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
        layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
        attn = layers if parallel else _hybrid_attention_layers(c, layers)
        mamba = layers if parallel else layers - attn
        heads, head_dim = c.integer("mamba_n_heads"), c.integer("mamba_d_head")
        # vLLM sizes the conv state from the inner size (Falcon-H1's mamba_d_ssm,
        # else mamba_expand x hidden_size) and the SSM state from the heads: a
        # config where the two differ is not guessed at.
        inner, said = None, ""
        if c.has("mamba_d_ssm"):
            inner, said = c.integer("mamba_d_ssm"), "mamba_d_ssm"
        elif c.has("mamba_expand"):
            inner = c.integer("mamba_expand") * c.integer("hidden_size")
            said = "mamba_expand x hidden_size"
        if inner is not None and inner != heads * head_dim:
            raise ConfigError(
                f"{c.where}: mamba_n_heads x mamba_d_head = {heads * head_dim} but {said} = "
                f"{inner}; the Mamba2 inner size must agree"
            )
        model = _model_dtype(c, o)
        block = _block(o, 16)
        page = _attention_pages(c, o, attn, block, model)
        state = _mamba2_states(c, o, mamba, model, MAMBA2_PREFIXED_FIELDS) if mamba else []
        return _model(
            name,
            family,
            o,
            block,
            page,
            state,
            attention=attn,
            state_layers=mamba,
            recurrent=mamba,
        )

    return build


def _jamba(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    """AI21's Jamba: Mamba (1) layers beside attention ones, layer ``i`` attending
    when ``i % attn_layer_period == attn_layer_offset`` (transformers' defaults
    8 and 4 where the config names neither). A Mamba layer keeps, as vLLM's
    ``mamba1_state_shape``, a conv state of ``d_conv - 1`` rows over the inner
    channels and a ``[inner, d_state]`` SSM state, both split over TP ranks."""
    layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
    period = c.integer("attn_layer_period", hi=MAX_LAYERS, default=8)
    offset = c.integer("attn_layer_offset", lo=0, hi=period - 1, default=4)
    attn = len(range(offset, layers, period))
    mamba = layers - attn
    model = _model_dtype(c, o)
    block = _block(o, 16)
    page = _attention_pages(c, o, attn, block, model)
    inner = _split(c.integer("mamba_expand") * c.integer("hidden_size"), o.tp, "mamba inner size")
    state = (
        [
            EntryField("conv_state", mamba, (c.integer("mamba_d_conv", lo=2) - 1, inner), model),
            EntryField(
                "ssm_state", mamba, (inner, c.integer("mamba_d_state")), _ssm_dtype(c, o, model)
            ),
        ]
        if mamba
        else []
    )
    return _model(
        name, "jamba", o, block, page, state, attention=attn, state_layers=mamba, recurrent=mamba
    )


_LFM2_KINDS = ("conv", "full_attention")


def _lfm2(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    """Liquid's LFM2: gated short-convolution layers beside attention ones
    (``layer_types``, or ``full_attn_idxs`` in the first configs). A conv layer
    keeps only its convolution's last ``conv_L_cache - 1`` inputs over the
    hidden channels, vLLM's ``short_conv_state_shape``, in the model dtype."""
    layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
    if c.has("layer_types"):
        attn = c.layer_kinds(layers, _LFM2_KINDS).count("full_attention")
    else:
        attn = len(c.layer_indices("full_attn_idxs", layers))
    convs = layers - attn
    model = _model_dtype(c, o)
    block = _block(o, 16)
    page = _attention_pages(c, o, attn, block, model)
    channels = _split(c.integer("hidden_size"), o.tp, "hidden_size")
    state = [
        EntryField("conv_state", convs, (c.integer("conv_L_cache", lo=2) - 1, channels), model)
    ]
    return _model(
        name, "lfm2", o, block, page, state, attention=attn, state_layers=convs, recurrent=convs
    )
