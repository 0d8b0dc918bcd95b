"""Where a config comes from (a preset fixture, a path, a dict) and which family reads it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from .config import UnknownModelError

PRESETS = (
    "llama-3.1-8b",
    "qwen3-8b",
    "gemma-3-27b",
    "gpt-oss-20b",
    "deepseek-v3",
    "qwen3-next-80b-a3b",
    "mamba2-2.7b",
    "nemotron-h-8b",
    "kimi-linear-48b-a3b",
    "deepseek-v4-flash",
)
"""The built-in presets: fixture configs shipped in ``kvarena/models/configs``."""


def load_config(source: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, config)`` from a built-in preset name, a ``config.json`` path or a dict.

    Whatever the file holds, the answer is a JSON object or an
    :class:`UnknownModelError` naming the file: not UTF-8, not JSON, nested
    too deeply to parse, or JSON that is not an object.
    """
    if isinstance(source, Mapping):
        name = source.get("_name_or_path") or source.get("model_type") or "config"
        return str(name), dict(source)
    if not isinstance(source, (str, Path)):
        raise UnknownModelError(
            f"a model is a preset name, a config.json path or a dict, got {type(source).__name__}"
        )
    text = str(source)
    if text in PRESETS:
        data = resources.files("kvarena.models").joinpath("configs", f"{text}.json").read_text()
        return text, json.loads(data)
    path = Path(text)
    try:
        if path.is_dir():
            path = path / "config.json"
        found = path.is_file()
    except (OSError, ValueError):
        found = False
    if not found:
        raise UnknownModelError(
            f"unknown model {text!r}: not a built-in preset ({', '.join(PRESETS)}) nor a config.json path"
        )
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UnknownModelError(
            f"{path} is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from None
    except json.JSONDecodeError as exc:
        raise UnknownModelError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise UnknownModelError(f"{path} nests too deeply to be a config") from None
    except OSError as exc:
        raise UnknownModelError(f"{path} cannot be read: {exc.strerror}") from None
    if not isinstance(config, dict):
        raise UnknownModelError(
            f"{path} holds a JSON {type(config).__name__}, not the object a config.json is"
        )
    # A Hugging Face checkout is named by its folder (``Qwen3-8B/config.json``);
    # a config saved under a name of its own (``mistral-7b.json``) by that name.
    named_by_folder = path.name == "config.json" and path.parent.name
    return (path.parent.name if named_by_folder else path.stem), config


_FAMILY_BY_TYPE = {
    "llama": "gqa",
    "mistral": "gqa",
    "qwen2": "gqa",
    "qwen3": "gqa",
    "qwen2_moe": "gqa",
    "qwen3_moe": "gqa",
    "mixtral": "gqa",
    "phi3": "gqa",
    "olmo2": "gqa",
    "granite": "gqa",
    "starcoder2": "gqa",
    "glm4_moe": "gqa",
    "glm4": "gqa",
    "smollm3": "gqa",
    "ernie4_5": "gqa",
    "ernie4_5_moe": "gqa",
    "seed_oss": "gqa",
    "gemma2": "gemma2",
    "gpt_oss": "gpt_oss",
    "cohere2": "cohere2",
    "llama4": "llama4",
    "llama4_text": "llama4",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "deepseek_v2": "mla",
    "deepseek_v3": "mla",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_next",
    "qwen3_5_text": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
    "qwen3_5_moe_text": "qwen3_next",
    "mamba2": "mamba2",
    "nemotron_h": "nemotron_h",
    "granitemoehybrid": "granitemoehybrid",
    "bamba": "bamba",
    "falcon_h1": "falcon_h1",
    "jamba": "jamba",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2",
    "kimi_linear": "kimi_linear",
    "deepseek_v4": "deepseek_v4",
}
_FAMILY_BY_ARCH = {
    "LlamaForCausalLM": "gqa",
    "MistralForCausalLM": "gqa",
    "Qwen2ForCausalLM": "gqa",
    "Qwen3ForCausalLM": "gqa",
    "Qwen2MoeForCausalLM": "gqa",
    "Qwen3MoeForCausalLM": "gqa",
    "MixtralForCausalLM": "gqa",
    "Phi3ForCausalLM": "gqa",
    "Olmo2ForCausalLM": "gqa",
    "GraniteForCausalLM": "gqa",
    "Starcoder2ForCausalLM": "gqa",
    "Glm4MoeForCausalLM": "gqa",
    "Glm4ForCausalLM": "gqa",
    "SmolLM3ForCausalLM": "gqa",
    "Ernie4_5ForCausalLM": "gqa",
    "Ernie4_5_MoeForCausalLM": "gqa",
    "SeedOssForCausalLM": "gqa",
    "Gemma2ForCausalLM": "gemma2",
    "GptOssForCausalLM": "gpt_oss",
    "Cohere2ForCausalLM": "cohere2",
    "Llama4ForCausalLM": "llama4",
    "Llama4ForConditionalGeneration": "llama4",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "DeepseekV3ForCausalLM": "mla",
    "DeepseekV2ForCausalLM": "mla",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_next",
    "Qwen3_5ForConditionalGeneration": "qwen3_next",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_next",
    "Mamba2ForCausalLM": "mamba2",
    "NemotronHForCausalLM": "nemotron_h",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "BambaForCausalLM": "bamba",
    "FalconH1ForCausalLM": "falcon_h1",
    "JambaForCausalLM": "jamba",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2",
    "KimiLinearForCausalLM": "kimi_linear",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}


def _family_of(config: Mapping[str, Any]) -> str | None:
    """The preset family a config names by ``model_type``, then ``architectures``."""
    model_type = config.get("model_type")
    family = _FAMILY_BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    archs = config.get("architectures")
    if family is None and isinstance(archs, list):
        for arch in archs:
            family = _FAMILY_BY_ARCH.get(arch) if isinstance(arch, str) else None
            if family:
                break
    ssm = config.get("ssm_cfg")
    if family is None and isinstance(ssm, Mapping) and ssm.get("layer") == "Mamba2":
        family = "mamba2"  # mamba_ssm-format configs name neither
    return family


def _resolve(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    """``(family, the config its builder reads)``.

    A multimodal checkpoint whose own type kvarena does not know (Mistral
    Small 3.1's ``mistral3``, LLaVA's ``llava``) caches only for its language
    model: the ``text_config`` of a known family is read instead, with the
    checkpoint's dtype where the text config names none (the vision tower
    keeps nothing in the cache).
    """
    if not isinstance(config, Mapping):
        raise UnknownModelError(f"a config must be a JSON object, got {type(config).__name__}")
    family = _family_of(config)
    if family is not None:
        return family, config
    text = config.get("text_config")
    family = _family_of(text) if isinstance(text, Mapping) else None
    if family is None or not isinstance(text, Mapping):
        raise UnknownModelError(
            f"unknown model family: model_type={config.get('model_type')!r}, "
            f"architectures={config.get('architectures')!r}; supported model_types: "
            f"{', '.join(sorted(_FAMILY_BY_TYPE))}"
        )
    if any(text.get(k) is not None for k in ("torch_dtype", "dtype")):
        return family, text
    dtype = {k: config[k] for k in ("torch_dtype", "dtype") if config.get(k) is not None}
    return family, {**text, **dtype}


def detect_family(config: Mapping[str, Any]) -> str:
    """The preset family from ``model_type``, then ``architectures`` (a
    multimodal checkpoint's: its ``text_config``'s)."""
    return _resolve(config)[0]


# -- helpers -------------------------------------------------------------------
