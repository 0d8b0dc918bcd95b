"""The handoff's ``kv_transfer_params`` (one writer, one parser) and what a decode
engine's scheduler refuses of an offer, and why. Runs in the ``.venv-vllm``
environment; skipped where vLLM is not installed."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvarena.integrations.vllm.groups import Group, namespace_diff
from kvarena.integrations.vllm.pd_params import (
    Offer,
    prefix_digest,
    wants_remote_decode,
)
from kvarena.integrations.vllm.pd_scheduler import PdScheduler

PROMPT = list(range(3, 103))


def offer(**change) -> Offer:
    fields = dict(
        engine_id="e1",
        request_id="r1",
        block_ids=((0, 7), (5, 6)),
        num_tokens=99,
        host="127.0.0.1",
        port=5600,
        tp_size=1,
        block_size=64,
        prefix=prefix_digest(PROMPT[:99]),
    )
    fields.update(change)
    return Offer(**fields)


def test_an_offer_round_trips_through_the_params_a_proxy_copies():
    params = json.loads(json.dumps(offer().params()))  # as a proxy passes it on
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    for key in ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host"):
        assert key in params  # NixlConnector's names: a PD proxy needs nothing else
    assert Offer.parse(params, groups=2) == offer()
    assert Offer.parse({"do_remote_decode": True}, groups=2) is None
    assert Offer.parse(None, groups=2) is None
    assert wants_remote_decode({"do_remote_decode": True})
    assert not wants_remote_decode(None) and not wants_remote_decode(params)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"remote_port": None}, "lack remote_port"),
        ({"kvarena_prefix": None}, "lack kvarena_prefix"),
        ({"remote_block_ids": [[1, 2]]}, "one list per KV cache group (2)"),
        ({"remote_block_ids": [[1, -2], [3]]}, "non-negative integers"),
        ({"remote_block_ids": [[1, True], [3]]}, "non-negative integers"),
        ({"remote_num_tokens": -1}, "remote_num_tokens must be an integer >= 0"),
        ({"remote_port": "5600"}, "remote_port must be an integer >= 1"),
        ({"kvarena_block_size": 0}, "kvarena_block_size must be an integer >= 1"),
        ({"tp_size": 0}, "tp_size must be a positive integer"),
    ],
)
def test_unusable_params_say_why(change, why):
    params = {**offer().params(), **change}
    got = Offer.parse(params, groups=2)
    assert isinstance(got, str) and why in got


def test_a_digest_names_the_tokens_exactly():
    assert prefix_digest([1, 2, 3]) == prefix_digest((1, 2, 3))
    assert len({prefix_digest(t) for t in ([1, 2, 3], [1, 2, 4], [1, 2], [3, 2, 1])}) == 4


def scheduler(kinds=("state", "kv"), ranks=1):
    groups = [
        Group(index=i, kind=k, layers=(f"l{i}",), spec={}, block_bytes=64)
        for i, k in enumerate(kinds)
    ]
    return PdScheduler(
        role="kv_consumer",
        groups=groups,
        block_size=64,
        ranks=ranks,
        engine_id="here",
        host="127.0.0.1",
        port=0,
        expiry_s=10,
        timeout_s=1,
    )


@pytest.mark.parametrize(
    ("kinds", "ranks", "o", "why", "tokens"),
    [
        (("state", "kv"), 1, offer(), "", 99),  # the hybrid's prefill stopped a token short
        (
            ("kv",),
            1,
            offer(block_ids=((5, 6),), num_tokens=100, prefix=prefix_digest(PROMPT)),
            "",
            99,
        ),
        (("kv",), 1, offer(block_ids=((5, 6),)), "", 99),
        (("state", "kv"), 2, offer(), "prefill tensor-parallel size 1, here 2", 0),
        (("state", "kv"), 1, offer(block_size=32), "prefill blocks of 32 tokens, here 64", 0),
        (("state", "kv"), 1, offer(prefix=prefix_digest(PROMPT[1:100])), "does not begin", 0),
        (
            ("state", "kv"),
            1,
            offer(num_tokens=100, prefix=prefix_digest(PROMPT)),
            "its state holds the last token",
            0,
        ),
    ],
)
def test_what_a_decode_engine_reads_of_an_offer(kinds, ranks, o, why, tokens):
    request = SimpleNamespace(prompt_token_ids=PROMPT, request_id="d1")
    got = scheduler(kinds, ranks)._usable(request, o)
    assert (got[1], why in got[0] if why else got[0] == "") == (tokens, True)


def test_a_namespace_diff_names_both_sides_field_by_field():
    def ns(**change):
        base = {"model": "m", "groups": [{"kind": "kv", "layers": ["a"], "spec": {"bs": 32}}]}
        base.update(change)
        return json.dumps(base).encode()

    other = ns(model="n", groups=[{"kind": "kv", "layers": ["a"], "spec": {"bs": 64}}])
    diff = namespace_diff(other, ns())
    assert "model: 'n' there, 'm' here" in diff and "group 0 bs: 64 there, 32 here" in diff
