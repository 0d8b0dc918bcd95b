"""What an engine's ``kv_connector_extra_config`` may say to the kvarena connector.

Read once, at engine start, by both halves of the connector (the scheduler's
and each worker's), so a bad value stops the engine before it serves a
request, with one line naming the key and what would be legal. Nothing here
imports vLLM: the settings are checked the same way in a test, a CLI or an
engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...checks import parse_bytes
from ...errors import Error
from ...tiers import SPEC_FORMS, TierSpec, TierSpecError
from ...tiers.frames import MIN_FRAME_BYTES
from ...tiers.redact import redacted

KEYS = (
    "tiers",
    "namespace",
    "host_frame_bytes",
    "layout",
    "save_backlog",
    "load_timeout",
    "pd_host",
    "pd_port",
    "pd_expiry",
    "store_feed",
)
"""Every key the connector reads; any other key is refused (a typo must not
silently turn a tier off)."""

RENAMED = {"host_unit_bytes": "host_frame_bytes"}
"""Keys an earlier release read, refused with the name that replaced them (a
renamed key silently ignored would change what the engine does)."""


ROLES = ("kv_both", "kv_producer", "kv_consumer")
"""vLLM's ``kv_role`` values the connector serves."""

LAYOUTS = ("auto", "block-major", "engine")
FEEDS = ("auto", "off")
"""``store_feed`` values: follow a shared store's announcements where its server
makes them, or never (list it)."""
BLOCK_MAJOR = "BLHNC"
"""vLLM's block-major layout: ``[blocks, layers, heads, tokens, content]``."""


class ConnectorConfigError(Error, ValueError):
    """A ``kv_connector_extra_config`` entry the connector cannot use."""


@dataclass(frozen=True, kw_only=True)
class ConnectorSettings:
    """The connector's settings, checked.

    ``tiers``: tier specs, top first, exactly as ``kvarena replay --tier``
    takes them (``host:4GiB``, ``disk:/var/kv:200GiB``, ``redis://store:6379``).
    Every save is written through to each of them, so a restarted engine finds
    on disk, and another engine finds in the shared store, what this one
    computed, without waiting for an eviction.

    ``namespace``: an operator's word added to the fingerprint of what the bytes
    mean — for two checkpoints that vLLM cannot tell apart (same path, no
    revision), or to keep two fleets apart on one store.

    ``host_frame_bytes``: the host tier's allocation frame. By default (None) one
    KV block's object on this rank, so a block takes exactly one frame and a state
    object a run of them with less than a frame to spare; a fixed 64 KiB would
    give a 256 KiB block's object (its header and namespace make it a little
    more) five frames, a fifth of them empty.

    ``layout``: the KV cache layout the connector asks vLLM for. ``auto``
    (default): the block-major ``BLHNC`` (a block of every layer of a group is
    one range: one copy per block, not one per layer) except on vLLM's CPU
    platform, whose attention backend declares ``LBHNC`` alone; ``block-major``:
    ``BLHNC`` everywhere (vLLM keeps it where every backend lists it, else
    falls back to its own choice with a warning); ``engine``: no preference.

    ``load_timeout``: the most seconds a load from the disk or a shared store may
    take off the engine's step (30 by default); one that takes longer is given
    up and vLLM recomputes its tokens.

    Disaggregation (``kv_role`` ``kv_producer`` or ``kv_consumer``; ``kv_both``
    where ``pd_host`` or ``pd_port`` is given): ``pd_host`` is the address a
    prefill engine's side channel listens on and its answers name
    (``127.0.0.1`` by default: set the machine's address for decode engines
    elsewhere), ``pd_port`` its port (0, the default: a free one, named in each
    answer), ``pd_expiry`` how many seconds a prefill engine holds a finished
    request's blocks for a decode engine that has not read them (120 by
    default; a lease a reader takes extends it while its read may run). A
    decode engine's read is given up past ``load_timeout``. Tiers are optional
    for ``kv_producer`` and ``kv_consumer`` (an empty list: none).

    ``save_backlog``: the most bytes of saves a worker holds gathered and not yet
    written to its tiers (a size, ``"1GiB"`` by default). A step's saves that
    would go past it are skipped, before anything is copied: the forward outruns
    a slow disk or store by costing future misses, never by growing host memory
    without a bound.

    ``store_feed``: how the scheduler learns what a shared store holds. ``auto``
    (default): it follows the store's keyspace notifications where the server
    announces every change it needs (``notify-keyspace-events K$gxe``), and lists
    the store every 10 s where it does not; ``off``: it lists it every 10 s
    (a store whose server announces for other clients, and whose writes would
    cost it more to publish to every engine than a listing).
    """

    tiers: tuple[TierSpec, ...]
    namespace: str = ""
    host_frame_bytes: int | None = None
    layout: str = "auto"
    save_backlog: int = 1 << 30
    load_timeout: float = 30.0
    pd_host: str = "127.0.0.1"
    pd_port: int = 0
    pd_expiry: float = 120.0
    store_feed: str = "auto"
    disaggregated: bool = False  # the role, or pd_host / pd_port, asks for it

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None, role: str = "kv_both") -> ConnectorSettings:
        where = "kv_connector_extra_config"
        if role not in ROLES:
            raise ConnectorConfigError(
                f"kv_role={role!r}: the kvarena connector serves {', '.join(ROLES)}"
            )
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConnectorConfigError(f"{where} must be a mapping, got {type(extra).__name__}")
        for old, new in RENAMED.items():
            if old in extra:
                raise ConnectorConfigError(
                    f"{where}[{old!r}] is now {new!r} (same meaning); rename the key"
                )
        unknown = sorted(str(k) for k in extra if k not in KEYS)
        if unknown:
            raise ConnectorConfigError(
                f"{where}[{unknown[0]!r}]: unknown key; the kvarena connector reads "
                + ", ".join(KEYS)
            )
        tiers = extra.get("tiers", [] if role != "kv_both" else None)
        if (
            isinstance(tiers, str)
            or not isinstance(tiers, (list, tuple))
            or (not tiers and role == "kv_both")
        ):
            raise ConnectorConfigError(
                f"{where}['tiers'] must be a non-empty list of tier specs ({SPEC_FORMS}), "
                f"got {redacted(tiers) if isinstance(tiers, str) else tiers!r}"
                + (" (kv_producer and kv_consumer may have none)" if role == "kv_both" else "")
            )
        for i, spec in enumerate(tiers):
            if not isinstance(spec, str) or not spec.strip():
                raise ConnectorConfigError(
                    f"{where}['tiers'][{i}] must be a tier spec ({SPEC_FORMS}), got {spec!r}"
                )
        specs: list[TierSpec] = []
        for i, text in enumerate(tiers):
            try:
                spec = TierSpec.parse(text)
            except TierSpecError as exc:
                raise ConnectorConfigError(
                    f"{where}['tiers'][{i}] = {redacted(text)!r}: {exc.reason}"
                ) from None
            if spec.kind == "mooncake":
                raise ConnectorConfigError(
                    f"{where}['tiers'][{i}] = {redacted(text)!r}: a Mooncake store is not yet a tier "
                    "of the connector (its scheduler lists a shared store, which Mooncake's "
                    "client cannot); use redis:// or redis+cluster://"
                )
            if spec.kind in [x.kind for x in specs]:
                raise ConnectorConfigError(
                    f"{where}['tiers'][{i}] = {redacted(text)!r}: a second {spec.kind} tier; "
                    "name each kind once"
                )
            specs.append(spec)
        namespace = extra.get("namespace", "")
        if not isinstance(namespace, str) or len(namespace) > 256:
            raise ConnectorConfigError(
                f"{where}['namespace'] must be a string of at most 256 characters, "
                f"got {namespace!r:.80}"
            )
        frame = extra.get("host_frame_bytes")
        if frame is not None and (
            isinstance(frame, bool)
            or not isinstance(frame, int)
            or not MIN_FRAME_BYTES <= frame <= 1 << 30
        ):
            raise ConnectorConfigError(
                f"{where}['host_frame_bytes'] must be an integer in {MIN_FRAME_BYTES}..2**30 "
                f"(or absent: one KV block's object), got {frame!r}"
            )
        layout = extra.get("layout", "auto")
        if layout not in LAYOUTS:
            raise ConnectorConfigError(
                f"{where}['layout'] must be one of {', '.join(LAYOUTS)}, got {layout!r:.80}"
            )
        backlog = extra.get("save_backlog", cls.save_backlog)
        try:
            backlog_bytes = parse_bytes(backlog) if isinstance(backlog, str) else backlog
        except Error:
            backlog_bytes = None
        if isinstance(backlog, bool) or not isinstance(backlog_bytes, int) or backlog_bytes < 1:
            raise ConnectorConfigError(
                f"{where}['save_backlog'] must be a size of at least 1 byte (an integer "
                f"or a string such as '1GiB'), got {backlog!r:.80}"
            )
        feed = extra.get("store_feed", cls.store_feed)
        if feed not in FEEDS:
            raise ConnectorConfigError(
                f"{where}['store_feed'] must be one of {', '.join(FEEDS)}, got {feed!r:.80}"
            )
        timeout = _seconds(extra, "load_timeout", cls.load_timeout, 3600)
        host = extra.get("pd_host", cls.pd_host)
        if not isinstance(host, str) or not host or host in ("0.0.0.0", "::") or " " in host:
            raise ConnectorConfigError(
                f"{where}['pd_host'] must be an address decode engines reach (a host name "
                f"or IP, not a wildcard), got {host!r:.80}"
            )
        port = extra.get("pd_port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConnectorConfigError(
                f"{where}['pd_port'] must be a port in 0..65535 (0: a free one), got {port!r:.80}"
            )
        expiry = _seconds(extra, "pd_expiry", cls.pd_expiry, 86400)
        return cls(
            pd_host=host,
            pd_port=port,
            pd_expiry=expiry,
            disaggregated=role != "kv_both" or "pd_host" in extra or "pd_port" in extra,
            tiers=tuple(specs),
            namespace=namespace,
            host_frame_bytes=frame,
            layout=layout,
            save_backlog=backlog_bytes,
            load_timeout=timeout,
            store_feed=feed,
        )

    def preferred_layout(self, *, cpu: bool) -> str | None:
        """The layout to ask vLLM for (its ``KVCacheLayout`` name), None for none."""
        if self.layout == "engine" or (self.layout == "auto" and cpu):
            return None
        return BLOCK_MAJOR


def _seconds(extra: Mapping[str, Any], key: str, default: float, most: float) -> float:
    """``extra[key]`` as a number of seconds in (0, ``most``], else refused naming it."""
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:
        raise ConnectorConfigError(
            f"kv_connector_extra_config[{key!r}] must be a number of seconds in (0, {most:g}], "
            f"got {value!r:.80}"
        )
    return float(value)


def check_failure_policy(policy: object) -> str:
    """vLLM's ``kv_load_failure_policy`` as the connector needs it: ``"recompute"``.

    The connector is a cache: an object can vanish between a lookup and its
    load (another engine's eviction in a shared store, a disk cleaned, a store
    restarted) or fail its checks, and that must cost a recompute, never a
    failed request. Under vLLM's ``"fail"`` (its default) such a load fails
    the user's request, so an engine configured that way is refused at start,
    naming the key, rather than failing requests later."""
    if policy != "recompute":
        raise ConnectorConfigError(
            f"kv_load_failure_policy={policy!r}: the kvarena connector needs 'recompute' "
            "(a lost or corrupt tier object must cost a recompute, never a failed request); "
            "set it in the KVTransferConfig (kvarena.integrations.vllm.kv_transfer_config does)"
        )
    return "recompute"
