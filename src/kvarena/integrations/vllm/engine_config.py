"""The one call that turns the connector on: vLLM's ``KVTransferConfig`` for it.

The settings are checked here, before an engine is built, with the same
refusals the engine would give at start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.config import KVTransferConfig

from .settings import ConnectorSettings, check_failure_policy


def kv_transfer_config(
    tiers: Sequence[str],
    *,
    role: str = "kv_both",
    load_failure_policy: str = "recompute",
    **extra: Any,
) -> KVTransferConfig:
    """``KVTransferConfig`` for :class:`~kvarena.integrations.vllm.KvarenaConnector`
    over ``tiers`` (``host:SIZE``, ``disk:DIR:SIZE``, ``redis://HOST:PORT``...;
    none for a prefill or decode engine alone) in ``role`` (vLLM's ``kv_role``:
    ``kv_both``, ``kv_producer``, ``kv_consumer``); ``extra`` holds the other
    ``kv_connector_extra_config`` keys (``namespace``, ``pd_port``...). A failed
    load is recomputed (the only policy the connector takes:
    :func:`~.settings.check_failure_policy`)."""
    config = {"tiers": list(tiers), **extra}
    ConnectorSettings.parse(config, role=role)
    check_failure_policy(load_failure_policy)
    return KVTransferConfig(
        kv_connector="KvarenaConnector",
        kv_connector_module_path="kvarena.integrations.vllm",
        kv_role=role,
        kv_load_failure_policy=load_failure_policy,
        kv_connector_extra_config=config,
    )
