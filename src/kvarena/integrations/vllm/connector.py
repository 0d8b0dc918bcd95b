"""``KvarenaConnector``: vLLM's KV connector API over kvarena's tiers.

Turned on by configuration alone::

    KVTransferConfig(kv_connector="KvarenaConnector",
                     kv_connector_module_path="kvarena.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"tiers": ["host:4GiB", "disk:/var/kv:200GiB"]})

vLLM builds one instance in its scheduler and one in each worker; this class
only checks the configuration at engine start and hands each call to its
role's half (:mod:`.scheduler_side`, :mod:`.worker_side`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import Error
from ...tiers import TierStack
from ...tiers.frames import DEFAULT_FRAME_BYTES, MIN_FRAME_BYTES
from ...tiers.image import object_bytes
from ...tiers.stack import tier_labels
from .catalogue import Catalogue
from .events import TierEvents
from .groups import Group, blocks_fail_alone, classify, namespace_json
from .joins import Joins
from .key_memo import engine_memo, hash_block_size
from .metrics import KvarenaPromMetrics, KvarenaStats
from .pd_channel import Hello
from .pd_scheduler import PdScheduler
from .pd_worker import PdWorker
from .ranks import rank_tier_specs, tp_rank
from .records import HelloMeta, StepPlan
from .scheduler_side import SchedulerSide
from .settings import ConnectorConfigError, ConnectorSettings, check_failure_policy
from .tensors import payload_bytes
from .worker_side import WorkerSide

_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK, "p2p": CacheHitSource.P2P}

log = logging.getLogger("vllm.kvarena")


def _identity(
    vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings, rank: int | None
):
    """The groups, the namespace (the engine's with ``rank`` None, else that
    rank's), the block size and the tensor-parallel size."""
    groups = classify(kv_cache_config)
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConnectorConfigError(
            "kvarena connector: serves pipeline_parallel_size=1 (got "
            f"{parallel.pipeline_parallel_size}); tensor parallelism is served"
        )
    model = vllm_config.model_config
    ranks = int(parallel.tensor_parallel_size)
    namespace = namespace_json(
        model=str(model.model),
        revision=model.revision,
        word=settings.namespace,
        groups=groups,
        layout=str(getattr(vllm_config.cache_config, "kv_cache_layout", "") or ""),
        tp_rank=rank,
        tp_size=ranks,
        pp_size=1,
    )
    block_size = int(groups[0].spec["block_size"])
    return groups, namespace, block_size, ranks


def _host_frame(settings: ConnectorSettings, groups: list[Group], namespace: bytes) -> int:
    """The host tier's frame: the settings' where given, else one KV block's object
    on this rank (a model with no attention layer: the tier's default)."""
    if settings.host_frame_bytes is not None:
        return settings.host_frame_bytes
    kv = [g for g in groups if g.kind == "kv"]
    if not kv:
        return DEFAULT_FRAME_BYTES
    return max(MIN_FRAME_BYTES, object_bytes(namespace, payload_bytes(kv)))


def _events(
    vllm_config: Any,
    kv_cache_config: Any,
    settings: ConnectorSettings,
    groups: list[Group],
    block_size: int,
    ranks: int,
) -> TierEvents | None:
    """The KV events book, where the engine publishes KV events (else None)."""
    config = getattr(vllm_config, "kv_events_config", None)
    if config is None or not config.enable_kv_cache_events:
        return None
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    specs = kv_cache_config.kv_cache_groups

    def kinds(kind: str) -> list[tuple[int, str]]:
        return [
            (g.index, get_kv_cache_spec_kind(specs[g.index].kv_cache_spec).value)
            for g in groups
            if g.kind == kind
        ]

    tier_kinds = [spec.kind for spec in settings.tiers]
    return TierEvents(
        tiers=list(zip(tier_labels(tier_kinds), tier_kinds, strict=True)),
        kv_groups=kinds("kv"),
        state_groups=kinds("state"),
        block_size=block_size,
        hash_block_size=hash_block_size(kv_cache_config, block_size),
        ranks=ranks,
    )


class KvarenaConnector(KVConnectorBase_V1, SupportsHMA):
    """A prefix cache below vLLM's device cache: KV blocks and recurrent states
    saved as checksummed, namespaced kvarena images in host, disk and shared
    tiers, and loaded back only where every group can resume."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        kv_role = str(self._kv_transfer_config.kv_role or "kv_both")
        settings = ConnectorSettings.parse(extra, role=kv_role)
        self._settings = settings
        self._hands_off = settings.disaggregated and kv_role != "kv_consumer"
        check_failure_policy(getattr(self._kv_transfer_config, "kv_load_failure_policy", None))
        worker = role != KVConnectorRole.SCHEDULER
        rank = tp_rank() if worker else None
        groups, namespace, block_size, ranks = _identity(
            vllm_config, kv_cache_config, settings, rank
        )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._pd: PdScheduler | None = None
        self._pd_worker: PdWorker | None = None
        self._namespace = namespace
        self._ranks = ranks
        self._num_blocks = int(kv_cache_config.num_blocks)
        self._block_errors: set[int] = set()
        self._joins = Joins()  # loads whose rest a prefill engine's read brings
        if role == KVConnectorRole.SCHEDULER:
            if getattr(vllm_config, "shutdown_timeout", None) == 0:
                log.warning(
                    "kvarena: vLLM's --shutdown-timeout is 0 (abort): a stopped server "
                    "kills its workers at once and saves still queued for the tiers are "
                    "lost (later misses); with --shutdown-timeout 30 the connector "
                    "writes them before the worker exits"
                )
            self._scheduler = SchedulerSide(
                groups=groups,
                namespace=namespace,
                catalogue=Catalogue(settings, ranks),
                block_size=block_size,
                ranks=ranks,
                events=_events(vllm_config, kv_cache_config, settings, groups, block_size, ranks),
                memo=engine_memo(vllm_config, kv_cache_config, block_size),
            )
            if settings.disaggregated:
                self._pd = PdScheduler(
                    role=kv_role,
                    groups=groups,
                    block_size=block_size,
                    ranks=ranks,
                    engine_id=str(self._kv_transfer_config.engine_id),
                    host=settings.pd_host,
                    port=settings.pd_port,
                    expiry_s=settings.pd_expiry,
                    timeout_s=settings.load_timeout,
                )
        else:
            try:
                specs = rank_tier_specs(settings.tiers, rank or 0, ranks)
                tiers = TierStack.from_specs(
                    specs, frame_bytes=_host_frame(settings, groups, namespace)
                )
            except Error as exc:
                raise ConnectorConfigError(f"kv_connector_extra_config['tiers']: {exc}") from None
            self._worker = WorkerSide(
                groups=groups,
                namespace=namespace,
                tiers=tiers,
                block_size=block_size,
                rank=rank or 0,
                ranks=ranks,
                save_backlog=settings.save_backlog,
                load_deadline_s=settings.load_timeout,
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Block-major where the settings ask for it (see ``ConnectorSettings.layout``):
        vLLM takes a connector's layout as a preference, kept where every attention
        backend lists it."""
        from vllm.platforms import current_platform

        config = vllm_config.kv_transfer_config
        settings = ConnectorSettings.parse(
            config.kv_connector_extra_config,
            role=str(getattr(config, "kv_role", None) or "kv_both"),
        )
        return settings.preferred_layout(cpu=current_platform.is_cpu())

    @property
    def requires_kv_delivery(self) -> bool:
        # a cache: a dropped save is a later miss; a prefill engine's handoff
        # is not (a request preempted before it is read is recomputed)
        return self._hands_off

    # -- worker ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._num_blocks)
        if self._settings.disaggregated:
            assert self._worker.pages is not None
            self._pd_worker = PdWorker(
                self._worker.pages,
                namespace=self._namespace,
                rank=self._worker.rank,
                ranks=self._ranks,
                timeout_s=self._settings.load_timeout,
            )

    def get_handshake_metadata(self) -> HelloMeta | None:
        """This worker's NIXL hello, served to decode engines by the scheduler's
        side channel (vLLM gathers every worker's at start)."""
        if self._pd_worker is None:
            return None
        return HelloMeta(hello=self._pd_worker.hello().to_dict())

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._pd is not None:
            self._pd.hellos({r: Hello.from_dict(m.hello) for r, m in metadata.items()})

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, StepPlan):
            self._joins.expect(job.request for job in meta.loads if job.joined)
            self._worker.load(meta)
            if self._pd_worker is not None:
                self._pd_worker.learn(meta.peers)
                self._pd_worker.offered(meta.offers)
                self._pd_worker.expired(meta.expired)
                self._pd_worker.submit(meta.pulls)
                self._pd_worker.progress()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # a load lands in a step's start_load_kv, before its forward

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None  # saves read every layer after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, StepPlan):
            self._worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Saves never hold a request's blocks (their bytes are copied out in the
        # step that wrote them); a load finishes in the step that started it.
        # A failed load is named by its blocks where vLLM takes that (one KV
        # cache group), else by its request; either way vLLM recomputes it.
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.received()
        errors = self._worker.load_errors()
        sent: set[str] = set()
        if self._pd_worker is not None:
            self._pd_worker.progress()
            sent, pulled, pull_failed, pull_errors = self._pd_worker.take()
            done, failed = self._joins.settle((done, failed), (pulled, pull_failed))
            errors |= pull_errors
        self._block_errors = errors if blocks_fail_alone(self._worker.groups) else set()
        return KVConnectorTransferResults(
            finished_sending=sent,
            finished_recving=done,
            failed_recving=failed if not self._block_errors else set(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._block_errors = self._block_errors, set()
        return errors

    def build_connector_worker_meta(self) -> Any:
        return self._worker.report() if self._worker is not None else None

    def take_events(self) -> list[Any]:
        """KV events for what the tiers stored and dropped since the last step."""
        if self._scheduler is None or self._scheduler.events is None:
            return []
        return self._scheduler.events.take()

    # -- metrics ------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvarenaStats | None:
        """The scheduler's counts since the last step (workers report theirs to
        it: counted once for the engine); None from a worker."""
        if self._scheduler is None:
            return None
        data = self._scheduler.telemetry.take()
        return KvarenaStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvarenaStats:
        return KvarenaStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvarenaPromMetrics:
        return KvarenaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._pd_worker is not None:
            self._pd_worker.close()
        if self._worker is not None:
            self._worker.close()
        if self._pd is not None:
            self._pd.close()
        if self._scheduler is not None:
            self._scheduler.catalogue.close()

    # -- scheduler ------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        assert self._scheduler is not None
        tiers = bool(self._settings.tiers)
        if self._pd is not None and self._pd.offered(request):
            first = 0  # a decode request: the tiers' whole blocks first, then the read
            if tiers:
                hit, _ = self._scheduler.matched(request, num_computed_tokens, part=True)
                if hit is None:
                    return None, False  # ask again
                first = hit
            answer = self._pd.matched(request, num_computed_tokens, first)
            if answer is not None and answer[0]:
                return answer
        if not tiers:  # a prefill or decode engine alone
            return 0, False
        return self._scheduler.matched(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        if self._pd is not None:
            self._pd.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        assert self._scheduler is not None
        ids = blocks.get_block_ids()
        first = self._pd.allocated(request, ids, num_external_tokens) if self._pd else None
        # a read request's tiers part (if any; its later blocks saved as any)
        self._scheduler.allocated(request, ids, num_external_tokens if first is None else first)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int):
        assert self._scheduler is not None
        read = self._pd.read_now(request) if self._pd is not None else 0
        found = self._scheduler.hit_sources(request, num_external_tokens - read)
        found.update({"p2p": read} if read else {})
        return {_SOURCES.get(k, CacheHitSource.EXTERNAL_UNSPECIFIED): n for k, n in found.items()}

    def build_connector_meta(self, scheduler_output: Any) -> StepPlan:
        assert self._scheduler is not None
        plan = self._scheduler.plan(scheduler_output) if self._settings.tiers else StepPlan()
        return self._pd.fill(plan) if self._pd is not None else plan

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.reported(connector_output.kv_connector_worker_meta)
            self._scheduler.loaded(set(connector_output.finished_recving or ()))
        if self._pd is not None:
            self._pd.sent(set(connector_output.finished_sending or ()))

    def request_finished(self, request: Any, block_ids: list[int]):
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        if self._scheduler is not None:
            self._scheduler.finished(request)
        if self._pd is not None:
            return self._pd.finished(request, tuple(block_ids))
        return False, None
