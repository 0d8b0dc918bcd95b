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

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..checks import check_count
from ..errors import InvalidValueError
from ..layout import EntryField, entry_bytes_for
from ..layout.fields import check_fields
from .config import MAX_LAYERS, ConfigError, ConfigReader, UnknownModelError

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

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
MAX_TP = 1 << 16
"""Tensor-parallel sizes beyond this are refused as nonsense."""
MAX_SPEC_TOKENS = 1 << 10
"""Speculative tokens (rollback copies per request) beyond this are refused."""
MAX_BLOCK_SIZE = 1 << 20
"""Tokens per block beyond this are refused (no kernel pages a million tokens)."""

KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_ds_mla")
STATE_DTYPES = ("auto", "bfloat16", "float16", "float32")
MODEL_DTYPES = STATE_DTYPES
NO_DTYPE_NOTE = (
    "the config names no dtype (a config built in code): float32 assumed, the dtype "
    "transformers builds such a model in; pass ServingOptions(dtype=...) to choose"
)


@dataclass(frozen=True, kw_only=True)
class ServingOptions:
    """How the model is served. ``block_size=None`` takes the family default
    (16 tokens; 64 for MLA, FlashMLA's alignment; 256 for DeepSeek-V4).
    ``dtype`` is the dtype the model computes in (``"auto"``: the config's
    ``torch_dtype``/``dtype``; float32, with a note, when it names none)."""

    tp: int = 1
    dtype: str = "auto"
    kv_dtype: str = "auto"
    state_dtype: str = "auto"
    block_size: int | None = None
    spec_tokens: int = 0

    def __post_init__(self) -> None:
        check_count(self.tp, "tp", lo=1, hi=MAX_TP)
        check_count(self.spec_tokens, "spec_tokens", hi=MAX_SPEC_TOKENS)
        if self.block_size is not None:
            check_count(self.block_size, "block_size", lo=1, hi=MAX_BLOCK_SIZE)
        if self.dtype not in MODEL_DTYPES:
            raise InvalidValueError(
                f"dtype {self.dtype!r} unknown; legal: {', '.join(MODEL_DTYPES)}"
            )
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidValueError(
                f"kv_dtype {self.kv_dtype!r} unknown; legal: {', '.join(KV_DTYPES)}"
            )
        if self.state_dtype not in STATE_DTYPES:
            raise InvalidValueError(
                f"state_dtype {self.state_dtype!r} unknown; legal: {', '.join(STATE_DTYPES)}"
            )


@dataclass(frozen=True, kw_only=True)
class ModelCache:
    """The cache of one model under given serving options: what a plan is made from.

    ``attention_layers`` counts the paged layers; ``state_layers`` the layers
    holding any per-request state (a recurrent state, a conv state, a
    sliding-window ring, a compressor ring); ``recurrent_layers`` those whose
    state is a recurrent (SSM / linear-attention) state, which vLLM pages as
    one "mamba page" of ``state_bytes_per_layer`` bytes each.
    ``kernel_block_align`` is the attention kernel's block-size multiple (16,
    or 64 for MLA).
    """

    name: str
    family: str
    options: ServingOptions
    page_fields: tuple[EntryField, ...]
    state_fields: tuple[EntryField, ...]
    attention_layers: int
    state_layers: int
    recurrent_layers: int = 0
    state_bytes_per_layer: int = 0
    kernel_block_align: int = 16
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.options, ServingOptions):
            raise InvalidValueError(
                f"ModelCache options must be ServingOptions, got {type(self.options).__name__}"
            )
        if self.options.block_size is None:
            raise InvalidValueError("ModelCache options must name the block size it was built for")
        for what in ("page_fields", "state_fields"):
            fields = tuple(check_fields(getattr(self, what), f"ModelCache {what}"))
            # A pool whose fields hold no bytes (a Gemma-3 with no local layers)
            # is no pool: it would be entries of size zero.
            object.__setattr__(self, what, fields if entry_bytes_for(fields) else ())
        if not self.page_fields and not self.state_fields:
            raise InvalidValueError(
                f"ModelCache {self.name!r}: no PAGE or STATE field holds a byte; a cache needs one"
            )
        for what in ("attention_layers", "state_layers", "recurrent_layers"):
            check_count(getattr(self, what), f"ModelCache {what}")

    @classmethod
    def from_fields(
        cls,
        page_fields: Sequence[EntryField],
        state_fields: Sequence[EntryField],
        *,
        block_size: int,
        entries_per_req: int = 1,
        name: str = "custom",
    ) -> ModelCache:
        """A hand-written layout: PAGE fields of one block of ``block_size`` tokens,
        STATE fields of one request's state, ``entries_per_req`` state entries per
        request (1 + speculative rollback copies)."""
        page = tuple(check_fields(page_fields, "ModelCache.from_fields: page_fields"))
        state = tuple(check_fields(state_fields, "ModelCache.from_fields: state_fields"))
        epr = check_count(entries_per_req, "entries_per_req", lo=1, hi=MAX_SPEC_TOKENS + 1)
        if not isinstance(name, str) or not name:
            raise InvalidValueError(f"ModelCache name must be a non-empty str, got {name!r}")
        return cls(
            name=name,
            family="custom",
            options=ServingOptions(block_size=block_size, spec_tokens=epr - 1),
            page_fields=page,
            state_fields=state,
            attention_layers=max((f.layers for f in page), default=0),
            state_layers=max((f.layers for f in state), default=0),
        )

    @property
    def block_size(self) -> int:
        """Tokens per PAGE block (the serving option, or the family default)."""
        return self.options.block_size or 0

    @property
    def entries_per_req(self) -> int:
        return 1 + self.options.spec_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """Paged bytes one token adds, over every paged layer."""
        return sum(f.bytes_per_entry for f in self.page_fields) // self.block_size

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return self.kv_bytes_per_token // self.attention_layers if self.attention_layers else 0

    @property
    def state_bytes(self) -> int:
        """One request state's field bytes (one entry; rollback copies not counted)."""
        return sum(f.bytes_per_entry for f in self.state_fields)

    @property
    def is_hybrid(self) -> bool:
        """Paged attention layers beside recurrent-state layers (vLLM's hybrid case)."""
        return self.attention_layers > 0 and self.recurrent_layers > 0


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
    return _kv_fields(layers, block, heads, _head_dim(c), _kv_dtype(o, model))


def _per_layer(fields: list[EntryField]) -> int:
    return sum(f.bytes_per_layer for f in fields)


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
    intermediate = heads * head_dim
    conv_dim = _split(intermediate + 2 * groups * state, tp, "mamba conv dim")
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


def _head_dim(c: ConfigReader) -> int:
    """``head_dim`` when the config names it, else hidden size over attention heads."""
    if c.has("head_dim"):
        return c.integer("head_dim")
    hidden, heads = c.integer("hidden_size"), c.integer("num_attention_heads")
    if hidden % heads:
        raise ConfigError(
            f"{c.where}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        )
    return hidden // heads


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
    page = _kv_fields(layers, block, heads, _head_dim(c), kv)
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
        head_dim = _head_dim(t)
        block = _block(o, 16)
        kv = _kv_dtype(o, _model_dtype(root, o))
        page = _kv_fields(full, block, heads, head_dim, kv)
        notes: tuple[str, ...] = ()
        state: list[EntryField] = []
        if rings:
            window = t.integer(local.window)
            state = [
                EntryField("k_window", rings, (window, heads, head_dim), kv),
                EntryField("v_window", rings, (window, heads, head_dim), kv),
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
        _head_dim(c),
        _kv_dtype(o, model),
    )
    nk, nv = c.integer("linear_num_key_heads"), c.integer("linear_num_value_heads")
    dk, dv = c.integer("linear_key_head_dim"), c.integer("linear_value_head_dim")
    conv_dim = _split(2 * nk * dk + nv * dv, o.tp, "GDN conv dim")
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


def _ssm_dtype(c: ConfigReader, o: ServingOptions, model: torch.dtype) -> torch.dtype:
    """Mamba's SSM state: the serving option, else the config's
    ``mamba_ssm_cache_dtype`` (vLLM honours it too), else the model dtype."""
    if o.state_dtype == "auto" and c.has("mamba_ssm_cache_dtype"):
        name = _dtype_name(c, "mamba_ssm_cache_dtype")
        if name != "auto":
            return _DTYPES[name]
    return _state_dtype(o, model)


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


def _kimi_layers(c: ConfigReader) -> tuple[int, int, int, int, int]:
    """(MLA layers, KDA layers, KDA heads, head dim, conv kernel) from
    ``linear_attn_config`` (the original config) or transformers 5's flat fields."""
    lin = c.sub("linear_attn_config", optional=True)
    if lin is not None:
        mla = len(lin.int_list("full_attn_layers", lo=1, hi=MAX_LAYERS))
        kda = len(lin.int_list("kda_layers", lo=1, hi=MAX_LAYERS))
        return (
            mla,
            kda,
            lin.integer("num_heads"),
            lin.integer("head_dim"),
            lin.integer("short_conv_kernel_size", lo=2),
        )
    if not c.has("layer_types"):
        raise ConfigError(
            f"{c.where}: the config lacks the field 'linear_attn_config' (or 'layer_types')"
        )
    kinds = c.layer_kinds(None, _LINEAR_KINDS)
    mla = kinds.count("full_attention")
    return (
        mla,
        len(kinds) - mla,
        c.integer("linear_num_heads"),
        c.integer("linear_head_dim"),
        c.integer("linear_conv_kernel_dim", lo=2),
    )


def _kimi_linear(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    mla, kda, heads, head_dim, kernel = _kimi_layers(c)
    model = _model_dtype(c, o)
    block = _block(o, 64)
    row, dtype = _mla_row(c, o, model)
    page = [EntryField("kv", mla, (block, *row), dtype)]
    state = [
        # Short convolutions over q, k and v: three heads x head_dim channels each.
        EntryField(
            "conv_state",
            kda,
            (kernel - 1, _split(3 * heads * head_dim, o.tp, "KDA conv dim")),
            model,
        ),
        EntryField(
            "recurrent_state",
            kda,
            (_split(heads, o.tp, "KDA heads"), head_dim, head_dim),
            _state_dtype(o, torch.float32),
        ),
    ]
    return _model(
        name,
        "kimi_linear",
        o,
        block,
        page,
        state,
        attention=mla,
        state_layers=kda,
        recurrent=kda,
        align=64,
    )


def _deepseek_v4(name: str, c: ConfigReader, o: ServingOptions) -> ModelCache:
    layers = c.integer("num_hidden_layers", hi=MAX_LAYERS)
    # One ratio per layer (0: sliding window only, 4: CSA, 128: HCA), and the
    # release's list also covers its multi-token-prediction layers after them.
    nextn = c.integer("num_nextn_predict_layers", lo=0, hi=MAX_LAYERS, default=0)
    listed = c.int_list("compress_ratios", lo=0, hi=128, max_len=layers + nextn)
    if len(listed) < layers:
        raise ConfigError(
            f"{c.where}: compress_ratios names {len(listed)} layers but num_hidden_layers is "
            f"{layers}; one ratio per layer (0, 4 or 128)"
        )
    ratios = listed[:layers]
    odd = sorted({r for r in ratios if r not in (0, 4, 128)})
    if odd:
        raise ConfigError(
            f"{c.where}: compress_ratios holds {odd}; DeepSeek-V4 layers compress by 0, 4 or 128"
        )
    csa, hca = ratios.count(4), ratios.count(128)
    block = _block(o, 256)
    if block % 128:
        raise InvalidValueError(
            f"DeepSeek-V4 blocks must be a multiple of 128 tokens (one HCA row), got {block}"
        )
    head_dim, k = c.integer("head_dim", lo=65), o.spec_tokens
    index_dim = c.integer("index_head_dim")
    model = _model_dtype(c, o)
    if o.kv_dtype in ("fp8", "fp8_ds_mla"):
        # 448 fp8 NoPE + 64 bf16 RoPE + 8 B of UE8M0 scales: 584 B per compressed row.
        row, kv = (head_dim - 64 + 64 * 2 + 8,), torch.uint8
    else:
        row, kv = (head_dim,), _kv_dtype(o, model)
    page = [
        EntryField("csa_kv", csa, (block // 4, *row), kv),
        # Indexer keys: 128 fp8 values + one fp32 scale per compressed row.
        EntryField("csa_indexer_k", csa, (block // 4, index_dim + 4), torch.uint8),
        EntryField("hca_kv", hca, (block // 128, *row), kv),
    ]
    f32, ninf = torch.float32, -math.inf
    window = c.integer("sliding_window") + k
    state = [
        # Compressor rings: coff * ratio rows (coff 2 for the overlapping ratio-4
        # CSA, 1 for HCA), each row kv + score of 2 * coff * head_dim / 2 fp32.
        EntryField("csa_kv_state", csa, (8 + k, 2 * head_dim), f32),
        EntryField("csa_score_state", csa, (8 + k, 2 * head_dim), f32, fill=ninf),
        EntryField("csa_indexer_kv_state", csa, (8 + k, 2 * index_dim), f32),
        EntryField("csa_indexer_score_state", csa, (8 + k, 2 * index_dim), f32, fill=ninf),
        EntryField("swa_window", layers, (window, *row), kv),
        EntryField("hca_kv_state", hca, (128 + k, head_dim), f32, in_checkpoint=False),
        EntryField(
            "hca_score_state", hca, (128 + k, head_dim), f32, fill=ninf, in_checkpoint=False
        ),
    ]
    notes = ("HCA compressor rings are rebuilt from the compressed KV, so checkpoints skip them",)
    # Every layer keeps a sliding-window ring; the CSA and HCA layers also page.
    return _model(
        name,
        "deepseek_v4",
        o,
        block,
        page,
        state,
        attention=csa + hca,
        state_layers=layers,
        align=64,
        notes=notes,
    )


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
