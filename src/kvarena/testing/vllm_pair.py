"""A vLLM engine in a process of its own, driven over a pipe: two of them are a
prefill and a decode engine on one machine.

vLLM keeps one KV connector per process (a global), so two engines that talk
to each other need two processes. Each runs the offline ``LLM`` in its own
process (``uni`` executor, no engine-core subprocess), built from
:func:`~kvarena.testing.vllm_engine.engine_args`; :meth:`EngineProcess.generate`
sends prompts with their ``kv_transfer_params`` and returns, per prompt, the
greedy tokens, ``num_cached_tokens`` and the ``kv_transfer_params`` vLLM
answered with.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import traceback
from dataclasses import dataclass
from typing import Any

from ..errors import Error
from .vllm_engine import freeze_heap

START_TIMEOUT_S = 300.0

PRELOADED = ("vllm.entrypoints.llm", "kvarena.integrations.vllm.connector", __name__)
"""What an engine's fork server imports once: vLLM's offline engine, kvarena's
connector, this module (settings vLLM reads as it is imported are the fork
server's: the caller's environment when the first engine started)."""


class EngineProcessError(Error, RuntimeError):
    """The engine's process failed, or did not answer in time; carries its message."""


@dataclass(frozen=True, kw_only=True)
class Answer:
    tokens: list[int]
    cached: int
    params: dict[str, Any] | None


def pd_books(llm: Any) -> dict[str, Any]:
    """What an engine's disaggregation halves hold (pass to :meth:`EngineProcess.call`):
    requests held for decode engines, the pulls finished so far and those that
    failed (recomputed), free blocks."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pd = scheduler.get_kv_connector()._pd
    worker = get_kv_transfer_group()._pd_worker
    return {
        "held": len(pd.offers),
        "pulls": [dataclasses.asdict(x) for x in worker.finished],
        "failed": worker.failures,
        "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
    }


def cold(llm: Any) -> bool:
    """Every save of an engine with tiers written and its scheduler told (a
    write's report rides on a later step: a one-token request takes a few),
    then its device cache emptied: what it hits next comes from its tiers.
    Pass to :meth:`EngineProcess.call`; True where the cache was emptied."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group()._worker.flush()
    params = SamplingParams(max_tokens=3, temperature=0, detokenize=False)
    llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
    return bool(llm.reset_prefix_cache())


def _serve(conn: Any, engine: dict[str, Any], env: dict[str, str], setup: Any) -> None:
    os.environ.update(env)
    try:
        if setup is not None:
            setup()
        from vllm import LLM, SamplingParams

        freeze_heap()
        llm = LLM(**engine)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        op, arg = conn.recv()
        if op == "stop":
            break
        try:
            if op == "generate":
                prompts, params, max_tokens = arg
                sampling = [
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=0,
                        detokenize=False,
                        extra_args={"kv_transfer_params": p} if p is not None else None,
                    )
                    for p in params
                ]
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False
                )
                conn.send(
                    (
                        "ok",
                        [
                            Answer(
                                tokens=list(o.outputs[0].token_ids),
                                cached=int(o.num_cached_tokens or 0),
                                params=o.kv_transfer_params,
                            )
                            for o in outs
                        ],
                    )
                )
            elif op == "call":  # a callable's result on the engine, in this process
                conn.send(("ok", arg(llm)))
            else:
                conn.send(("error", f"unknown op {op!r}"))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    llm.llm_engine.engine_core.shutdown()
    conn.send(("stopped", None))


class EngineProcess:
    """One offline engine in a process of its own (``engine``: ``LLM`` keyword arguments)."""

    def __init__(
        self,
        engine: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        setup: Any = None,
        wait: bool = True,
    ) -> None:
        """``env``: added to the process's environment; ``setup``: a picklable
        callable run in the process before vLLM is imported; ``wait``: return
        once the engine is ready (else :meth:`ready` says when)."""
        if setup is None:
            # Importing vLLM is most of an engine's start (~8 s of CPU here):
            # done once in the fork server, each engine forked from it. Takes
            # effect where this process's fork server is not running yet.
            ctx: Any = mp.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOADED))
        else:  # ``setup`` runs before vLLM is imported: a fresh interpreter
            ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # the caller's environment now (not the fork server's when it started)
        settings = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
        self.process = ctx.Process(
            target=_serve, args=(child, engine, settings, setup), daemon=False
        )
        self.process.start()
        child.close()
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until the engine serves (an error where it failed to start)."""
        self._wait("ready", START_TIMEOUT_S)

    @classmethod
    def many(
        cls, engines: list[dict[str, Any]], *, env: dict[str, str] | None = None
    ) -> list[EngineProcess]:
        """Engines started side by side (their starts overlap: most of a start
        is one process importing and loading alone), each ready on return;
        where one fails to start, every one is killed."""
        started = [cls(e, env=env, wait=False) for e in engines]
        try:
            for e in started:
                e.ready()
        except BaseException:
            for e in started:
                e.kill()
            raise
        return started

    def _wait(self, want: str, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise EngineProcessError(f"engine process gave no answer in {timeout_s:g} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            raise EngineProcessError(
                f"engine process died (exit code {self.process.exitcode})"
            ) from None
        if kind != want:
            raise EngineProcessError(f"engine process failed:\n{value}")
        return value

    def generate(
        self,
        prompts: list[list[int]],
        params: list[dict[str, Any] | None] | None = None,
        *,
        max_tokens: int = 12,
        timeout_s: float = 300.0,
    ) -> list[Answer]:
        self._conn.send(("generate", (prompts, params or [None] * len(prompts), max_tokens)))
        return self._wait("ok", timeout_s)

    def call(self, fn: Any, *, timeout_s: float = 60.0) -> Any:
        """``fn(llm)`` (a picklable callable) run in the engine's process."""
        self._conn.send(("call", fn))
        return self._wait("ok", timeout_s)

    def freeze(self) -> None:
        """SIGSTOP: an engine that stops answering, every thread of it."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: an engine that dies without a word."""
        self.process.kill()
        self.process.join()

    def _ask_stop(self) -> bool:
        """Ask the engine to shut down; whether it was asked (it was alive)."""
        if not self.process.is_alive():
            return False
        try:
            self._conn.send(("stop", None))
        except (OSError, BrokenPipeError):
            return False
        return True

    def stop(self, timeout_s: float = 60.0, *, asked: bool = False) -> None:
        """Shut the engine down (``asked``: :meth:`_ask_stop` was called), killed
        where it does not stop in ``timeout_s``."""
        if asked or self._ask_stop():
            try:
                self._wait("stopped", timeout_s)
            except (EngineProcessError, OSError, BrokenPipeError):
                pass
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.kill()

    @staticmethod
    def stop_all(engines: list[EngineProcess]) -> None:
        """Engines shut down side by side."""
        asked = [e._ask_stop() for e in engines]
        for e, a in zip(engines, asked, strict=True):
            e.stop(asked=a)
