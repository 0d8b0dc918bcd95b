"""kvarena under Hugging Face transformers: a model generates with its cache in a pool.

``transformers`` is an optional extra (``pip install kvarena[hf]``); this
module imports it, ``import kvarena`` never does::

    pool = KvarenaPool.from_config(model.config, budget_bytes=1 << 30, dtype=model.dtype)
    cache = pool.new_cache(batch_size=2)
    out = model.generate(**inputs, cache=cache, max_new_tokens=32)
    pool.release(cache)

Supported: every model whose layers are full attention, sliding/chunked
attention, or the linear-attention families of :data:`LINEAR_FAMILIES`
(Qwen3-Next, Mamba2, Nemotron-H, Kimi-Linear), through transformers'
standard cache API.
"""

from __future__ import annotations

try:
    import transformers as _transformers
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "kvarena.integrations.transformers needs transformers: pip install 'kvarena[hf]'"
    ) from exc

from .cache import KvarenaCache
from .layout import LINEAR_FAMILIES, HfLayout, hf_layout
from .pool import KvarenaPool

SUPPORTED_TRANSFORMERS = (">=5.24", "<6")
"""The transformers versions the integration is tested with."""

__all__ = [
    "LINEAR_FAMILIES",
    "SUPPORTED_TRANSFORMERS",
    "HfLayout",
    "KvarenaCache",
    "KvarenaPool",
    "hf_layout",
]

del _transformers
