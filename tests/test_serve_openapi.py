"""/openapi.json is the truth about `rapid serve`: schemathesis generates requests from it
against a live server on a tiny model, and every answer must be one the schema documents
(status, content type, body) and none a 5xx; the refusals the schema promises (unknown fields
at any depth, booleans for numbers, seeds beyond 64 bits) are checked by hand as well.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.serve_fixtures import MODEL, LiveServer, live_server

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.one_thread)

MAX_TOKENS = 4
"""The most tokens a generated request may ask for: the schema allows any, the test's time
does not."""
EXAMPLES = 12
"""Generated requests per operation and generation mode (valid, and invalid)."""
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "a cab"}], "max_tokens": 2}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "a cab", "max_tokens": 2},
    "/v1/responses": {"model": MODEL, "input": "a cab", "max_output_tokens": 2},
}
CONFIG = schemathesis.Config.from_dict({"generation": {"max-examples": EXAMPLES}})


@pytest.fixture(scope="module")
def server(served_model_dir: Path) -> Iterator[LiveServer]:
    with live_server(served_model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def api(server: LiveServer) -> Any:
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=CONFIG)


def post(server: LiveServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _bounded(body: dict[str, Any]) -> None:
    """A valid request, made to reach the engine (the served model's name) within the test's
    time (at most `MAX_TOKENS` tokens)."""
    body["model"] = MODEL
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS


# Each operation with valid requests, and the POST routes with invalid ones too (the GET
# routes take no input to get wrong). Not `schema.parametrize()` over a fixture's schema:
# schemathesis's lazy fixture loader writes pytest's private `_nodeid`, which pytest 9 removed.
OPERATIONS = [
    *((path, "POST", mode) for path in ROUTES for mode in GenerationMode),
    *((path, "GET", GenerationMode.POSITIVE) for path in ("/v1/models", "/metrics", "/health")),
]


@pytest.mark.parametrize(("path", "method", "mode"), OPERATIONS, ids=str)
def test_every_answer_is_one_the_schema_documents(
    api: Any, server: LiveServer, path: str, method: str, mode: GenerationMode
) -> None:
    """No 5xx; every status, content type, header and body as documented; invalid requests
    refused with a 4xx. Valid requests may still be refused where a rule spans fields the
    schema cannot tie (all messages empty, a named tool_choice without tools): that check is
    left out."""

    @given(api[path][method].as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def answer(case: Any) -> None:
        if mode.is_positive and isinstance(case.body, dict):
            _bounded(case.body)
        case.call_and_validate(
            base_url=server.url, timeout=60, excluded_checks=[positive_data_acceptance]
        )

    answer()


# ---- what the schema promises, by hand -------------------------------------------------------


def _error(response: httpx.Response, status: int, param: str, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    return str(error["message"])


@pytest.mark.parametrize("route", ROUTES)
def test_unknown_fields_are_refused_at_any_depth(server: LiveServer, route: str) -> None:
    body = BODIES[route]
    _error(post(server, route, {**body, "colour": 1}), 400, "colour", "unknown_parameter")
    nested = (
        {"text": {"format": {"type": "text"}, "colour": 1}}
        if route == "/v1/responses"
        else {"stream_options": {"include_usage": True, "colour": 1}, "stream": True}
    )
    param = "text.colour" if route == "/v1/responses" else "stream_options.colour"
    _error(post(server, route, {**body, **nested}), 400, param, "unknown_parameter")
    assert post(server, route, body).status_code == 200


def test_booleans_are_not_numbers_nor_numbers_strings(server: LiveServer) -> None:
    for route, field, value in [
        ("/v1/completions", "prompt", [False]),
        ("/v1/completions", "max_tokens", True),
        ("/v1/chat/completions", "gamma", True),
        ("/v1/chat/completions", "temperature", "0.5"),
        ("/v1/responses", "seed", 1.0),
    ]:
        response = post(server, route, {**BODIES[route], field: value})
        assert response.status_code == 422, (field, value, response.text)
        assert response.json()["error"]["param"].split(".")[0] == field


@pytest.mark.parametrize("route", ROUTES)
def test_a_seed_beyond_64_bits_is_a_422_naming_it(server: LiveServer, route: str) -> None:
    for seed in (2**63, -(2**63) - 1, 10**30):
        _error(post(server, route, {**BODIES[route], "seed": seed}), 422, "seed", "invalid_value")
    for seed in (2**63 - 1, -(2**63)):
        assert post(server, route, {**BODIES[route], "seed": seed}).status_code == 200


@pytest.mark.parametrize("route", ROUTES)
def test_a_reported_seed_replays_the_answer_in_javascript_too(
    server: LiveServer, route: str
) -> None:
    """An unseeded sampled answer reports its seed in `usage.rapid.seed`; read as a
    JavaScript client reads it (a double), sent back, it gives the same answer."""
    body = {**BODIES[route], "temperature": 1.0}
    body["max_output_tokens" if route == "/v1/responses" else "max_tokens"] = 16
    for _ in range(3):
        first = post(server, route, body)
        seed = json.loads(first.text, parse_int=float)["usage"]["rapid"]["seed"]
        replay = post(server, route, {**body, "seed": int(seed)})
        assert _text(route, replay.json()) == _text(route, first.json())


def _text(route: str, answer: dict[str, Any]) -> str:
    if route == "/v1/responses":
        return str(answer["output"][0]["content"][0]["text"])
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def test_documented_statuses_and_content_types(server: LiveServer) -> None:
    """Each route's statuses and content types are in the schema; the answers have them."""
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for route in ROUTES:
        answers = paths[route]["post"]["responses"]
        assert {"200", "400", "401", "404", "422", "429", "500", "503", "504"} <= set(answers)
        assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
        streamed = httpx.post(server.url + route, json={**BODIES[route], "stream": True})
        assert streamed.headers["content-type"].startswith("text/event-stream")
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")
    body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    ref = body["schema"]["$ref"].rsplit("/", 1)[-1]
    request = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"][ref]
    assert request["additionalProperties"] is False
    assert {"eta", "gamma", "mode", "residual", "retrieval_budget"} <= set(request["properties"])


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}),
        (
            "POST",
            "/v1/completions",
            {"model": MODEL, "prompt": "a", "draft_prompt": CHAT["messages"]},
        ),
        ("POST", "/v1/chat/completions", "{not json"),
        ("GET", "/v1/nowhere", None),
        ("DELETE", "/v1/models", None),
    ],
    ids=["empty chat", "draft_prompt", "bad json", "no route", "wrong method"],
)
def test_every_4xx_has_a_code(server: LiveServer, method: str, path: str, body: Any) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json"}
    response = httpx.request(method, server.url + path, content=content, headers=headers)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["code"], response.text
