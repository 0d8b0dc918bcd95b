"""KvarenaConnector through the real vLLM engine with ``cache_salt``: the tenant
isolation vLLM's own prefix cache gives salted requests holds in the tiers.
A request hits only what a request of the same salt saved — in the same
engine or one restarted on the same disk — never what another salt or no salt
saved. Engines in this process, as in ``test_vllm_connector.py``; runs in
``.venv-vllm``, skipped where vLLM is not installed.
"""

from __future__ import annotations

import random

import pytest

vllm = pytest.importorskip("vllm")

from vllm_offline import CASES, close, engine, tiny_models, worker_connector  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_in_process")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("models"), ("llama", "qwen3_next"))


@pytest.mark.parametrize(("kind", "block_size"), CASES)
def test_a_salted_prompt_hits_only_what_its_own_salt_saved(models, tmp_path, kind, block_size):
    """One prompt computed under salt ``a``; with the device cache reset before
    each ask, salt ``b`` and no salt get 0 cached tokens from the tiers, salt
    ``a`` its whole hit (all but the last token, or the last boundary for the
    hybrid); after a restart the same, salt ``c`` 0. Tokens equal throughout."""
    from vllm import SamplingParams

    block = block_size or 256
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(3 * block + 9)]
    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    hit = len(prompt) - 1 if kind == "llama" else 3 * block

    def ask(llm, salt: str | None) -> tuple[list[int], int]:
        llm.reset_prefix_cache()  # vLLM's own cache holds nothing: the tiers answer
        request = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        (out,) = llm.generate([request], params, use_tqdm=False)
        return list(out.outputs[0].token_ids), out.num_cached_tokens

    tiers = [f"disk:{tmp_path / 'disk'}:64MiB"]
    llm = engine(models[kind], block_size=block_size, tiers=tiers)
    try:
        tokens, cached = ask(llm, "a")
        assert cached == 0 and len(tokens) == 8
        worker_connector()._worker.flush()
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)  # the save reported
        asked = {salt: ask(llm, salt) for salt in ("b", None, "a")}
        assert asked == {"b": (tokens, 0), None: (tokens, 0), "a": (tokens, hit)}
    finally:
        close(llm)
    restarted = engine(models[kind], block_size=block_size, tiers=tiers)
    try:
        assert ask(restarted, "a") == (tokens, hit)
        assert ask(restarted, "c") == (tokens, 0)
    finally:
        close(restarted)
