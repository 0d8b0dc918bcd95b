"""Prefix keys: hash-chained over the token ids of each full block, inside a namespace.

A block's key is ``H(parent key, the block's token ids, extra keys)``; the root
parent is the namespace's digest, which covers the model, both layout
fingerprints, the dtypes, the block size and the tensor-parallel rank and size.
So a key names one exact token prefix of one exact cache layout: keys of
different models, layouts, dtypes, block sizes or ranks never match, and a
block's key matches only if every block before it does too.

BLAKE2b (16-byte digests, in the standard library) is a keyed-quality hash at
a few hundred nanoseconds per block.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import check_count
from ..errors import InvalidValueError
from ..tiers.image import KEY_BYTES


@dataclass(frozen=True, kw_only=True)
class Namespace:
    """Everything two caches must share for one's blocks to be the other's."""

    model: str
    page_fingerprint: str | None
    state_fingerprint: str | None
    dtypes: tuple[str, ...]
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        check_count(self.block_size, "Namespace: block_size", lo=1)
        check_count(self.tp_size, "Namespace: tp_size", lo=1)
        check_count(self.tp_rank, "Namespace: tp_rank", hi=self.tp_size - 1)

    def to_json(self) -> bytes:
        """The namespace as canonical JSON: hashed into the key root, and written
        verbatim into every tier image's header (one source for both)."""
        return json.dumps(
            {
                "format": "kvarena-prefix/1",
                "model": self.model,
                "page": self.page_fingerprint,
                "state": self.state_fingerprint,
                "dtypes": list(self.dtypes),
                "block_size": self.block_size,
                "tp": [self.tp_rank, self.tp_size],
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @property
    def digest(self) -> bytes:
        """The root of every key chain in this namespace."""
        return key_root(self.to_json())


def key_root(namespace: bytes) -> bytes:
    """The root of every key chain in the namespace whose canonical bytes are
    ``namespace`` (a :class:`Namespace`'s JSON, an engine's namespace)."""
    return hashlib.blake2b(namespace, digest_size=KEY_BYTES).digest()


def as_tokens(tokens: object, what: str = "tokens") -> np.ndarray:
    """Token ids as a 1-D int64 array (ints, an integer array or an integer tensor
    on any device that holds values: a ``meta`` tensor has none to key)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidValueError(f"{what} must be integer token ids, got {tokens.dtype}")
        if tokens.device.type == "meta":
            raise InvalidValueError(
                f"{what} is a tensor on the meta device, which holds no values; pass the ids"
            )
        arr = tokens.detach().cpu().numpy()
    else:
        arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidValueError(
            f"{what} must be a 1-D sequence of integer token ids, got {arr.dtype} of shape "
            f"{list(arr.shape)}"
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 62):
        raise InvalidValueError(f"{what}: token ids must lie in 0..2**62-1")
    return arr.astype(np.int64, copy=False)


MAX_EXTRA_DEPTH = 8
"""Nesting of extra keys beyond this is refused (a LoRA name or an image hash is flat)."""


def _check_depth(value: object) -> None:
    """Refuse nesting deeper than :data:`MAX_EXTRA_DEPTH`, without recursion."""
    todo = [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, (list, tuple, dict)):
            if depth > MAX_EXTRA_DEPTH:
                raise InvalidValueError(
                    f"extra keys nest deeper than {MAX_EXTRA_DEPTH} levels; keys are flat values "
                    "(LoRA names, multimodal hashes)"
                )
            items = v.values() if isinstance(v, dict) else v
            todo.extend((x, depth + 1) for x in items)


def extra_bytes(extra: Sequence[object]) -> bytes:
    """What a key hashes of its extra keys (a LoRA's name, a cache salt, multimodal
    hashes): canonical JSON, nothing where there are none."""
    if isinstance(extra, (str, bytes, bytearray)) or not isinstance(extra, (list, tuple)):
        # A string is a sequence of its characters: "lora-ab" would key as
        # ["l", "o", ...]; say which sequence was meant.
        raise InvalidValueError(
            f"extra must be a list or tuple of keys, got {type(extra).__name__} {extra!r}"
            + (f"; pass ({extra!r},) for one key" if isinstance(extra, str) else "")
        )
    if not extra:
        return b""
    _check_depth(extra)
    try:
        return json.dumps(
            list(extra), sort_keys=True, separators=(",", ":"), allow_nan=False
        ).encode()
    except (TypeError, ValueError):
        raise InvalidValueError(
            f"extra keys must be JSON values (LoRA names, multimodal hashes...), got {extra!r}"
        ) from None


def tail_key(
    parent: bytes, tokens: np.ndarray, block_size: int, extra: Sequence[object] = ()
) -> bytes:
    """The key of a PARTIAL block: the ``tokens`` (fewer than ``block_size``) that
    follow the full blocks whose last key is ``parent``. Hashed under a person of
    its own and with its token count, so a tail's key is never a full block's,
    nor a shorter or longer tail's of the same tokens."""
    n = int(tokens.size)
    if not 0 < n < block_size:
        raise InvalidValueError(
            f"a partial block holds 1..{block_size - 1} tokens (block size {block_size}), got {n}"
        )
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"kvarena-tail")
    h.update(n.to_bytes(4, "little"))
    h.update(tokens.astype(np.int64, copy=False).tobytes())
    h.update(extra_bytes(extra))
    return h.digest()


def block_keys(
    root: bytes, tokens: object, block_size: int, extra: Sequence[object] = ()
) -> list[bytes]:
    """The chained key of every FULL block of ``tokens`` (a partial tail has none):
    token ids of any integer type (:func:`as_tokens`), hashed as int64, so an
    ``int32`` array or a list keys as the engine's ids do."""
    ids = as_tokens(tokens)
    block_size = check_count(block_size, "block_keys: block_size (tokens)", lo=1)
    n = ids.size // block_size
    return chained_keys(root, ids[: n * block_size].tobytes(), block_size, extra_bytes(extra))


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as the bytes a key hashes (int64, in the machine's order: what
    an int64 array's ``tobytes`` gives), packed from a list without an array
    (a scheduler keys a few blocks at a time)."""
    return struct.pack(f"={len(tokens)}q", *tokens)


def chained_keys(parent: bytes, data: bytes, block_size: int, salt: bytes) -> list[bytes]:
    """:func:`block_keys` from ``parent`` (the root, or the key of the block
    before) over ``data``, whole blocks' :func:`token_bytes`, with ``salt``
    (:func:`extra_bytes`, made once per request)."""
    step = block_size * 8
    keys = []
    blake2b = hashlib.blake2b
    for start in range(0, len(data) - step + 1, step):
        # one message: H(parent, tokens, salt) as fed piece by piece
        parent = blake2b(parent + data[start : start + step] + salt, digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys
