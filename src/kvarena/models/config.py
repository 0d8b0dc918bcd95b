"""Reading a Hugging Face ``config.json``: every field checked for type and range.

A preset reads a config through :class:`ConfigReader`, never with ``dict.get``
and ``or``: a field that is absent (or ``null``) may take a documented
default, but a field that is present and nonsense (``head_dim: 0``, a
negative interval, ``"8"`` where a count belongs) is refused with the field's
name, the config's name and the legal range. Explicit nonsense is never
replaced by a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import InvalidValueError

MAX_LAYERS = 100_000
"""Layer counts above this are refused before any per-layer loop walks them."""
MAX_DIM = 1 << 24
"""Heads, head dims, hidden sizes, windows and kernels above this are refused."""

_MISSING = object()


class UnknownModelError(InvalidValueError):
    """A model kvarena cannot read: no such preset or file, not a JSON object,
    or a family it has no preset for."""


class ConfigError(UnknownModelError):
    """A config field that is missing, of the wrong type, or out of range."""


class ConfigReader:
    """Typed, range-checked access to one (possibly nested) config mapping."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: a config must be a JSON object, got {type(data).__name__}")
        self.data = data
        self.where = where

    def has(self, key: str) -> bool:
        """True when ``key`` is present and not null."""
        return self.data.get(key) is not None

    def _raw(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise ConfigError(f"{self.where}: the config lacks the field {key!r}")
            return default
        return value

    def integer(self, key: str, *, lo: int = 1, hi: int = MAX_DIM, default: Any = _MISSING) -> int:
        """An integer field in ``[lo, hi]``; absent or null takes ``default``."""
        value = self._raw(key, default)
        if value is default and default is not _MISSING:
            return value
        # transformers writes counts and sizes as JSON integers; 32.0 is a config
        # that went through something else (a float field, a hand edit) and is
        # refused like 32.5, so no count is ever taken from a float.
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(
                f"{self.where}: field {key!r} must be an integer in {lo}..{hi}, got {value!r}"
            )
        if not lo <= value <= hi:
            raise ConfigError(
                f"{self.where}: field {key!r} must be an integer in {lo}..{hi}, got {value}"
            )
        return value

    def first_int(
        self, keys: tuple[str, ...], *, lo: int = 1, hi: int = MAX_DIM, default: Any = _MISSING
    ) -> int:
        """The first of ``keys`` that is present (configs name one thing several ways)."""
        for key in keys:
            if self.has(key):
                return self.integer(key, lo=lo, hi=hi)
        if default is _MISSING:
            raise ConfigError(
                f"{self.where}: the config lacks the field {keys[0]!r} (or {', '.join(map(repr, keys[1:]))})"
            )
        return default

    def flag(self, key: str, *, default: bool = False) -> bool:
        """A true/false field; absent or null takes ``default``."""
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: field {key!r} must be true or false, got {value!r}")
        return value

    def string(self, key: str, *, default: Any = _MISSING) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"{self.where}: field {key!r} must be a string, got {value!r}")
        return value

    def int_list(
        self, key: str, *, lo: int = 0, hi: int = MAX_DIM, max_len: int = MAX_LAYERS
    ) -> list[int]:
        value = self._raw(key, _MISSING)
        if not isinstance(value, list) or len(value) > max_len:
            raise ConfigError(
                f"{self.where}: field {key!r} must be a list of at most {max_len} integers, "
                f"got {type(value).__name__}"
            )
        out = []
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(
                    f"{self.where}: field {key!r}[{i}] must be an integer in {lo}..{hi}, got {v!r}"
                )
            out.append(v)
        return out

    def str_list(self, key: str, *, max_len: int = MAX_LAYERS) -> list[str]:
        value = self._raw(key, _MISSING)
        if not isinstance(value, list) or len(value) > max_len:
            raise ConfigError(
                f"{self.where}: field {key!r} must be a list of at most {max_len} strings, "
                f"got {type(value).__name__}"
            )
        for i, v in enumerate(value):
            if not isinstance(v, str):
                raise ConfigError(f"{self.where}: field {key!r}[{i}] must be a string, got {v!r}")
        return list(value)

    def _one_per_layer(self, key: str, named: int, layers: int) -> None:
        if named != layers:
            raise ConfigError(
                f"{self.where}: {key} names {named} layers but num_hidden_layers is {layers}"
            )

    def layer_kinds(self, layers: int | None, legal: tuple[str, ...] | None = None) -> list[str]:
        """``layer_types``: one kind per layer, as many as ``layers`` when given,
        each one of ``legal`` when given."""
        kinds = self.str_list("layer_types")
        if layers is not None:
            self._one_per_layer("layer_types", len(kinds), layers)
        unknown = sorted(set(kinds) - set(legal)) if legal is not None else []
        if unknown:
            raise ConfigError(
                f"{self.where}: layer_types holds {unknown}; legal: {', '.join(map(repr, legal or ()))}"
            )
        return kinds

    def layer_flags(self, key: str, layers: int) -> list[int]:
        """A 0/1 per layer (Llama 4's ``no_rope_layers``); an empty list names
        no layer (transformers then derives them from an interval)."""
        flags = self.int_list(key, lo=0, hi=1, max_len=layers)
        if flags:
            self._one_per_layer(key, len(flags), layers)
        return flags

    def layer_indices(self, key: str, layers: int) -> list[int]:
        """Distinct 0-based layer indices below ``layers`` (Bamba's
        ``attn_layer_indices``, LFM2's ``full_attn_idxs``)."""
        indices = self.int_list(key, lo=0, hi=layers - 1, max_len=layers)
        if len(set(indices)) != len(indices):
            raise ConfigError(f"{self.where}: {key} names a layer twice: {indices}")
        return indices

    def sub(self, key: str, *, optional: bool = False) -> ConfigReader | None:
        """A nested object (``text_config``, ``ssm_cfg``...); None when optional and absent."""
        value = self.data.get(key)
        if value is None:
            if optional:
                return None
            raise ConfigError(f"{self.where}: the config lacks the field {key!r}")
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{self.where}: field {key!r} must be a JSON object, got {type(value).__name__}"
            )
        return ConfigReader(value, f"{self.where}.{key}")
