"""The serving options and a model's cache declarations (`ModelCache`): the records every preset returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..checks import check_count
from ..errors import InvalidValueError
from ..layout import EntryField, entry_bytes_for
from ..layout.fields import check_fields

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
