"""kvarena serves vLLM: ``KvarenaConnector``, a KV connector for hybrid models
(the ``[vllm]`` extra). See README "Serving with vLLM"."""

from .connector import KvarenaConnector
from .engine_config import kv_transfer_config
from .plugin import register
from .settings import ConnectorConfigError, ConnectorSettings

register()  # the connector known by name wherever this package is imported

__all__ = ["ConnectorConfigError", "ConnectorSettings", "KvarenaConnector", "kv_transfer_config"]
