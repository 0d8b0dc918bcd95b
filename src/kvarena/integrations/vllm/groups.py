"""vLLM's KV cache groups as the connector sees them: which hold KV blocks,
which hold recurrent states, and the fingerprint of what their bytes mean.

vLLM hands a connector its ``KVCacheConfig``: groups of layers, each with one
spec (a full-attention group's block of K and V, a Mamba group's state page).
The connector keeps two kinds of object per token prefix, as kvarena's prefix
cache does: a KV image per block (every full-attention layer's block) and a
state image per boundary (every state layer's page at exactly that boundary).
A group of any other kind (sliding window, chunked local, cross attention) is
refused at start, named: loading it by these rules would be wrong, not slow.

The namespace is derived from the specs both halves of the connector are given
(the scheduler has no tensors), so the scheduler's keys and the workers'
images agree; each worker checks its tensors against the same specs.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .settings import ConnectorConfigError

FORMAT = "kvarena-vllm/1"


@dataclass(frozen=True, kw_only=True)
class Group:
    """One KV cache group: its index in vLLM's config, kind and layers."""

    index: int
    kind: str  # "kv" (full attention) or "state" (Mamba-style)
    layers: tuple[str, ...]
    spec: dict[str, Any]  # the vLLM spec's fields, as JSON values
    block_bytes: int  # what one layer's block holds: the spec's own unpadded page size


def blocks_fail_alone(groups: Sequence[Group]) -> bool:
    """Whether vLLM takes a failed load by the ids of its failed blocks,
    truncating the request's computed tokens at the first: in a cache of one KV
    cache group alone (it maps block ids back to requests for one group); with
    more, a failed load is named by its request and recomputed whole."""
    return len(groups) == 1


def _json_value(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return str(v.value)
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json_value(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)  # torch dtypes and the like


def spec_fields(spec: Any) -> dict[str, Any]:
    """A vLLM spec (a dataclass) as JSON values, with its class name."""
    fields = {f.name: _json_value(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    fields["class"] = type(spec).__name__
    return fields


def classify(kv_cache_config: Any) -> list[Group]:
    """The groups of ``kv_cache_config``, each as KV or state; anything else refused."""
    out: list[Group] = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        name = type(g.kv_cache_spec).__name__
        if name in ("FullAttentionSpec", "MLAAttentionSpec"):
            kind = "kv"
        elif name == "MambaSpec":
            kind = "state"
        else:
            raise ConnectorConfigError(
                f"kvarena connector: KV cache group {i} ({name}, layers "
                f"{', '.join(g.layer_names[:3])}{'...' if len(g.layer_names) > 3 else ''}) is "
                "neither full attention nor a Mamba-style state; it serves FullAttentionSpec, "
                "MLAAttentionSpec and MambaSpec groups"
            )
        if name == "MambaSpec" and getattr(g.kv_cache_spec, "mamba_cache_mode", "align") != "align":
            raise ConnectorConfigError(
                f"kvarena connector: KV cache group {i} keeps Mamba states in "
                f"mamba_cache_mode={g.kv_cache_spec.mamba_cache_mode!r}; states are saved at "
                "block boundaries, which needs 'align' (vLLM's mode with prefix caching on)"
            )
        out.append(
            Group(
                index=i,
                kind=kind,
                layers=tuple(g.layer_names),
                spec=spec_fields(g.kv_cache_spec),
                block_bytes=int(g.kv_cache_spec.real_page_size_bytes),
            )
        )
    sizes = {g.spec.get("block_size") for g in out}
    if len(sizes) != 1:
        raise ConnectorConfigError(
            f"kvarena connector: KV cache groups have block sizes {sorted(map(str, sizes))}; "
            "keys and boundaries need one block size for every group"
        )
    return out


def namespace_json(
    *,
    model: str,
    revision: str | None,
    word: str,
    groups: Sequence[Group],
    layout: str,
    tp_rank: int | None,
    tp_size: int,
    pp_size: int,
) -> bytes:
    """The canonical JSON of everything two engines must share for one's saved
    bytes to be the other's: the model's identity (path or name, revision, the
    operator's word), every group's spec and layers, the tensor layout, and the
    parallel sizes; with ``tp_rank`` None, the engine's (hashed into every key's
    root), with a rank, that rank's (written into its images and checked on load)."""
    return json.dumps(
        {
            "format": FORMAT,
            "model": model,
            "revision": revision,
            "namespace": word,
            "groups": [{"kind": g.kind, "layers": list(g.layers), "spec": g.spec} for g in groups],
            "layout": layout,
            "tp": [tp_rank, tp_size],
            "pp": pp_size,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def namespace_diff(there: bytes, here: bytes) -> str:
    """Where two namespaces differ, field by field, both sides named (a group by
    its index and the spec fields that differ)."""
    a, b = json.loads(there), json.loads(here)
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        if key == "groups" and isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (g, h) in enumerate(zip(x, y, strict=True)):
                for field in sorted(set(g.get("spec", {})) | set(h.get("spec", {}))):
                    u, v = g.get("spec", {}).get(field), h.get("spec", {}).get(field)
                    if u != v:
                        out.append(f"group {i} {field}: {u!r:.60} there, {v!r:.60} here")
                if g.get("layers") != h.get("layers"):
                    out.append(f"group {i} layers differ")
        else:
            out.append(f"{key}: {x!r:.80} there, {y!r:.80} here")
    return "; ".join(out) or "(the same fields, in another encoding)"
