"""Structured output through the server (issue 33): response_format (JSON mode, JSON schema,
the openai SDK's `parse` with a Pydantic model), vLLM's guided_* and structured_outputs,
llama-server's json_schema and GBNF grammar, Anthropic's output_config.format, the Responses API's text.format,
forced tool calls; the outputs of the real (tiny) model parse and match what was asked, greedy
and sampled, with `n` choices, streamed; jump-forward on and off give the same greedy text;
bad constraints are 400s naming the field."""
import json
import re

import httpx
import pydantic
import pytest

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "enum": ["France", "Spain", "Italy"]},
        "population": {"type": "integer", "minimum": 0},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "coastal"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe the city of Paris as JSON."}]


def check_city(text):
    """The text is one JSON object valid under CITY (checked by hand: no jsonschema needed)."""
    v = json.loads(text)
    assert set(v) == set(CITY["required"]), v
    assert isinstance(v["city"], str) and len(v["city"]) <= 30
    assert v["country"] in ("France", "Spain", "Italy")
    assert isinstance(v["population"], int) and not isinstance(v["population"], bool) and v["population"] >= 0
    assert isinstance(v["coastal"], bool)
    return v


def schema_format(schema=CITY):
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def chat(client, **kw):
    kw.setdefault("model", "m")
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(**kw)


def test_json_schema_greedy_and_sampled(client):
    r = chat(client, response_format=schema_format())
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    check_city(r.choices[0].message.content)
    r = chat(client, response_format=schema_format(), temperature=1.0, seed=7, n=4)
    assert len(r.choices) == 4
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        check_city(c.message.content)


def test_json_object(client):
    r = chat(client, response_format={"type": "json_object"}, temperature=0.8, seed=3)
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # ran out of tokens inside the object: still a prefix of an object
        assert c.message.content.lstrip().startswith("{")


def test_sdk_parse_with_a_pydantic_model(client):
    # Bounded fields: the 135M model would otherwise list languages until max_tokens.
    class Country(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=40)
        capital: str = pydantic.Field(max_length=40)
        languages: list[str] = pydantic.Field(max_length=3)

    r = client.chat.completions.parse(
        model="m", max_tokens=150, response_format=Country,
        messages=[{"role": "user", "content": "Describe France."}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Country), r.choices[0].message.content
    assert parsed.name and len(parsed.languages) <= 3


def test_streamed_json_schema(client):
    chunks = list(chat(client, response_format=schema_format(), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check_city(text)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,4}/'},
     lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t)),
    ({"guided_json": CITY}, check_city),
    ({"json_schema": CITY}, check_city),
])
def test_guided_fields(client, extra, check):
    r = chat(client, extra_body=extra)
    c = r.choices[0]
    assert c.finish_reason == "stop", c.message.content
    assert check(c.message.content), c.message.content


# llama.cpp's grammars/list.gbnf, verbatim.
LIST_GBNF = r"""root ::= item+

# Excludes various line break characters
item ::= "- " [^\r\n\x0b\x0c\x85\u2028\u2029]+ "\n"
"""
LIST_ITEM = "- [^\r\n\x0b\x0c\x85\u2028\u2029]+\n"


def test_gbnf_grammar_chat(client):
    """llama-server's `grammar` (GBNF): a yes/no grammar, and llama.cpp's list.gbnf (the
    output may run to max_tokens: then it is a prefix of a list)."""
    r = chat(client, extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content in ("yes.", "no."), r.choices[0].message.content
    r = chat(client, messages=[{"role": "user", "content": "List three fruits."}], max_tokens=40,
             extra_body={"grammar": LIST_GBNF})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert re.fullmatch(f"({LIST_ITEM})+", c.message.content), c.message.content
    else:
        assert c.finish_reason == "length"
        assert re.fullmatch(f"({LIST_ITEM})*(-|- {LIST_ITEM[2:-2]}*)?", c.message.content), c.message.content


def test_gbnf_recursive_grammar_completions(client):
    """A recursive GBNF grammar (one-character lexemes under the hood) on /v1/completions:
    balanced parentheses around one x, or a prefix of that when max_tokens cuts it."""
    r = client.completions.create(model="m", prompt="Nested parentheses: ", max_tokens=24,
                                  extra_body={"grammar": 'root ::= "(" root ")" | "x"'})
    c = r.choices[0]
    m = re.fullmatch(r"(\(*)(x?)(\)*)", c.text)
    assert m, c.text
    if c.finish_reason == "stop":
        assert m.group(2) == "x" and len(m.group(1)) == len(m.group(3)), c.text
    else:
        assert len(m.group(3)) <= len(m.group(1)), c.text


def test_completions_endpoint(client):
    r = client.completions.create(model="m", prompt="My phone number is ", max_tokens=20,
                                  extra_body={"guided_regex": r"\+?[0-9 ]{7,14}"})
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\+?[0-9 ]{7,14}", r.choices[0].text), r.choices[0].text


def test_jump_forward_on_and_off_give_the_same_text(client, server):
    # Long fixed keys: jump-forward appends them without sampling.
    schema = {"type": "object", "properties": {
        "the_name_of_the_city_being_described": {"type": "string", "maxLength": 20},
        "the_country_that_the_city_belongs_to": {"type": "string", "maxLength": 20}},
        "required": ["the_name_of_the_city_being_described", "the_country_that_the_city_belongs_to"],
        "additionalProperties": False}
    on = chat(client, response_format=schema_format(schema))
    off = chat(client, response_format=schema_format(schema), extra_body={"jump_forward": False})
    assert on.choices[0].message.content == off.choices[0].message.content
    assert on.usage.completion_tokens == off.usage.completion_tokens
    json.loads(on.choices[0].message.content)


def test_forced_tool_call_arguments_follow_the_schema(client):
    tools = [{"type": "function", "function": {"name": "book_flight", "parameters": {
        "type": "object", "properties": {
            "origin": {"type": "string", "maxLength": 20}, "destination": {"type": "string", "maxLength": 20},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["origin", "destination", "passengers"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "Book a flight from Paris to Rome for two people."}]
    # One call each (the 135M model, allowed parallel calls, goes on calling until max_tokens).
    for choice in ["required", {"type": "function", "function": {"name": "get_time"}}]:
        for kw in [{}, {"temperature": 1.0, "seed": 11}]:
            r = chat(client, messages=ask, tools=tools, tool_choice=choice, parallel_tool_calls=False, **kw)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c.message
            for tc in c.message.tool_calls:
                args = json.loads(tc.function.arguments)
                if tc.function.name == "book_flight":
                    assert set(args) == {"origin", "destination", "passengers"} and 1 <= args["passengers"] <= 9
                else:
                    assert tc.function.name == "get_time" and args["zone"] in ("UTC", "CET")
            if isinstance(choice, dict):
                assert [tc.function.name for tc in c.message.tool_calls] == ["get_time"]
    # Parallel calls (the default): every complete call parses into a declared function's arguments.
    r = chat(client, messages=ask, tools=tools, tool_choice="required", max_tokens=200)
    calls = r.choices[0].message.tool_calls
    assert calls and all(tc.function.name in ("book_flight", "get_time") for tc in calls)
    assert all(isinstance(json.loads(tc.function.arguments), dict) for tc in calls)


def test_anthropic_output_config_format(server):
    import anthropic
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    r = client.messages.create(
        model="m", max_tokens=120, messages=ASK,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": CITY}}})
    check_city(r.content[0].text)


def test_responses_text_format(client):
    r = client.responses.create(model="m", input="Describe the city of Paris as JSON.", max_output_tokens=120,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}})
    check_city(r.output_text)


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_grammar": "start: item"}, "guided_grammar", "item"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex", "only one of"),
    ({"grammar": 'root ::= "a" [b-'}, "grammar", "GBNF line 1, column 14: unterminated character class"),
    ({"grammar": 'root ::= "a" item\n'}, "grammar", "undefined rule 'item'"),
    ({"grammar": 'root ::= root "a" | "b"'}, "grammar", "left-recursive"),
    ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "grammar", "only one of"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, "tool_choice", "cannot be combined"),
])
def test_bad_constraints_are_400s(http, body, param, says):
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert says in err["message"], err


def test_a_failed_request_does_not_touch_others(http, client):
    bad = http.post("/v1/chat/completions", json={"messages": ASK, "guided_regex": "("})
    assert bad.status_code == 400
    r = chat(client, response_format=schema_format())
    check_city(r.choices[0].message.content)
