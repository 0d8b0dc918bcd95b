"""Cache declarations derived from a Hugging Face ``config.json``.

A preset turns a model's config (a dict, a path, or a built-in name whose
fixture ships with the package; never a hub download) and the serving options
(tensor-parallel size, KV and state dtypes, block size, speculative tokens)
into kvarena declarations: the fields of one PAGE block (``block_size`` tokens
of every paged layer) and the fields of one request's STATE entry.

Shapes follow what the serving engines allocate (vLLM's shape calculators and
ATOM's DeepSeek-V4 layout), and every byte count is checked against the
published numbers in ``shared/reference/model_cache_facts.json`` by the tests.
Conventions worth knowing:

- ``kv_dtype="fp8"`` is float8_e4m3fn with per-tensor scales kept outside the
  cache (vLLM's default); ``"fp8_ds_mla"`` is the packed MLA row with its
  scales inside (656 B per token for DeepSeek-V3, 584 B per row for V4).
- ``state_dtype`` sets the recurrent / SSM state; conv states keep the model
  dtype. ``"auto"`` is the model's ``torch_dtype``, except where the family
  keeps the state in fp32 (Kimi's KDA recurrent state).
- Speculative tokens give each request ``1 + spec_tokens`` state entries
  (rollback copies); DeepSeek-V4 also widens its rings by ``spec_tokens`` rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import InvalidValueError
from .attention_families import _gqa, _Local, _mla, _windowed
from .config import ConfigReader
from .hybrid_families import _jamba, _lfm2, _mamba2, _mamba2_hybrid, _nemotron_h, _qwen3_next
from .linear_families import _deepseek_v4, _kimi_linear
from .loading import _resolve, load_config
from .options import NO_DTYPE_NOTE, ModelCache, ServingOptions
from .shapes import _config_dtype

_BUILDERS = {
    "gqa": _gqa,
    "gemma3": _windowed("gemma3", _Local(pattern_default=6)),
    "gemma2": _windowed("gemma2", _Local(pattern_default=2)),
    "gpt_oss": _windowed("gpt_oss", _Local(pattern_default=2)),
    "cohere2": _windowed("cohere2", _Local(pattern_default=4)),
    "llama4": _windowed(
        "llama4",
        _Local(
            kind="chunked_attention",
            label="chunked-attention",
            window="attention_chunk_size",
            pattern="no_rope_layer_interval",
            pattern_default=4,
            flags="no_rope_layers",
        ),
    ),
    "mla": _mla,
    "qwen3_next": _qwen3_next,
    "mamba2": _mamba2,
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _mamba2_hybrid("granitemoehybrid"),
    "bamba": _mamba2_hybrid("bamba"),
    "falcon_h1": _mamba2_hybrid("falcon_h1", parallel=True),
    "jamba": _jamba,
    "lfm2": _lfm2,
    "kimi_linear": _kimi_linear,
    "deepseek_v4": _deepseek_v4,
}


def model_cache(
    source: str | Path | Mapping[str, Any], options: ServingOptions | None = None
) -> ModelCache:
    """The cache declarations of a model: a preset name, a config path or a dict.

    Every config field a preset reads is checked for type and range; a field
    that is missing, or present and nonsense, is refused naming it.
    """
    if options is not None and not isinstance(options, ServingOptions):
        raise InvalidValueError(
            f"options must be ServingOptions(...), got {type(options).__name__}"
        )
    name, config = load_config(source)
    family, read = _resolve(config)
    opts = options or ServingOptions()
    reader = ConfigReader(read, name if read is config else f"{name}.text_config")
    model = _BUILDERS[family](name, reader, opts)
    text = reader.sub("text_config", optional=True)
    named = _config_dtype(reader) or (text is not None and _config_dtype(text))
    if opts.dtype == "auto" and not named:
        model = replace(model, notes=(*model.notes, NO_DTYPE_NOTE))
    return model
