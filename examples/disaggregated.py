"""Prefill -> decode over NIXL with the ZeroMQ control channel, in two processes.

    python examples/disaggregated.py

The decode process owns a unified cache, a DecodeReceiver and a DecodeService;
the prefill process fills a request's KV blocks and state, connects with a
PrefillClient and ships it. The decode side then checks the bytes.
"""

import multiprocessing as mp

import torch

import kvarena as kv

MODEL = kv.model_cache("qwen3-next-80b-a3b", kv.ServingOptions(tp=8))
# Both sides plan the same way (each could size its own budget: counts may
# differ between them, layouts may not).
PLAN = kv.plan_cache(MODEL, budget_bytes=64 << 20, max_seqs=4, clamp=False)


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def decode_main(endpoint_out, done) -> None:
    from kvarena.transfer.service import DecodeService

    cache = kv.UnifiedCache.from_plan(PLAN, "cpu")
    receiver = kv.DecodeReceiver("decode", cache)
    service = DecodeService(receiver)  # tcp://127.0.0.1:<any free port>
    endpoint_out.send(service.endpoint)
    service.serve(until=lambda: "req-0" in receiver.ready)
    p = receiver.ready["req-0"]
    ok = all(
        torch.equal(cache.block_bytes_of(b), pattern(i, cache.block_bytes))
        for i, b in enumerate(p.blocks)
    )
    ok &= torch.equal(cache.slot_bytes_of(p.slots[0]), pattern(99, cache.slot_bytes))
    done.send(ok)
    service.close()
    receiver.close()


def prefill_main(endpoint: str, result) -> None:
    from kvarena.transfer.service import PrefillClient

    cache = kv.UnifiedCache.from_plan(PLAN, "cpu")
    blocks = cache.blocks.allocate(8)  # a 128-token prompt's KV
    slot = cache.allocate_slots("req-0")[0]
    for i, b in enumerate(blocks):
        cache.block_bytes_of(b).copy_(pattern(i, cache.block_bytes))
    cache.slot_bytes_of(slot).copy_(pattern(99, cache.slot_bytes))
    sender = kv.PrefillSender("prefill", cache)
    client = PrefillClient(sender, endpoint)
    client.connect()  # both sides compare layouts before any byte moves
    shipped = client.ship("req-0", blocks, [slot])
    result.send(shipped.descriptors)
    client.close()
    sender.close()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ep_recv, ep_send = ctx.Pipe(False)
    ok_recv, ok_send = ctx.Pipe(False)
    res_recv, res_send = ctx.Pipe(False)
    decode = ctx.Process(target=decode_main, args=(ep_send, ok_send))
    decode.start()
    prefill = None
    # This process keeps no writing end of a pipe: a side that dies before it
    # answers is an EOFError here, not a wait forever.
    ep_send.close()
    ok_send.close()
    try:
        prefill = ctx.Process(target=prefill_main, args=(ep_recv.recv(), res_send))
        prefill.start()
        res_send.close()
        descriptors, ok = res_recv.recv(), ok_recv.recv()
    except EOFError:
        for side in (decode, prefill):
            if side is not None:
                side.kill()  # the one still waiting (a dead one keeps its code)
                side.join()
        codes = [side.exitcode if side is not None else "not started" for side in (prefill, decode)]
        raise SystemExit(
            f"a side died before it answered (prefill, decode exit codes: {codes})"
        ) from None
    prefill.join(30)
    decode.join(30)
    print(f"shipped req-0 in {descriptors} descriptors; byte-exact on the decode side: {ok}")
    raise SystemExit(0 if ok and prefill.exitcode == 0 and decode.exitcode == 0 else 1)
