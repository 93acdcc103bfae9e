"""The OpenAI-compatible bodies: one validator, one error shape, a schema, openai-parsable replies."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion as OpenAIChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk

from tessera.errors import BadRequest
from tessera.messages.generation import SamplingParams
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
