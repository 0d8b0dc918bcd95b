"""The scheduler's half of disaggregation: what a prefill engine holds, what a decode engine reads.

A prefill engine (``kv_role`` ``kv_producer``, or ``kv_both``) holds a
``do_remote_decode`` request's blocks when it finishes (vLLM frees them once
every worker reports them sent) and answers where they are
(:class:`~.pd_params.Offer`); its side channel (:mod:`.pd_channel`) hands its
workers' NIXL hellos and leases on the held requests to decode workers. A
hold ends when the blocks are read, when a decode engine says it will not
read them, or at its expiry once no lease is left on it.

A decode engine (``kv_consumer``, or ``kv_both``) answers a request carrying
an offer with the tokens it will read, asynchronously, and plans the read
into the blocks vLLM allocates (:class:`~.records.Pull`). What travels is
exact, never a token applied twice: every KV block of every attention group
up to the tokens read, and each state group's state after exactly those
tokens. The decode engine always computes a prompt's last token itself; for
a hybrid model the prefill engine therefore stops one token short (its
state is then the state the decode engine resumes from), as vLLM's own
disaggregation does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .groups import Group
from .pd_channel import Asker, Channel, ChannelError, Hello, OfferBook
from .pd_params import Offer, prefix_digest, wants_remote_decode
from .records import Pull, StepPlan

log = logging.getLogger("vllm.kvarena")

LEASE_MARGIN_S = 5.0
"""How much longer than a read may take the prefill engine holds its blocks
for it: the decode worker has given its READ up well before they are reused."""


@dataclass(kw_only=True)
class _Peer:
    """A prefill engine as this decode engine's scheduler knows it."""

    asked: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (ask id, when)
    hellos: dict[int, Hello] = field(default_factory=dict)
    why: str = ""  # why it cannot be read from (its channel refused)
    announced: bool = False  # its hellos went to the workers in a plan


@dataclass(kw_only=True)
class _Leasing:
    pull: Pull
    lease: int  # the lease ask's id
    asked: float  # time.monotonic() when it was asked
    granted: bool = False


class PdScheduler:
    def __init__(
        self,
        *,
        role: str,
        groups: list[Group],
        block_size: int,
        ranks: int,
        engine_id: str,
        host: str,
        port: int,
        expiry_s: float,
        timeout_s: float,
    ) -> None:
        self.producer = role in ("kv_producer", "kv_both")
        self.consumer = role in ("kv_consumer", "kv_both")
        self.groups = groups
        self.kv_groups = [g for g in groups if g.kind == "kv"]
        self.state_groups = [g for g in groups if g.kind == "state"]
        self.block_size = block_size
        self.ranks = ranks
        self.engine_id = engine_id
        self.host, self.port = host, port
        self.expiry_s, self.timeout_s = expiry_s, timeout_s
        self.offers = OfferBook()
        self.channel: Channel | None = None
        # rid -> offer, tokens read up to, tokens held or loaded before the read, of
        # which loaded from this engine's tiers
        self._pending: dict[str, tuple[Offer, int, int, int]] = {}
        self._pulls: list[Pull] = []
        self._new_offers: list[str] = []
        # a decode engine's asks of prefill engines: from its own steps, never waiting
        self._asker = Asker() if self.consumer else None
        self._peers: dict[tuple[str, str, int], _Peer] = {}
        self._leasing: list[_Leasing] = []
        self._read_now: dict[str, int] = {}  # rid -> tokens read, this step's allocations

    # -- prefill side ---------------------------------------------------------------
    def hellos(self, hellos: dict[int, Hello]) -> None:
        """The workers' hellos (after they registered their caches): the side
        channel starts serving them."""
        if not self.producer or self.channel is not None:
            return
        if sorted(hellos) != list(range(self.ranks)):
            raise ChannelError(f"hellos from ranks {sorted(hellos)}, expected 0..{self.ranks - 1}")
        self.channel = Channel(
            host=self.host,
            port=self.port,
            engine_id=self.engine_id,
            hellos=hellos,
            offers=self.offers,
        )

    def on_new_request(self, request: Any) -> None:
        """A hybrid model's prefill stops one prompt token short: the decode engine
        computes the last token from the state before it."""
        params = request.kv_transfer_params
        if not (self.producer and self.state_groups and wants_remote_decode(params)):
            return
        if params.get("_kvarena_short") or request.num_prompt_tokens < 2:
            return
        if request.prompt_token_ids is None:
            return  # prompt embeddings: nothing to cut, the offer will carry no state
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        request.max_tokens = 1
        params["_kvarena_short"] = True

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        """Hold a finished ``do_remote_decode`` request's blocks and say where they are."""
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        pending = self._pending.pop(rid, None)
        if pending is not None:  # a decode request ended before it was read into
            self._release(pending[0])
        params = request.kv_transfer_params
        if not (self.producer and wants_remote_decode(params)):
            return False, None
        if request.status not in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            return False, None
        tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
        if self.state_groups and tokens != request.num_prompt_tokens:
            log.warning("kvarena: request %s: its state is past the prompt; not offered", rid)
            return False, None
        if self.channel is None or tokens < 1 or not any(block_ids):
            return False, None
        self.offers.hold(rid, self.expiry_s)
        self._new_offers.append(rid)
        offer = Offer(
            engine_id=self.engine_id,
            request_id=rid,
            block_ids=tuple(tuple(g) for g in block_ids),
            num_tokens=tokens,
            host=self.host,
            port=self.channel.port,
            tp_size=self.ranks,
            block_size=self.block_size,
            prefix=prefix_digest(request.all_token_ids[:tokens]),
        )
        return True, offer.params()

    def sent(self, requests: set[str]) -> None:
        """vLLM's word that every worker freed these held requests."""
        self.offers.release(requests)

    # -- decode side ----------------------------------------------------------------
    def offered(self, request: Any) -> bool:
        """Whether a request carries a prefill engine's offer this engine reads."""
        params = request.kv_transfer_params
        return bool(self.consumer and params and params.get("do_remote_prefill"))

    def matched(self, request: Any, num_computed: int, first: int = 0) -> tuple[int, bool] | None:
        """The tokens a request carrying an offer reads beyond ``num_computed``
        (None: it carries none). ``first``: tokens after ``num_computed`` this
        engine's tiers load (whole blocks): only the rest is read, and the
        answer counts both."""
        if not self.offered(request):
            return None
        params = request.kv_transfer_params
        offer = Offer.parse(params, groups=len(self.groups))
        if offer is None:
            return None
        why, tokens = self._usable(request, offer)
        if why:
            log.warning(
                "kvarena: request %s: its prefill is not read (%s); computed here",
                request.request_id,
                why,
            )
        local = num_computed + first
        # where the tiers load every KV block, a state group's state at the
        # prefill's end is still worth a read of its own
        short = tokens < local or (tokens == local and not self.state_groups)
        if why or tokens <= num_computed or short:
            params["do_remote_prefill"] = False
            if not isinstance(offer, str):
                self._release(offer)
            return 0, False
        assert isinstance(offer, Offer)
        self._pending[request.request_id] = (offer, tokens, local, first)
        return tokens - num_computed, True

    def _usable(self, request: Any, offer: Offer | str) -> tuple[str, int]:
        """Why an offer cannot be read (empty: it can), and the tokens read."""
        if isinstance(offer, str):
            return offer, 0
        prompt = request.prompt_token_ids or []
        if offer.tp_size != self.ranks:
            return f"prefill tensor-parallel size {offer.tp_size}, here {self.ranks}", 0
        if offer.block_size != self.block_size:
            return f"prefill blocks of {offer.block_size} tokens, here {self.block_size}", 0
        if (
            len(prompt) < offer.num_tokens
            or prefix_digest(prompt[: offer.num_tokens]) != offer.prefix
        ):
            return f"the prompt does not begin with the prefill's {offer.num_tokens} tokens", 0
        if self.state_groups:
            if offer.num_tokens > len(prompt) - 1:
                return "the prefill computed the whole prompt: its state holds the last token", 0
            return "", offer.num_tokens
        return "", min(offer.num_tokens, len(prompt) - 1)

    def allocated(
        self, request: Any, block_ids: tuple[list[int], ...], external: int
    ) -> int | None:
        """Plan the read into the blocks vLLM allocated; the tokens this engine's
        tiers load before it (None: the request is not one this half answered)."""
        rid = request.request_id
        pending = self._pending.pop(rid, None)
        if pending is None:
            return None
        offer, tokens, local, first = pending
        if request.kv_transfer_params:
            request.kv_transfer_params["do_remote_prefill"] = False  # read once
        if external == 0:
            self._release(offer)
            return 0
        self._read_now[rid] = external - first
        bs = self.block_size
        where = dict(
            request=rid,
            engine_id=offer.engine_id,
            remote_request=offer.request_id,
            host=offer.host,
            port=offer.port,
        )
        try:
            positions = range(local // bs, -(-tokens // bs))
            kv_local = tuple(
                tuple(block_ids[g.index][i] for g in self.kv_groups) for i in positions
            )
            kv_remote = tuple(
                tuple(offer.block_ids[g.index][i] for g in self.kv_groups) for i in positions
            )
            at = (tokens - 1) // bs
            state_local = tuple(block_ids[g.index][at] for g in self.state_groups)
            state_remote = tuple(offer.block_ids[g.index][at] for g in self.state_groups)
        except IndexError:
            self._pulls.append(
                Pull(**where, refused="the offer's block ids do not cover its tokens")
            )
            return first
        ids = [b for x in (*kv_local, *kv_remote, state_local, state_remote) for b in x]
        pull = Pull(
            **where,
            kv_local=kv_local if self.kv_groups else (),
            kv_remote=kv_remote if self.kv_groups else (),
            state_local=state_local,
            state_remote=state_remote,
            refused="a null block on one side" if 0 in ids else "",
        )
        if pull.refused:
            self._pulls.append(pull)
        else:
            self._lease(pull)
        return first

    def read_now(self, request: Any) -> int:
        """The tokens a request allocated in this step reads from its prefill
        engine (vLLM counts them as hits from another instance)."""
        return self._read_now.get(request.request_id, 0)

    def _lease(self, pull: Pull) -> None:
        """Ask the prefill engine for its workers' hellos (once) and a lease on the
        request's blocks; the pull goes to the workers once both are answered."""
        assert self._asker is not None
        now = time.monotonic()
        peer = self._peers.setdefault((pull.engine_id, pull.host, pull.port), _Peer())
        for rank in range(self.ranks):
            if rank not in peer.hellos and rank not in peer.asked:
                hello = {"op": "hello", "engine_id": pull.engine_id, "rank": rank}
                peer.asked[rank] = (self._asker.send(pull.host, pull.port, hello), now)
        lease = {
            "op": "lease",
            "engine_id": pull.engine_id,
            "request": pull.remote_request,
            "seconds": self.timeout_s + LEASE_MARGIN_S,
        }
        asked = self._asker.send(pull.host, pull.port, lease)
        self._leasing.append(_Leasing(pull=pull, lease=asked, asked=now))

    def _answered(self, plan: StepPlan) -> None:
        """Take the prefill engines' answers: pulls leased from an engine whose
        hellos are known go to the workers (with those hellos, the first time),
        those refused or unanswered past ``timeout_s`` go as refused."""
        if self._asker is None:
            return
        answers = self._asker.answers()
        now = time.monotonic()
        for peer in self._peers.values():
            for rank, (asked, when) in list(peer.asked.items()):
                answer = answers.pop(asked, None)
                if answer is None:
                    if now - when > self.timeout_s:
                        del peer.asked[rank]  # asked again by the next pull
                    continue
                del peer.asked[rank]
                if not answer.get("ok"):
                    peer.why = f"its channel refused: {answer.get('why')}"
                elif answer.get("tp_size") != self.ranks:
                    peer.why = (
                        f"prefill tensor-parallel size {answer.get('tp_size')}, here {self.ranks}"
                    )
                else:
                    peer.hellos[rank] = Hello.from_dict(answer["hello"])
        waiting = []
        for w in self._leasing:
            answer = answers.pop(w.lease, None)
            if answer is not None and not answer.get("ok"):
                why = f"no lease on its blocks: {answer.get('why')}"
                self._pulls.append(dataclasses.replace(w.pull, refused=why))
                continue
            w.granted = w.granted or answer is not None
            peer = self._peers[(w.pull.engine_id, w.pull.host, w.pull.port)]
            if peer.why or now - w.asked > self.timeout_s:
                why = peer.why or f"no answer from its prefill engine in {self.timeout_s:g} s"
                self._pulls.append(dataclasses.replace(w.pull, refused=why))
            elif w.granted and len(peer.hellos) == self.ranks:
                if not peer.announced:
                    plan.peers[w.pull.engine_id] = {r: h.to_dict() for r, h in peer.hellos.items()}
                    peer.announced = True
                self._pulls.append(dataclasses.replace(w.pull, lease_end=w.asked + self.timeout_s))
            else:
                waiting.append(w)
        self._leasing = waiting

    def _release(self, offer: Offer) -> None:
        """Tell a prefill engine its offer will not be read (sent, not waited
        for: a prefill engine that does not hear it frees at expiry)."""
        if self._asker is not None:
            release = {"op": "release", "engine_id": offer.engine_id, "request": offer.request_id}
            self._asker.send(offer.host, offer.port, release)  # its answer is not awaited

    # -- each step ------------------------------------------------------------------
    def fill(self, plan: StepPlan) -> StepPlan:
        self._answered(plan)
        plan.pulls += self._pulls
        plan.offers += self._new_offers
        plan.expired += self.offers.expired() if self.producer else []
        self._pulls, self._new_offers = [], []
        self._read_now.clear()
        return plan

    def close(self) -> None:
        if self._asker is not None:
            self._asker.close()
        if self.channel is not None:
            self.channel.close()
