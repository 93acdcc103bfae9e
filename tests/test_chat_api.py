"""The OpenAI-compatible bodies: one validator, one error shape, a schema, openai-parsable replies."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import pytest
from helpers.cluster import cluster_config
from openai import OpenAI
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk

from tessera.errors import BadRequest, NotLeader, Unavailable
from tessera.messages.generation import SamplingParams
from tessera.retrieval.chat.driver import NodeFailed
from tessera.retrieval.chat.generation_client import NodeClients, NodeUnavailable
from tessera.retrieval.chat.refusal import refusal
from tessera.retrieval.chat.request import ChatRequest, parse_chat_request
from tessera.retrieval.chat.response import (
    Delta,
    PromptTokensDetails,
    Usage,
    chunk_body,
    completion_body,
    error_body,
    openapi_document,
    to_json,
)

USER = [{"role": "user", "content": "hi"}]


def parse(body: object) -> ChatRequest:
    return parse_chat_request(body, default_top_k=5, default_placement="system", served_model="m")


def test_the_validator_builds_the_sampling_params() -> None:
    """OpenAI's sampling fields become the SamplingParams sent to the generation node."""
    chat = parse({"messages": USER, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                  "ignore_eos": True, "logprobs": True, "top_logprobs": 4})
    assert chat.sampling == SamplingParams(max_tokens=7, temperature=0.0, top_p=0.5, seed=3, ignore_eos=True,
                                           top_logprobs=4)
    assert parse({"messages": USER}).sampling == SamplingParams(max_tokens=16, temperature=1.0, top_logprobs=-1)


def test_every_validation_error_is_reported_at_once_naming_its_field() -> None:
    """Three mistakes give one 400 whose message names all three fields."""
    with pytest.raises(BadRequest) as info:
        parse({"messages": [{"role": "wizard", "content": "x"}], "temperature": 3, "max_tokens": 0})
    message = str(info.value)
    assert info.value.status == 400
    for field in ("messages[0].role", "temperature", "max_tokens"):
        assert field in message


def test_retrieval_defaults_come_from_the_config() -> None:
    """top_k and scope fall back to the cluster's default and the request's scope."""
    chat = parse({"messages": USER, "scope": "team", "retrieval": {"query": "ferry"}})
    assert chat.retrieval is not None
    assert (chat.retrieval.top_k, chat.retrieval.scope) == (5, "team")


def test_errors_have_the_openai_shape() -> None:
    """An error body is {"error": {message, type, code}}, typed by status."""
    assert json.loads(to_json(error_body("fix it", 400))) == {
        "error": {"message": "fix it", "type": "invalid_request_error", "code": 400}}
    assert json.loads(to_json(error_body("later", 429)))["error"]["type"] == "rate_limit_error"
    assert json.loads(to_json(error_body("down", 503)))["error"]["type"] == "server_error"


def _usage() -> Usage:
    return Usage(prompt_tokens=10, completion_tokens=2, total_tokens=12,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=6), tessera={"local_tokens": 6, "node": "g"})


def test_replies_parse_with_the_official_openai_types() -> None:
    """Completions and chunks (content, final, usage) are valid openai-python objects."""
    done = OpenAIChatCompletion.model_validate_json(to_json(completion_body("id1", "m", "hello", "length", _usage())))
    assert done.choices[0].message.content == "hello"
    assert done.usage is not None and done.usage.prompt_tokens_details is not None
    assert done.usage.prompt_tokens_details.cached_tokens == 6
    lp = [{"token": "a", "logprob": -0.1, "bytes": [97], "token_id": 5,
           "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97], "token_id": 5}]}]
    content = OpenAIChatCompletionChunk.model_validate_json(
        to_json(chunk_body("id1", "m", Delta(content="a"), None, logprobs=lp)))
    assert content.choices[0].delta.content == "a" and content.choices[0].logprobs is not None
    usage = OpenAIChatCompletionChunk.model_validate_json(to_json(chunk_body("id1", "m", None, None, _usage())))
    assert usage.choices == [] and usage.usage is not None and usage.usage.total_tokens == 12


def test_absent_fields_are_omitted_but_a_chunks_finish_reason_is_null() -> None:
    """No logprobs, usage or layout keys unless asked; finish_reason is sent as null, as OpenAI does."""
    chunk = json.loads(to_json(chunk_body("id1", "m", Delta(content="x"), None)))
    assert set(chunk) == {"id", "object", "created", "model", "choices"}
    assert chunk["choices"][0] == {"index": 0, "delta": {"content": "x"}, "finish_reason": None}
    done = json.loads(to_json(completion_body("id1", "m", "x", "stop", _usage())))
    assert "logprobs" not in done["choices"][0] and "tessera_layout" not in done


def test_the_openapi_document_describes_the_chat_endpoint() -> None:
    """/openapi.json's document has the chat path and the request schema with Tessera's extensions."""
    doc = openapi_document("Tessera")
    post = doc["paths"]["/v1/chat/completions"]["post"]
    ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    request_schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "retrieval", "context_units", "temperature"} <= set(request_schema["properties"])
    assert {"200", "400", "429", "503"} <= set(post["responses"])
    json.dumps(doc)  # serializable as it is served


def test_a_misspelt_field_is_refused_naming_the_nearest_known_one() -> None:
    """Regression: "context_unit" was ignored and the chat served without its unit (a 200, a wrong answer)."""
    with pytest.raises(BadRequest) as info:
        parse({"messages": USER, "context_unit": ["Security memo: the vault code is 7421."]})
    assert info.value.status == 400
    assert str(info.value) == "unknown field 'context_unit' (did you mean 'context_units'?)"


@pytest.mark.parametrize(("body", "message"), [
    ({"context_units": [{"text": "a", "scop": "team"}]},
     "context_units[0]: unknown field 'scop' (did you mean 'scope'?)"),
    ({"retrieval": {"query": "q", "topk": 3}}, "retrieval: unknown field 'topk' (did you mean 'top_k'?)"),
    ({"stream": True, "stream_options": {"include_usge": True}},
     "stream_options: unknown field 'include_usge' (did you mean 'include_usage'?)"),
])
def test_unknown_fields_of_tessera_objects_are_refused_where_they_are(body: dict[str, object], message: str) -> None:
    """A misspelt scope or top_k inside an object would silently fall back to the default: refused, located."""
    with pytest.raises(BadRequest) as info:
        parse({"messages": USER, **body})
    assert str(info.value) == message


def test_openai_bookkeeping_is_accepted_and_unimplemented_fields_only_when_neutral() -> None:
    """user, metadata, store ... change nothing and pass; frequency_penalty or tools pass only as null or neutral."""
    neutral = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
               "prompt_cache_key": "p", "parallel_tool_calls": True, "frequency_penalty": 0, "presence_penalty": None,
               "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    assert parse({"messages": USER, **neutral}).sampling == parse({"messages": USER}).sampling
    for field, value in (("frequency_penalty", 0.5), ("tools", [{"type": "function"}]), ("reasoning_effort", "low")):
        with pytest.raises(BadRequest, match=f"^{field}: this server does not implement it"):
            parse({"messages": USER, field: value})


def test_allow_unknown_fields_ignores_vendor_fields_as_documented() -> None:
    """retrieval.allow_unknown_fields: unknown and unimplemented fields are ignored, the rest is still checked."""
    body = {"messages": USER, "vendor_trace": {"id": 1}, "frequency_penalty": 0.5,
            "context_units": [{"text": "a", "weight": 2}]}
    chat = parse_chat_request(body, default_top_k=5, default_placement="system", served_model="m",
                              allow_unknown=True)
    assert [u.text for u in chat.units] == ["a"]
    with pytest.raises(BadRequest, match="temperature"):
        parse_chat_request({**body, "temperature": 9}, default_top_k=5, default_placement="system",
                           served_model="m", allow_unknown=True)


@pytest.mark.parametrize("stream", [False, True])
def test_what_the_official_openai_client_sends_is_accepted(stream: bool) -> None:
    """The openai client's own bodies (sampling fields, extra_body, streaming options) pass the closed validator."""
    sent: list[dict[str, object]] = []

    def server(request: httpx2.Request) -> httpx2.Response:
        sent.append(json.loads(request.content))
        if stream:
            return httpx2.Response(200, text="data: [DONE]\n\n", headers={"Content-Type": "text/event-stream"})
        return httpx2.Response(200, content=to_json(completion_body("id1", "m", "ok", "stop", _usage())),
                              headers={"Content-Type": "application/json"})

    client = OpenAI(base_url="http://tessera.test/v1", api_key="k", max_retries=0,
                    http_client=httpx2.Client(transport=httpx2.MockTransport(server)))
    kwargs: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, top_p=0.9, seed=1,
        stop=["\n"], user="u1", logprobs=True, top_logprobs=2, stream=stream,
        extra_body={"context_units": ["a record"], "unit_placement": "user", "scope": "s", "return_layout": True},
        **kwargs)
    if stream:
        list(out)  # type: ignore[arg-type]
    (body,) = sent
    chat = parse(body)
    assert (chat.stream, chat.max_tokens, [u.text for u in chat.units]) == (stream, 4, ["a record"])


async def test_a_failure_inside_the_cluster_reaches_the_client_without_urls_or_exception_text() -> None:
    """Regression: a 503 showed a client an internal URL and a raw Python exception (a node out of reach,
    the leader's control plane out of reach during a failover); the server log keeps the details."""
    nodes = NodeClients(cluster_config(nodes=1))  # gen0's port: free, nothing listens
    try:
        with pytest.raises(NodeUnavailable) as unreachable:
            await nodes._snapshot("gen0", "r1", [])
    finally:
        await nodes.close()
    failover = NotLeader("the leader's control plane at http://127.0.0.1:8401 cannot be reached (POST "
                         "http://127.0.0.1:8401/control/route failed: ClientConnectorError(...)); retry", 1)
    for exc in (unreachable.value, failover, NodeFailed("generation node gen0 failed: KeyError: 'x'")):
        told = refusal(exc, retry_after_s=1)
        assert told.status == 503 and told.retry_after_s == 1, told
        for leak in ("http://", "127.0.0.1", "Error", "Exception"):
            assert leak not in told.message, (leak, told.message)
    said = "no generation node is alive (tried: gen0); retry when one reports in"  # written for the client
    assert refusal(Unavailable(said)).message == said
