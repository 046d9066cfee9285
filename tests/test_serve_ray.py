"""`rapid serve --ray`: 2 Ray Serve replicas of a tiny model on a local Ray instance.

Concurrent requests are spread over both replicas and every answer equals the in-process
engine's; requests sharing an `X-Session-Id` go to one replica, whose prefix cache then
serves their common document (the point of session affinity). About a minute, most of it
starting Ray.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

import rapid_integrations
from rapid_integrations import RapidEngine
from rapid_integrations.serve.settings import ServeSettings
from tests.serve_fixtures import DTYPE, MODEL

ray = pytest.importorskip("ray")
from rapid_integrations.serve import ray_app  # noqa: E402  (needs ray)

pytestmark = pytest.mark.slow
QUESTIONS = ["a cab", "a bad cafe", "jade lake", "deal a face", "bead", "fade a cab"]
DOCUMENT = " ".join(["a jade cab faded by the lake."] * 8)


@pytest.fixture(scope="module")
def ray_url(served_model_dir: Path) -> Iterator[str]:
    root = str(Path(rapid_integrations.__file__).resolve().parents[1])  # the code under test
    env = {"PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with pytest.MonkeyPatch.context() as patch:
        # Set before Ray starts, so that every Ray process inherits them: a `runtime_env`
        # would make Ray start fresh worker processes for the replicas instead of the ones it
        # started with itself. Ray Serve kills a proxy that has not answered its ready check in
        # 5 s or three 10 s health checks, and on two cores shared with other test workers one
        # took longer (ActorDiedError, "killed by ray.kill").
        for check in ("READY_CHECK", "HEALTH_CHECK"):
            env[f"RAY_SERVE_PROXY_{check}_TIMEOUT_S"] = "120"
        for name, value in env.items():
            patch.setenv(name, value)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        settings = ServeSettings(
            model=str(served_model_dir), dtype=DTYPE, device="cpu", served_model_name=MODEL
        )
        ray_app.start(settings, host="127.0.0.1", port=port, replicas=2, cpus=0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        # Stopping the local Ray instance ends Serve's actors with it; `serve.shutdown()`
        # first would wait for each to stop gracefully (4 s).
        ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)


def ask(url: str, question: str, session: str | None = None) -> dict:
    headers = {ray_app.SESSION_HEADER: session} if session else {}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_replicas_both_serve_and_answer_like_the_engine(
    ray_url: str, reference: RapidEngine
) -> None:
    questions = QUESTIONS * 3
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda q: ask(ray_url, q), questions))
    replicas = {a["usage"]["rapid"]["replica"] for a in answers}
    assert len(replicas) == 2  # 18 requests spread at random: all on one replica is p = 2^-17
    for question, answer in zip(questions, answers, strict=True):
        expected = reference.generate(
            [{"role": "user", "content": question}], max_new_tokens=8, temperature=0.0
        )
        assert answer["choices"][0]["message"]["content"] == expected.text


def test_one_session_stays_on_one_replica_and_reuses_its_prefix(
    ray_url: str, reference: RapidEngine
) -> None:
    client = openai.OpenAI(
        base_url=ray_url + "/v1",
        api_key="unused",
        max_retries=0,
        default_headers={ray_app.SESSION_HEADER: "lake-doc"},
    )
    replicas, cached = set(), []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": DOCUMENT}, {"role": "user", "content": question}]
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=0
        )
        stats = out.usage.model_extra["rapid"]
        replicas.add(stats["replica"])
        cached.append(stats["cached_prefix_tokens"])
        assert (
            out.choices[0].message.content
            == reference.generate(messages, max_new_tokens=6, temperature=0.0).text
        )
    assert len(replicas) == 1
    assert all(n >= len(DOCUMENT) for n in cached[1:])  # the document's KV came from the cache
