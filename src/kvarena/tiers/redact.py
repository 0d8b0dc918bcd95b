"""A store's address as kvarena shows it: the password out.

An operator names a shared store by a URL that may hold its password
(``redis://:PASSWORD@HOST:PORT``, as redis-py and ``redis-cli -u`` take it).
The tier opens the store with the URL as given; everything kvarena writes for
people — warnings, errors, ``kvarena tiers`` and ``kvarena replay`` output —
names the store by :func:`redacted`.
"""

from __future__ import annotations

import urllib.parse


def redacted(text: str) -> str:
    """``text`` as kvarena shows it: a store URL's password — after the user in
    its authority (``redis://:PASSWORD@HOST``, ``rediss://USER:PASSWORD@HOST``)
    or as a ``password=`` query argument, both of which redis-py reads — as
    ``***``; any other text as it is. Warnings, errors, summaries and the CLI
    name a store by this: an operator's logs never carry the secret."""
    if "://" not in text:
        return text
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:
        return "<a URL that does not parse>"
    out = text
    user, at, host = parts.netloc.rpartition("@")
    if at and ":" in user:
        out = out.replace(parts.netloc, f"{user.partition(':')[0]}:***@{host}", 1)
    pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    if any(k.lower() == "password" for k, _ in pairs):
        query = "&".join(f"{k}={'***' if k.lower() == 'password' else v}" for k, v in pairs)
        out = out.replace("?" + parts.query, "?" + query, 1)
    return out
