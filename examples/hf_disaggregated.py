"""A transformers model prefills in one process and decodes in another.

    python examples/hf_disaggregated.py [--family qwen3_next] [--tokens 12]

The prefill process computes the prompt into its kvarena pool, takes the
first token, and ships the request's KV blocks and its state (conv and
recurrent states, or sliding rings) with kvarena's NIXL sender: one
descriptor per block and per slot. The decode process adopts the arrived
blocks and slot as a ``KvarenaCache`` and generates the rest. The tokens must
equal one process running ``generate`` alone.

Each side can also run alone, e.g. in two network namespaces: ``--role
decode --bind HOST`` prints ``endpoint E``, reads the first token from stdin
and prints ``result {"tokens": ...}``; ``--role prefill --endpoint E`` prints
``result {"first": ...}``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys

import torch

REQUEST = "req-0"


def _setup(family: str):
    from kvarena.integrations.transformers import KvarenaPool
    from kvarena.integrations.transformers.tiny import tiny_model

    model = tiny_model(family)  # same seed on both sides: same weights
    pool = KvarenaPool.from_config(
        model.config, budget_bytes=16 << 20, max_seqs=4, dtype=model.dtype
    )
    return model, pool


def prompt(length: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(1))


def decode(family: str, bind: str, new_tokens: int, announce, first_token) -> list[int]:
    """Serve one request: wait for it, adopt it, generate; the token ids.

    ``first_token()`` is the token the prefill side sampled, which rides along
    with the request (a server sends it with the request's metadata)."""
    import kvarena as kv
    from kvarena.transfer.service import DecodeService

    model, pool = _setup(family)
    receiver = kv.DecodeReceiver("decode", pool.cache)
    service = DecodeService(receiver, f"tcp://{bind}:*")
    announce(service.endpoint)
    service.serve(until=lambda: REQUEST in receiver.ready)
    blocks, slots, owner = receiver.take(REQUEST)
    ids = prompt(PROMPT)
    first = first_token()
    cache = pool.adopt(blocks, slots, owner, PROMPT)
    full = torch.cat([ids, torch.tensor([[first]])], dim=1)
    if first == model.generation_config.eos_token_id or new_tokens == 1:
        out = full  # the first token ended the request
    else:
        out = model.generate(full, cache=cache, max_new_tokens=new_tokens - 1, do_sample=False)
    pool.release(cache)
    service.close()
    receiver.close()
    assert pool.cache.blocks.num_live == 0 and pool.cache.slots.num_free == pool.cache.num_slots
    return out[0].tolist()


PROMPT = 37


def prefill(family: str, endpoint: str) -> dict:
    """Prefill the prompt and ship it; what was shipped."""
    import kvarena as kv
    from kvarena.transfer.service import PrefillClient

    model, pool = _setup(family)
    ids = prompt(PROMPT)
    cache, first = pool.prefill_remote(model, ids)
    sender = kv.PrefillSender("prefill", pool.cache)
    client = PrefillClient(sender, endpoint)
    client.connect()
    blocks = list(cache.block_tables[0].blocks) if cache.block_tables else []
    slots = list(cache.slots[0][:1]) if cache.slots else []
    shipped = client.ship(REQUEST, blocks, slots)
    client.close()
    sender.close()
    pool.release(cache)
    return {
        "first": first,
        "descriptors": shipped.descriptors,
        "blocks": len(blocks),
        "slots": len(slots),
    }


def single(family: str, new_tokens: int) -> list[int]:
    model, _ = _setup(family)
    out = model.generate(prompt(PROMPT), max_new_tokens=new_tokens, do_sample=False)
    return out[0].tolist()


def _decode_proc(family, bind, new_tokens, conn, first) -> None:
    conn.send(decode(family, bind, new_tokens, conn.send, first.recv))


def _prefill_proc(family, endpoint, conn) -> None:
    conn.send(prefill(family, endpoint))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="qwen3_next")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--role", choices=("both", "decode", "prefill"), default="both")
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--endpoint")
    a = ap.parse_args()
    if a.role == "decode":
        out = decode(
            a.family,
            a.bind,
            a.tokens,
            lambda ep: print("endpoint", ep, flush=True),
            lambda: int(sys.stdin.readline()),
        )
        print("result", json.dumps({"tokens": out}), flush=True)
        return 0
    if a.role == "prefill":
        print("result", json.dumps(prefill(a.family, a.endpoint)), flush=True)
        return 0
    ctx = mp.get_context("spawn")
    d_recv, d_send = ctx.Pipe(False)
    p_recv, p_send = ctx.Pipe(False)
    f_recv, f_send = ctx.Pipe(False)
    dec = ctx.Process(target=_decode_proc, args=(a.family, a.bind, a.tokens, d_send, f_recv))
    dec.start()
    endpoint = d_recv.recv()
    pre = ctx.Process(target=_prefill_proc, args=(a.family, endpoint, p_send))
    pre.start()
    shipped = p_recv.recv()
    f_send.send(shipped["first"])
    tokens = d_recv.recv()
    pre.join(60)
    dec.join(60)
    want = single(a.family, a.tokens)
    same = tokens == want and tokens[PROMPT] == shipped["first"]
    print(
        f"{a.family}: {shipped['blocks']} blocks + {shipped['slots']} state slot(s) shipped in "
        f"{shipped['descriptors']} descriptors; "
        f"{a.tokens} tokens decoded in another process "
        f"{'equal' if same else 'DIFFER from'} a single-process generate"
    )
    return 0 if same and pre.exitcode == 0 and dec.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
