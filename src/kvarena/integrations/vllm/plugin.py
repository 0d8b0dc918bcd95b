"""kvarena's vLLM plugin: the connector known to vLLM by its name.

vLLM runs every installed ``vllm.general_plugins`` entry point in each of its
processes at start (the API server, the engine core, every worker), so with
kvarena installed ``--kv-transfer-config '{"kv_connector": "KvarenaConnector",
...}'`` needs no module path, and vLLM's stats loggers, which rebuild a
connector's stats from its name alone (inside a ``MultiConnector``), find
kvarena's. Registering twice is harmless: a name vLLM knows already is left
as it is.
"""

from __future__ import annotations

NAME = "KvarenaConnector"
MODULE = "kvarena.integrations.vllm.connector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(NAME, MODULE, NAME)
    except ValueError:  # registered already (this process ran the plugin, or imported us)
        pass
