"""No silent ignores: walks the request schemas of the official SDKs (the `openai` package's
create-params TypedDicts for chat completions, completions, embeddings and responses; the
`anthropic` package's for messages) and checks each field's class on the server:

- refused: the sample value (one that changes the output) gets a 400 naming the field;
- honoured or of no meaning here: accepted (no 400 naming it, no unknown-field warning).

A field the SDK gained since this table was written fails the test until it is classified here
and in `crates/server/src/protocol/fields.rs` (and docs/server.md)."""
import typing

import anthropic.types.message_create_params as messages_params
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.embedding_create_params as embedding_params
import openai.types.responses.response_create_params as responses_params
import pytest

MSGS = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# field: (class, sample). Classes: "honoured", "none" (no meaning here), "refused".
CHAT = {
    "audio": ("refused", {"voice": "alloy", "format": "wav"}),
    "frequency_penalty": ("honoured", 0.1),
    "function_call": ("refused", {"name": "f"}),
    "functions": ("refused", [{"name": "f", "parameters": {}}]),
    "logit_bias": ("honoured", {"1": 0.5}),
    "logprobs": ("honoured", True),
    "max_completion_tokens": ("honoured", 2),
    "max_tokens": ("honoured", 2),
    "messages": ("honoured", MSGS),
    "metadata": ("none", {"k": "v"}),
    "modalities": ("refused", ["text", "audio"]),
    "model": ("none", "any-model"),
    "moderation": ("refused", {"enabled": True}),
    "n": ("honoured", 2),
    "parallel_tool_calls": ("honoured", False),
    "prediction": ("none", {"type": "content", "content": "Hello"}),
    "presence_penalty": ("honoured", 0.1),
    "prompt_cache_key": ("none", "k"),
    "prompt_cache_options": ("none", {}),
    "prompt_cache_retention": ("none", "24h"),
    "reasoning_effort": ("honoured", "low"),
    "response_format": ("honoured", {"type": "json_object"}),
    "safety_identifier": ("none", "s"),
    "seed": ("honoured", 1),
    "service_tier": ("none", "auto"),
    "stop": ("honoured", ["zzz"]),
    "store": ("none", False),
    "stream": ("honoured", False),
    "stream_options": ("honoured", {"include_usage": True}),
    "temperature": ("honoured", 0.5),
    "tool_choice": ("honoured", "none"),
    "tools": ("honoured", [TOOL]),
    "top_logprobs": ("honoured", 2),
    "top_p": ("honoured", 0.9),
    "user": ("none", "u"),
    "verbosity": ("refused", "low"),
    "web_search_options": ("refused", {}),
}

COMPLETIONS = {
    "best_of": ("refused", 3),
    "echo": ("refused", True),
    "frequency_penalty": ("honoured", 0.1),
    "logit_bias": ("honoured", {"1": 0.5}),
    "logprobs": ("honoured", 2),
    "max_tokens": ("honoured", 2),
    "model": ("none", "any-model"),
    "n": ("honoured", 2),
    "presence_penalty": ("honoured", 0.1),
    "prompt": ("honoured", "Once upon a time"),
    "seed": ("honoured", 1),
    "stop": ("honoured", "zzz"),
    "stream": ("honoured", False),
    "stream_options": ("honoured", {"include_usage": True}),
    "suffix": ("refused", "The end."),
    "temperature": ("honoured", 0.5),
    "top_p": ("honoured", 0.9),
    "user": ("none", "u"),
}

EMBEDDINGS = {
    "dimensions": ("honoured", 384),
    "encoding_format": ("honoured", "float"),
    "input": ("honoured", "hello"),
    "model": ("none", "m"),
    "user": ("none", "u"),
}

RESPONSES = {
    "access_programs": ("refused", ["p"]),
    "background": ("refused", True),
    "context_management": ("refused", [{"type": "compaction"}]),
    "conversation": ("refused", "conv_1"),
    "image": ("refused", {"size": "1024x1024"}),
    "include": ("none", ["reasoning.encrypted_content"]),
    "input": ("honoured", "Hi"),
    "instructions": ("honoured", "Be terse."),
    "max_output_tokens": ("honoured", 16),
    "max_tool_calls": ("none", 2),
    "metadata": ("none", {"k": "v"}),
    "model": ("honoured", "m"),
    "moderation": ("refused", {"enabled": True}),
    "parallel_tool_calls": ("none", True),
    "previous_response_id": ("honoured", None),
    "prompt": ("refused", {"id": "pmpt_1"}),
    "prompt_cache_key": ("none", "k"),
    "prompt_cache_options": ("none", {}),
    "prompt_cache_retention": ("none", "24h"),
    "reasoning": ("honoured", {"effort": "low"}),
    "safety_identifier": ("none", "s"),
    "service_tier": ("none", "auto"),
    "store": ("honoured", False),
    "stream": ("honoured", False),
    "stream_options": ("none", {"include_obfuscation": False}),
    "temperature": ("honoured", 0.5),
    "text": ("honoured", {"format": {"type": "json_object"}}),
    "tool_choice": ("honoured", "none"),
    "tools": ("honoured", [{"type": "function", "name": "f", "parameters": {"type": "object"}}]),
    "top_logprobs": ("refused", 2),
    "top_p": ("honoured", 0.9),
    "truncation": ("refused", "auto"),
    "user": ("none", "u"),
}

MESSAGES = {
    "cache_control": ("none", {"type": "ephemeral"}),
    "container": ("refused", "container_1"),
    "diagnostics": ("none", {}),
    "inference_geo": ("none", "us"),
    "max_tokens": ("honoured", 16),
    "messages": ("honoured", MSGS),
    "metadata": ("none", {"user_id": "u"}),
    "model": ("honoured", "m"),
    "output_config": ("honoured", {"format": {"type": "json_schema", "schema": {"type": "object"}}}),
    "service_tier": ("none", "auto"),
    "speed": ("none", "fast"),
    "stop_sequences": ("honoured", ["zzz"]),
    "system": ("honoured", "Be terse."),
    "thinking": ("honoured", {"type": "disabled"}),
    "tool_choice": ("honoured", {"type": "auto"}),
    "tools": ("honoured", [{"name": "f", "input_schema": {"type": "object"}}]),
    "user_profile_id": ("none", "up_1"),
    "workspace_id": ("none", "wrkspc_1"),
    "stream": ("honoured", False),
    "temperature": ("honoured", 0.5),
    "top_p": ("honoured", 0.9),
    "top_k": ("honoured", 5),
}

ENDPOINTS = [
    ("/v1/chat/completions", chat_params.CompletionCreateParamsBase, CHAT, {"messages": MSGS, "max_tokens": 2}),
    ("/v1/completions", completion_params.CompletionCreateParamsBase, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/embeddings", embedding_params.EmbeddingCreateParams, EMBEDDINGS, {"input": "hello"}),
    ("/v1/responses", responses_params.ResponseCreateParamsBase, RESPONSES, {"input": "Hi", "max_output_tokens": 16}),
    ("/v1/messages", messages_params.MessageCreateParamsBase, MESSAGES, {"messages": MSGS, "max_tokens": 16, "model": "m"}),
]


def sdk_fields(params, path):
    # `stream` lives in the streaming / non-streaming variants of the create params.
    extra = set() if path == "/v1/embeddings" else {"stream"}
    return set(typing.get_type_hints(params, include_extras=False)) | extra


@pytest.mark.parametrize("path,params,table,base", ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_every_sdk_field_is_classified(path, params, table, base):
    missing = sorted(sdk_fields(params, path) - set(table))
    assert not missing, f"{path}: SDK fields without a class: {missing}"


def cases():
    for path, _, table, base in ENDPOINTS:
        for field, (cls, sample) in sorted(table.items()):
            yield pytest.param(path, base, field, cls, sample, id=f"{path}:{field}")


@pytest.mark.parametrize("path,base,field,cls,sample", list(cases()))
def test_field_class_on_the_server(server, http, path, base, field, cls, sample):
    r = http.post(path, json={**base, field: sample})
    body = r.json()
    if path == "/v1/messages":
        message = body.get("error", {}).get("message", "") if r.status_code >= 400 else ""
        named = r.status_code == 400 and field in message
    else:
        error = body.get("error") or {}
        param = (error.get("param") or "").split(".")[0]
        named = r.status_code == 400 and (param == field or f"{field}:" in error.get("message", ""))
        # The fast model is not an embedding model: /v1/embeddings answers model_not_supported.
        named = named and error.get("code") != "model_not_supported"
    if cls == "refused":
        assert named, f"{field} should be refused: {r.status_code} {r.text[:300]}"
    else:
        assert r.status_code < 500 and not named, f"{field}: {r.status_code} {r.text[:300]}"
        if path != "/v1/embeddings":  # the fast model is not an embedding model: 400 model_not_supported
            assert r.status_code == 200, f"{field}: {r.text[:300]}"
    assert not any(f'unknown request field "{field}"' in l for l in server.stderr), f"{field} counted as unknown"
