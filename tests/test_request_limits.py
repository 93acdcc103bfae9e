"""Bounds applied before work: prompt and unit size, metadata, the token cache, chunked ingest, sampling values."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson
import pytest
import torch
from helpers.plane import plane_config

from tessera.config import RetrievalConfig
from tessera.config_file import load_config
from tessera.engines.checkpoint import resolve
from tessera.engines.sampling import Sampler
from tessera.engines.tokenizer import load_tokenizer, serving_fingerprint
from tessera.errors import BadRequest
from tessera.messages.generation import MIN_TOP_P, SamplingParams
from tessera.retrieval.chat.request import parse_chat_request
from tessera.retrieval.embedder import Embedder
from tessera.retrieval.limits import (
    INGEST_CHUNK_UNITS,
    MAX_CHARS_PER_TOKEN,
    check_body_size,
    check_metadata,
    check_prompt_chars,
)
from tessera.retrieval.node import RetrievalNode
from tessera.retrieval.store.unit_store import Ingested, UnitStore
from tessera.units import ContextUnit, TokenCache, UnitFactory


@pytest.mark.parametrize("temperature", [1e-6, 1e-20, 1e-38, 1e-45])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    """Regression: temperature in (0, 1e-37] gave NaN probabilities and a 503."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 20
    sampler = Sampler(SamplingParams(max_tokens=1, temperature=temperature, seed=1))
    assert sampler.pick(logits) == int(logits.argmax())


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-39])
def test_a_top_p_that_float32_cannot_hold_is_a_400_naming_it(top_p: float) -> None:
    """Regression: top_p <= 1e-300 became 0 in float32, filtered every token and answered 503."""
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
    with pytest.raises(BadRequest, match=r"top_p = .* send a top_p of at least 1\.18e-38") as exc:
        parse_chat_request({**body, "top_p": top_p}, default_top_k=5, default_placement="system", served_model="m")
    assert exc.value.status == 400
    ok = parse_chat_request({**body, "top_p": MIN_TOP_P}, default_top_k=5, default_placement="system",
                            served_model="m")
    assert ok.sampling.top_p == MIN_TOP_P


@pytest.mark.parametrize("top_p", [1e-300, MIN_TOP_P, 1e-9])
def test_a_top_p_below_every_probability_keeps_the_most_likely_token(top_p: float) -> None:
    """Regression: when top_p rounded to 0 in float32 the nucleus was empty (multinomial failed: 503)."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(SamplingParams(max_tokens=1, temperature=1.0, top_p=top_p, seed=3))
    assert [sampler.pick(logits) for _ in range(5)] == [int(logits.argmax())] * 5


def test_a_unit_too_long_for_max_unit_tokens_is_refused_without_tokenizing() -> None:
    """Regression: a 20 MB unit was tokenized (4.19 M tokens, 24.7 s on the worker) before its 413."""
    config = load_config()
    checkpoint = resolve(config.model)
    tokenizer = load_tokenizer(checkpoint)
    tokenized: list[int] = []  # characters handed to the tokenizer

    def encode(text: str) -> list[int]:
        tokenized.append(len(text))
        return list(tokenizer.encode(text))

    factory = UnitFactory(serving_fingerprint(config, checkpoint, tokenizer), TokenCache(encode))
    store = UnitStore(factory, Embedder(), RetrievalConfig(max_unit_tokens=64))
    try:
        with pytest.raises(BadRequest, match=r"units\[0\]\.text has 20000000 characters, more than "
                                             r"retrieval\.max_unit_tokens = 64 tokens can hold") as exc:
            store.identify("kb", "x" * 20_000_000, "units[0]")
        assert exc.value.status == 413 and tokenized == []
        assert store.identify("kb", "a short unit", "units[0]").n_tokens > 0 and tokenized == [12]
    finally:
        store.close()


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    """More characters than the context can hold at MAX_CHARS_PER_TOKEN per token: 400, nothing tokenized."""
    check_prompt_chars(["x" * (100 * MAX_CHARS_PER_TOKEN)], 100)
    with pytest.raises(BadRequest, match="more than the model's context of 100 tokens"):
        check_prompt_chars(["x" * (50 * MAX_CHARS_PER_TOKEN), "y" * (50 * MAX_CHARS_PER_TOKEN + 1)], 100)


def test_an_oversized_chat_body_is_a_413() -> None:
    check_body_size(None)
    check_body_size(1 << 20)
    with pytest.raises(BadRequest) as exc:
        check_body_size(1 << 30)
    assert exc.value.status == 413


def test_metadata_is_bounded_in_depth_and_size() -> None:
    """Regression: depth >= 255 was accepted and could never be encoded again (retrieve answered 500)."""
    ok: Any = 1
    for _ in range(16):
        ok = {"k": ok}
    check_metadata("units[0]", ok)
    deep: Any = [ok]
    with pytest.raises(BadRequest, match="nested more than 16 levels"):
        check_metadata("units[0]", {"a": deep})
    too_deep: Any = 1
    for _ in range(300):
        too_deep = {"k": too_deep}
    with pytest.raises(orjson.JSONEncodeError):
        orjson.dumps(too_deep)  # what the retrieve reply used to hit
    with pytest.raises(BadRequest, match="units\\[3\\]"):
        check_metadata("units[3]", too_deep)
    with pytest.raises(BadRequest, match="bytes as JSON"):
        check_metadata("units[0]", {"blob": "x" * (1 << 20)})


def test_the_token_cache_is_bounded_in_bytes() -> None:
    """Regression: a 20 MB prompt's tokens stayed in the cache for good (+2 GB RSS)."""
    cache = TokenCache(lambda s: list(range(len(s))), capacity=1 << 20, capacity_bytes=1 << 20)
    for i in range(2000):
        cache.tokens(f"{i:08d}" * 50)
    assert cache.nbytes <= cache.capacity_bytes
    assert 0 < len(cache) < 2000
    huge = "z" * (1 << 20)
    assert len(cache.tokens(huge)) == 1 << 20
    assert cache.nbytes <= cache.capacity_bytes and cache.tokens(huge) and cache.misses == 2002


class _SlowStore:
    """A unit store whose ingest takes a while per call, recording what overlapped it."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def ingest(self, items: list[Any], embeddings: Any, external_ids: Any, tenant: str = "") -> Ingested:
        self.calls.append(len(items))
        time.sleep(0.02)
        return Ingested([(ContextUnit(f"{scope}:{text}", scope, text, ()), True) for scope, text, _ in items])

    def retrieve(self, scope: str, **kw: Any) -> list[Any]:
        return [f"hits of {scope}"]


async def test_a_big_ingest_runs_in_chunks_and_retrieval_is_served_between_them() -> None:
    """Regression: one /v1/units call with 4,096 units held the worker and blocked every chat for 111 s."""
    node = RetrievalNode(plane_config())
    store = _SlowStore()
    node.pool = store  # type: ignore[assignment]
    node._executor = ThreadPoolExecutor(max_workers=1)
    try:
        n = 20 * INGEST_CHUNK_UNITS
        ingest = asyncio.ensure_future(node.ingest([("s", f"t{i}", {}) for i in range(n)]))
        await asyncio.sleep(0.05)
        assert await node.retrieve("s", query="q") == ["hits of s"]
        assert not ingest.done()  # the retrieve did not wait for the whole ingest
        assert len((await ingest).units) == n
        assert max(store.calls) == INGEST_CHUNK_UNITS
    finally:
        node._executor.shutdown()
