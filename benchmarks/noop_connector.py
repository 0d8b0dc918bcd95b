"""A vLLM KV connector that does nothing: the floor any connector pays.

vLLM does more once a connector is configured, whatever the connector does:
its metadata built and bound every step, its output carried back to the
scheduler, and on vLLM's CPU platform one more core reserved per rank for the
connector (on a machine without it to spare, none, so the worker's threads
share the engine core's). A benchmark that compares kvarena's connector with vLLM alone mixes that cost
with kvarena's own; next to this connector, the difference is kvarena's.
It finds nothing, loads nothing and saves nothing.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NoopConnector(KVConnectorBase_V1, SupportsHMA):
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request: Any, block_ids: Any):
        return False, None


def noop_transfer_config() -> Any:
    """The ``KVTransferConfig`` that turns :class:`NoopConnector` on."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="NoopConnector",
        kv_connector_module_path="noop_connector",
        kv_role="kv_both",
    )
