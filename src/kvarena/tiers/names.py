"""What a tier calls an object: its kind and its key, as one short string.

A name is the whole of what a lookup asks of a tier (a book of names in
memory, a file in a directory, a key in a shared store), so it is made on
every lookup's and every put's path: the kind's prefix (``kv`` for a KV
block, ``st`` for a state's image) and the key in hex. The key embeds the
namespace, so two models' objects never share a name; the image's header
(:mod:`.image`) says the same again, and a load checks it.
"""

from __future__ import annotations

import enum

from ..errors import InvalidValueError


class ImageKind(enum.IntEnum):
    KV_BLOCK = 1  # one KV block's field bytes (every paged layer of it)
    STATE = 2  # one checkpoint image: a state's checkpoint ranges, in order

    @property
    def prefix(self) -> str:
        return "kv" if self is ImageKind.KV_BLOCK else "st"


def object_name(kind: ImageKind, key: bytes) -> str:
    """A tier's name for an object: its kind and its key (which embeds the namespace)."""
    return _NAME_PREFIX[kind] + key.hex()


_NAME_PREFIX = {kind: f"{kind.prefix}-" for kind in ImageKind}
"""Each kind's name prefix, computed once: naming is on every put's path."""


def parse_object_name(name: str) -> tuple[ImageKind, bytes]:
    """The kind and key an :func:`object_name` was made of."""
    prefix, _, digits = name.partition("-")
    kind = _KIND_OF_PREFIX.get(prefix)
    if kind is not None and digits:
        try:
            return kind, bytes.fromhex(digits)
        except ValueError:
            pass
    raise InvalidValueError(f"{name!r} is no object name (kv-HEX or st-HEX)")


_KIND_OF_PREFIX = {kind.prefix: kind for kind in ImageKind}
"""Each name prefix's kind: a lookup parses a name per block it has not met."""
