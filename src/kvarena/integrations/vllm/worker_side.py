"""A worker's half of the connector: the tiers' bytes, in and out of vLLM's tensors.

A load is fetched top tier first, every object checked against what this
engine expects — kind, key, namespace, token span, length, checksum — and
copied into the block ids the scheduler names, one batch of kvarena's copy
engine per storage (:class:`~.tensors.CachePages`; a host tier's objects
straight from its allocation); an object that fails anywhere is tried in the
next tier, and what no tier serves is reported by its block ids so vLLM
recomputes them (``kv_load_failure_policy="recompute"``). Nothing unchecked
is ever copied. Where it runs: a load the host tier on top serves whole is
copied in ``start_load_kv``, before the step's forward (from host memory in
place: no I/O on the step), and vLLM runs the request in that very step
where the scheduler found the copy fits a share of it (:mod:`.pace`; else
the request waits a step); every other load is fetched on the I/O threads
(:mod:`.loads`) and copied in at the start of a later step, as many a step
as the plan's landing budget allows, or failed past its deadline.

Saves take the step's bytes after its forward (one batch per storage and object
kind into one host buffer) and hand checksumming and the tier writes to the
writer thread (:mod:`.saves`), bounded by ``save_backlog`` bytes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping

import torch

from ...errors import Error
from ...tiers import ImageKind, TierStack
from ...tiers.checked import Expectations, Fetched, fetch_checked
from ...tiers.host import HostTier
from ...tiers.names import object_name
from .groups import Group, blocks_fail_alone
from .loads import LoadQueue
from .ranks import own_copy
from .records import BlockCopy, Load, News, StepPlan, Timed, WorkerReport
from .saves import SaveQueue, gathered
from .tensors import CachePages, cache_pages, payload_bytes

# Under vLLM's logger: an operator sees the connector in the engine's own log.
log = logging.getLogger("vllm.kvarena")

FLUSH_TIMEOUT_S = 30.0
"""How long a stopping worker writes what its queue still holds. Within
vLLM's own grace: the engine waits for its workers
(``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``) when the server stops with
``--shutdown-timeout`` above 0."""


def _payload_bytes(payloads: list[memoryview | None]) -> int:
    """The bytes a fetched load's landing copies."""
    return sum(len(p) for p in payloads if p is not None)


class WorkerSide:
    def __init__(
        self,
        *,
        groups: list[Group],
        namespace: bytes,
        tiers: TierStack,
        block_size: int,
        rank: int = 0,
        ranks: int = 1,
        save_backlog: int,
        load_deadline_s: float = 30.0,
    ) -> None:
        """``namespace``: this rank's (written into and checked in every image);
        ``rank`` of ``ranks``: which shard of each object this worker holds;
        ``save_backlog``: the most payload bytes gathered and not yet written."""
        self.groups = groups
        self.rank, self.ranks = rank, ranks
        self.kv_groups = [g for g in groups if g.kind == "kv"]
        self.state_groups = [g for g in groups if g.kind == "state"]
        # What every object of this rank must be (one image's payload of each
        # kind fixed by the groups): what a load checks and a save encodes.
        self.expect = Expectations(
            namespace=namespace,
            block_size=block_size,
            kv_bytes=payload_bytes(self.kv_groups),
            state_bytes=payload_bytes(self.state_groups),
        )
        self.tiers = tiers
        self.pages: CachePages | None = None  # vLLM's tensors as spans, once registered
        hosts = [(level, t) for level, t in enumerate(tiers.tiers) if isinstance(t, HostTier)]
        # where payloads lent in place lie: the first host tier's level and buffer
        self._arena = (hosts[0][0], hosts[0][1].buffer) if hosts else None
        self._errors: set[int] = set()
        self._received: set[str] = set()  # requests whose load ran (or failed) this step
        self._failed_requests: set[str] = set()
        self.news = News()  # what the next report tells the scheduler
        self.loads_done = 0
        self.load_failures = 0
        self.saves = SaveQueue(
            tiers=tiers, expect=self.expect, rank=rank, news=self.news, backlog=save_backlog
        )
        self.queue = LoadQueue(lambda job: self._fetch_job(job, None), deadline_s=load_deadline_s)

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        self.pages = cache_pages(kv_caches, self.groups, num_blocks=num_blocks)

    # -- loads ----------------------------------------------------------------------
    def _fetch(
        self,
        wanted: list[tuple[ImageKind, BlockCopy]],
        prefixes: list[str],
        held: contextlib.ExitStack | None,
        last: int | None = None,
    ) -> tuple[list[memoryview | None], Fetched, dict[str, str]]:
        """Each object's checked payload (``wanted``: this rank's copies of the
        prefix objects named ``prefixes``), from the first tier that holds a
        good one (:func:`~kvarena.tiers.checked.fetch_checked`; a host tier's
        read in place, held open by ``held`` until the caller has copied them
        out), what the fetch did, and each failure by its prefix object's name
        with why. A failure is reported by its prefix object's name."""
        names = [object_name(k, c.key) for k, c in wanted]
        got = fetch_checked(
            self.tiers,
            [
                (n, self.expect.of(k, c.key, c.index, c.tokens))
                for n, (k, c) in zip(names, wanted, strict=True)
            ],
            held=held,
            last=last,
        )
        for r in got.rejected:
            log.warning("kvarena: %s in %s: %s", r.name, r.label, r.detail)
        prefix_of = dict(zip(names, prefixes, strict=True))
        failures = {prefix_of[n]: why for n, why in got.failures().items()}
        self.news.add(
            host_dropped=got.dropped_hosted,  # nobody should trip on them again
            dropped=[(r.label, r.name) for r in got.rejected if not r.label.startswith("host")],
            failed=list(failures),
        )
        return got.payloads, got, failures

    def load(self, plan: StepPlan) -> None:
        """This step's loads: the fetches finished since the last step copied in
        and reported (as many as the plan's ``land_bytes`` allow, the first
        always, the rest in later steps); new loads the host tier serves whole
        done now (in place, well inside a step; those vLLM runs in this very
        step before its forward, :attr:`Load.in_step`), the rest handed to the
        I/O threads."""
        # a fetch's result: (wanted, payloads, what the fetch did, failures), or
        # the exception it raised (nothing to land)
        done, late = self.queue.collect(
            budget=plan.land_bytes,
            weigh=lambda fetched: (
                0 if isinstance(fetched, BaseException) else _payload_bytes(fetched[1])
            ),
        )
        for job, fetched in done:
            if isinstance(fetched, BaseException):
                self._broken(job, fetched)
            else:
                self._finish(job, *fetched)
        for job in late:
            self._give_up(job)
        for job in plan.loads:
            if job.in_step or self._hosted(job):
                began = time.perf_counter()
                with contextlib.ExitStack() as held:
                    # in the step: the host tier alone (a miss there is a
                    # recompute, never a read below it on the step)
                    fetched = self._fetch_job(job, held, last=0 if job.in_step else None)
                    if isinstance(fetched, BaseException):
                        self._broken(job, fetched)
                    else:
                        self._finish(job, *fetched, began=began)
            else:
                self.queue.submit(job)

    def _hosted(self, job: Load) -> bool:
        """Whether the scheduler found every object of ``job`` in a host tier on top
        (a stack whose top is the disk reads it off the step, whatever is below)."""
        copies = [*job.kv, *([job.state] if job.state is not None else [])]
        on_top = isinstance(self.tiers.tiers[0], HostTier) if self.tiers.tiers else False
        return on_top and all(c.level == 0 for c in copies)

    def _named(self, job: Load) -> tuple[list[tuple[ImageKind, BlockCopy]], list[str]]:
        named = [(ImageKind.KV_BLOCK, c) for c in job.kv]
        if job.state is not None:
            named.append((ImageKind.STATE, job.state))
        wanted = [
            (kind, own_copy(c, self.rank, self.ranks)) for kind, c in named
        ]  # this rank's shard of each
        return wanted, [object_name(kind, c.key) for kind, c in named]

    def _fetch_job(
        self, job: Load, held: contextlib.ExitStack | None, last: int | None = None
    ) -> (
        tuple[list[tuple[ImageKind, BlockCopy]], list[memoryview | None], Fetched, dict[str, str]]
        | Exception
    ):
        """A load's fetch, or the exception it raised: a tier's fault no tier
        foresaw (a bug, a client library's own error) fails that load, which
        vLLM recomputes, as a bad object would; it never reaches the engine's
        step (:meth:`_broken` logs it whole)."""
        try:
            wanted, prefixes = self._named(job)
            payloads, got, failures = self._fetch(wanted, prefixes, held, last)
        except Exception as exc:
            return exc
        return wanted, payloads, got, failures

    def _finish(
        self,
        job: Load,
        wanted: list[tuple[ImageKind, BlockCopy]],
        payloads: list[memoryview | None],
        got: Fetched,
        failures: dict[str, str],
        began: float | None = None,
    ) -> None:
        """Copy a fetched load in and report it (``began``: when a load done in the
        step started: a load the host tier alone served is timed whole, fetch,
        checks and copy, what the scheduler paces loads in the step by)."""
        if not job.in_step:  # vLLM waits for word of it
            self._received.add(job.request)
        landing = time.perf_counter()
        copied = self._apply(job, wanted, payloads, got.lent)
        landing = time.perf_counter() - landing
        if copied and began is None:  # fetched off the step: its copy paces the landings
            self.news.add(landed=[(_payload_bytes(payloads), landing)])
        seconds = got.seconds
        host = self.tiers.labels[0] if self.tiers.tiers else None
        if began is not None and host is not None and set(got.read_bytes) == {host}:
            seconds = {host: time.perf_counter() - began}
        timed = Timed(
            key=job.request,
            rank=self.rank,
            seconds=seconds,
            nbytes=got.read_bytes,
            failures=failures,
        )
        self.news.add(loads=[timed])

    def _broken(self, job: Load, exc: BaseException) -> None:
        """A load whose fetch raised: failed whole (:meth:`_failed_whole`); the
        exception logged with its traceback (a defect to report, not a miss)."""
        log.error(
            "kvarena: request %s: its fetch raised %s",
            job.request,
            type(exc).__name__,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        self._failed_whole(job, "error", f"its fetch raised {type(exc).__name__}: {exc}")

    def _give_up(self, job: Load) -> None:
        """A load past its deadline: failed whole (:meth:`_failed_whole`)."""
        why = f"its fetch passed the {self.queue.deadline_s:g} s deadline"
        self._failed_whole(job, "timeout", why)

    def _failed_whole(self, job: Load, reason: str, why: str) -> None:
        """A load none of whose objects could be had (``reason``, as the metrics
        count it): every block failed, so vLLM recomputes them, and every prefix
        object reported failed, so the scheduler's lookups skip it until it is
        saved again (the recomputed request saves it): a store stuck or broken
        for good costs each request one deadline or one error, never a load
        promised again and again."""
        if not job.in_step:  # vLLM waits for word of it
            self._received.add(job.request)
        self._fail(job, why)
        _, prefixes = self._named(job)
        failures = dict.fromkeys(prefixes, reason)
        self.news.add(
            failed=prefixes, loads=[Timed(key=job.request, rank=self.rank, failures=failures)]
        )

    def _apply(
        self,
        job: Load,
        wanted: list[tuple[ImageKind, BlockCopy]],
        payloads: list[memoryview | None],
        lent: list[tuple[int, int] | None],
    ) -> bool:
        """Copy a load's payloads into its blocks (those the arena's tier lent in
        place by their offsets in it), or fail the load if any is missing;
        whether it was copied whole. Where the blocks before the first missing
        object can stand alone (:meth:`_prefix_stands`), those are copied and
        only the blocks from it on are failed: vLLM recomputes from there. A
        copy that raises (not a refusal: torch's own fault, which may leave some
        blocks written) fails every block of the load, so vLLM rewrites them."""
        missing = sum(p is None for p in payloads)
        why = f"{missing} of {len(payloads)} objects missing or failing their checks"
        first = next((i for i, p in enumerate(payloads) if p is None), len(payloads))
        kept = first if first == len(payloads) or self._prefix_stands(job) else 0
        if kept:
            level, arena = self._arena if self._arena is not None else (-1, None)
            parts: dict[str, tuple[list, list, list]] = {}
            for (kind, copy), p, where in zip(
                wanted[:kept], payloads[:kept], lent[:kept], strict=True
            ):
                name = "kv" if kind is ImageKind.KV_BLOCK else "state"
                part = parts.setdefault(name, ([], [], []))
                part[0].append(copy.blocks)
                part[1].append(p)
                part[2].append(where[1] if where is not None and where[0] == level else None)
            assert self.pages is not None
            try:
                self.pages.place(parts, arena)
            except Error as exc:  # a batch refused before a byte moved: recompute
                why, kept = f"its copy was refused ({exc})", 0
            except Exception as exc:  # torch's own fault, maybe part way: every block recomputed
                log.error("kvarena: request %s: its copy raised", job.request, exc_info=True)
                why, kept = f"its copy raised {type(exc).__name__}: {exc}", 0
        if kept == len(payloads):
            self.loads_done += 1
            return True
        self._fail(job, why, kept=kept)
        return False

    def _prefix_stands(self, job: Load) -> bool:
        """Whether a load's first objects are of use without the rest: KV blocks
        alone, in block order, in a cache of one KV group (vLLM maps failed
        block ids back to requests for one group alone, and truncates a
        request's computed tokens at its first failed block; a state, or a
        second group, makes the load all or nothing; so does a part the prefill
        engine's read completes, :mod:`.joins`)."""
        indexes = [c.index for c in job.kv]
        return (
            job.state is None
            and not job.joined
            and blocks_fail_alone(self.groups)
            and indexes == sorted(indexes)
        )

    def _fail(self, job: Load, why: str, kept: int = 0) -> None:
        """What a load that cannot be served whole leaves: its first ``kept`` KV
        objects copied in (:meth:`_apply`), every block from there on failed;
        vLLM recomputes from the first failed block."""
        self.load_failures += 1
        failed = job.block_ids if not kept else {b for c in job.kv[kept:] for b in c.blocks}
        self._errors |= failed
        if not job.in_step:  # one vLLM runs in this step is named by its blocks alone
            self._failed_requests.add(job.request)
        log.warning(
            "kvarena: request %s: %s; vLLM recomputes %d of its %d blocks",
            job.request,
            why,
            len(failed),
            len(job.block_ids),
        )

    def received(self) -> tuple[set[str], set[str]]:
        """Requests whose load ran since the last call, and those of them that failed."""
        done, failed = self._received, self._failed_requests
        self._received, self._failed_requests = set(), set()
        return done, failed

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        kv, state = plan.kv_saves, plan.state_saves
        if not (kv or state):
            return
        nbytes = len(kv) * self.expect.kv_bytes + len(state) * self.expect.state_bytes
        names = [object_name(ImageKind.KV_BLOCK, c.key) for c in kv]
        names += [object_name(ImageKind.STATE, c.key) for c in state]
        if not self.saves.admit(nbytes, names):
            return
        assert self.pages is not None
        jobs = [
            save
            for kind, copies in ((ImageKind.KV_BLOCK, kv), (ImageKind.STATE, state))
            if copies
            for save in gathered(self.pages, kind, copies, rank=self.rank, ranks=self.ranks)
        ]
        self.saves.submit(jobs, nbytes)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every queued save is in the tiers, or ``timeout`` seconds;
        the objects still waiting (0: all written)."""
        return self.saves.flush(timeout)

    def report(self) -> WorkerReport | None:
        return self.news.take()

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> int:
        """Write what is queued (at most ``timeout`` seconds), then stop the
        writer and close the tiers; the objects that could not be written."""
        self.queue.close()
        left = self.saves.close(timeout)
        if not left:
            self.tiers.close()
        return left
