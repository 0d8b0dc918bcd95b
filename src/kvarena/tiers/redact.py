"""A store's address as kvarena shows it: the password out.

An operator names a shared store by a URL that may hold its password
(``redis://:PASSWORD@HOST:PORT``, as redis-py and ``redis-cli -u`` take it).
Or by ``${NAME}``, an environment variable that holds it (:data:`VARIABLE`),
which keeps the secret out of every config and log. The tier opens the store
with the URL as given; everything kvarena writes for people — warnings,
errors, ``kvarena tiers`` and ``kvarena replay`` output — names the store by
:func:`redacted`.
"""

from __future__ import annotations

import re
import urllib.parse

VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""``${NAME}`` in a store URL: the environment variable ``NAME``, read when the
tier opens (:meth:`~kvarena.tiers.spec.TierSpec.store_url`). Not a secret: a
password given so is shown as it is written."""


def redacted(text: str) -> str:
    """``text`` as kvarena shows it: a store URL's password — after the user in
    its authority (``redis://:PASSWORD@HOST``, ``rediss://USER:PASSWORD@HOST``)
    or as a ``password=`` query argument, both of which redis-py reads — as
    ``***``, unless it is a :data:`VARIABLE` (which names the secret, not
    it); any other text as it is. Warnings, errors, summaries and the CLI
    name a store by this: an operator's logs never carry the secret."""
    if "://" not in text:
        return text
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:
        return "<a URL that does not parse>"
    out = text
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user and not VARIABLE.fullmatch(user.partition(":")[2]):
        out = out.replace(parts.netloc, f"{user.partition(':')[0]}:***@{host}", 1)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    secret = [k.lower() == "password" and not VARIABLE.fullmatch(v) for k, v in pairs]
    if any(secret):
        query = "&".join(
            f"{k}={'***' if hidden else v}" for (k, v), hidden in zip(pairs, secret, strict=True)
        )
        out = out.replace("?" + parts.query, "?" + query, 1)
    return out
