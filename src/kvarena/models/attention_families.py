"""Families whose every layer attends: GQA, sliding/chunked windows (Gemma, gpt-oss, Cohere2, Llama 4), MLA."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layout import EntryField
from .config import MAX_LAYERS, ConfigReader
from .options import ModelCache, ServingOptions
from .shapes import _block, _kv_dtype, _kv_fields, _kv_heads, _model, _model_dtype, head_dim

_ATTENTION_KINDS = ("full_attention", "sliding_attention")
"""The layer kinds an attention-only config's ``layer_types`` may name."""


def _sliding_layers(c: ConfigReader, layers: int) -> int:
    """How many of a GQA config's layers attend only a sliding window.

    ``layer_types`` says it per layer where the config has it; otherwise a
    Qwen2/Qwen3 config slides the layers from ``max_window_layers`` on when
    ``use_sliding_window`` is set, and any other (Mistral-7B-v0.1) slides
    every layer when ``sliding_window`` is set.
    """
    if c.has("layer_types"):
        return c.layer_kinds(layers, _ATTENTION_KINDS).count("sliding_attention")
    if not c.has("sliding_window"):
        return 0
    if c.has("use_sliding_window") or c.has("max_window_layers"):
        if not c.flag("use_sliding_window"):
            return 0
        first = c.integer("max_window_layers", lo=0, hi=MAX_LAYERS, default=0)
        return max(0, layers - first)
    return layers


def _gqa(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
    block = _block(o, 16)
    kv = _kv_dtype(o, _model_dtype(c, o))
    heads = _kv_heads(c.integer("num_key_value_heads"), o.tp)
    page = _kv_fields(layers, block, heads, head_dim(c), kv)
    sliding = _sliding_layers(c, layers)
    notes: tuple[str, ...] = ()
    if sliding:
        window = (
            f"a {c.integer('sliding_window')}-token sliding window"
            if c.has("sliding_window")
            else "a sliding window"
        )
        # Paging the whole context is a superset of the window: every token a
        # layer reads is kept, so the model runs exactly; only the capacity
        # is what full attention would get.
        notes = (
            f"{sliding} of {layers} layers attend only {window}; this family pages their whole "
            "context, so token capacity is counted as for full attention",
        )
    return _model(name, "gqa", o, block, page, [], attention=layers, state_layers=0, notes=notes)


@dataclass(frozen=True)
class _Local:
    """How a family names its local (window-bounded) layers: their kind in
    ``layer_types`` and in the plan's note, the config field of their window,
    the field of the every-n-th-is-global pattern (and its default where the
    config names none), and a per-layer 0/1 list whose 0s are the global
    layers."""

    kind: str = "sliding_attention"
    label: str = "sliding-window"
    window: str = "sliding_window"
    pattern: str = "sliding_window_pattern"
    pattern_default: int = 6
    flags: str | None = None


def _global_layers(t: ConfigReader, layers: int, local: _Local) -> int:
    if t.has("layer_types"):
        return t.layer_kinds(layers, ("full_attention", local.kind)).count("full_attention")
    flags = t.layer_flags(local.flags, layers) if local.flags and t.has(local.flags) else []
    if flags:
        return flags.count(0)
    pattern = t.integer(local.pattern, hi=MAX_LAYERS, default=local.pattern_default)
    return layers // pattern  # every pattern-th layer is global


def _windowed(
    family: str, local: _Local
) -> Callable[[str, ConfigReader, ServingOptions], ModelCache]:
    """A family whose local layers keep a per-request K/V ring and whose global
    layers page (Gemma 2/3, gpt-oss, Command R7B: sliding windows; Llama 4:
    chunked attention).

    A sliding layer never reads past its window, and a chunked one past its
    chunk, so a ring of ``window`` tokens per request is all it needs however
    long the context: the capacity the global layers page is not spent on it.
    ``layer_types`` names each layer's kind where the config has it; else a
    per-layer list (Llama 4's ``no_rope_layers``: its RoPE layers are the
    chunked ones); else every ``pattern``-th layer is global (Gemma 3 6,
    Gemma 2 and gpt-oss 2, Cohere2 4, Llama 4 4).
    """

    def build(name: str, root: ConfigReader, o: ServingOptions) -> ModelCache:
        t = root.sub("text_config", optional=True) or root
        layers = t.integer("num_hidden_layers", hi=MAX_LAYERS)
        full = _global_layers(t, layers, local)
        rings = layers - full
        heads = _kv_heads(t.integer("num_key_value_heads"), o.tp)
        dim = head_dim(t)
        block = _block(o, 16)
        kv = _kv_dtype(o, _model_dtype(root, o))
        page = _kv_fields(full, block, heads, dim, kv)
        notes: tuple[str, ...] = ()
        state: list[EntryField] = []
        if rings:
            window = t.integer(local.window)
            state = [
                EntryField("k_window", rings, (window, heads, dim), kv),
                EntryField("v_window", rings, (window, heads, dim), kv),
            ]
            notes = (
                f"{rings} {local.label} layers keep a {window}-token K/V ring per request; "
                f"{full} global layers page",
            )
        return _model(
            name, family, o, block, page, state, attention=full, state_layers=rings, notes=notes
        )

    return build


def _mla_row(
    c: ConfigReader, o: ServingOptions, model: torch.dtype
) -> tuple[tuple[int, ...], torch.dtype]:
    latent, rope = c.integer("kv_lora_rank"), c.integer("qk_rope_head_dim")
    dtype = _kv_dtype(o, model, packed_mla=True)
    if o.kv_dtype == "fp8_ds_mla":
        # [latent fp8 | one fp32 scale per 128 | rope bf16]: 512 + 16 + 128 = 656 B.
        return (latent + 4 * (latent // 128) + 2 * rope,), torch.uint8
    return (latent + rope,), dtype


def _mla(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
    if o.spec_tokens:
        layers += c.integer("num_nextn_predict_layers", lo=0, hi=MAX_LAYERS, default=0)
    block = _block(o, 64)
    row, dtype = _mla_row(c, o, _model_dtype(c, o))
    page = [EntryField("kv", layers, (block, *row), dtype)]
    return _model(name, "mla", o, block, page, [], attention=layers, state_layers=0, align=64)
