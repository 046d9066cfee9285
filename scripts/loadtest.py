"""Load test of `rapid serve`: requests/s and p50/p95 time to first token (TTFT).

Three setups on the same model and workload, each at 1, 4 and 16 concurrent clients:
  inprocess  the engine called directly from threads (no HTTP): the baseline
  server     `rapid serve` in a subprocess, clients streaming over HTTP (openai SDK)
  ray        2 Ray Serve replicas on a local Ray instance (the same app, session affinity on)
For Ray, the prefix-cache hit rate (share of prompt tokens whose KV came from the cache) is
measured with and without `X-Session-Id` affinity.

Workload: chat questions about `--documents` different ~`--context`-token slices of the
bundled demo document (demo_messages: the document, then a question), `--max-tokens` answer
tokens, greedy, RAPID defaults. Each client sends `--requests` requests one after another,
streaming; TTFT is from sending a request to its first text. The lead's full run:

    python scripts/loadtest.py --out loadtest.json

A smoke run (one request per setup): python scripts/loadtest.py --clients 1 --requests 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QUESTIONS = (
    "Where is the spare key to the observatory on Kestrel Hill kept?",
    "Summarise the first section in one sentence.",
    "Which functions are described?",
    "What does the document say about errors?",
    "Name one module mentioned.",
    "What is the main topic?",
)
MODEL_ID = "rapid"
WARM_UP = [{"role": "user", "content": "Hello!"}]


@dataclass
class Figures:
    setup: str
    clients: int
    requests: int
    seconds: float
    requests_per_second: float
    ttft_p50: float
    ttft_p95: float
    cache_hit_rate: float


# ---- workload -------------------------------------------------------------------------------


def documents(model: str | None, context: int, count: int) -> list[str]:
    """`count` slices of about `context` tokens of the bundled document (wrapping around)."""
    from transformers import AutoTokenizer

    from rapid_integrations.demo_data import demo_document
    from rapid_integrations.models import default_model_dir, ensure_default_model

    if model is None:
        ensure_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(model or str(default_model_dir()))
    ids = tok.encode(demo_document(), add_special_tokens=False)
    size = context - 100  # room for the chat template, the question and the answer
    slices = []
    for i in range(count):
        start = (i * size) % max(1, len(ids) - size)
        slices.append(tok.decode(ids[start : start + size]))
    return slices


def request_messages(docs: list[str], client: int, n: int) -> tuple[int, list[dict[str, str]]]:
    """The document index and messages of a client's n-th request."""
    from rapid_integrations.demo_data import demo_messages

    doc = (client + n) % len(docs)
    return doc, demo_messages(docs[doc], QUESTIONS[(client * 7 + n) % len(QUESTIONS)])


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def figures(
    setup: str, clients: int, seconds: float, ttfts: list[float], hits: tuple[int, int]
) -> Figures:
    cached, prompt = hits
    return Figures(
        setup,
        clients,
        len(ttfts),
        round(seconds, 2),
        round(len(ttfts) / seconds, 3),
        round(percentile(ttfts, 50), 3),
        round(percentile(ttfts, 95), 3),
        round(cached / prompt, 3) if prompt else 0.0,
    )


# ---- setups ---------------------------------------------------------------------------------


def run_inprocess(args: argparse.Namespace, docs: list[str], clients: int) -> Figures:
    """Threads calling `engine.stream` directly."""
    engine = _engine(args)
    ttfts: list[float] = []
    hits = [0, 0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for n in range(args.requests):
            _, messages = request_messages(docs, c, n)
            sent = time.perf_counter()
            first = None
            stream = engine.stream(messages, max_new_tokens=args.max_tokens)
            for _ in stream:
                first = first or time.perf_counter() - sent
            out = stream.output
            with lock:
                ttfts.append(first or time.perf_counter() - sent)
                hits[0] += out.stats.cached_prefix_tokens
                hits[1] += out.prompt_tokens

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return figures("inprocess", clients, time.perf_counter() - start, ttfts, (hits[0], hits[1]))


_ENGINE: Any = None


def _engine(args: argparse.Namespace) -> Any:
    global _ENGINE
    if _ENGINE is None:
        from rapid_integrations.serve.settings import ServeSettings

        _ENGINE = ServeSettings(model=args.model, dtype=args.dtype).load_engine()
        _ENGINE.generate(WARM_UP, max_new_tokens=4)  # first-call costs are not load
    return _ENGINE


def warm_up(url: str) -> None:
    """One short request first: first-call costs are not load."""
    import openai

    api = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
    api.chat.completions.create(model=MODEL_ID, messages=WARM_UP, max_tokens=4)


async def http_clients(
    url: str, args: argparse.Namespace, docs: list[str], clients: int, affinity: bool
) -> tuple[float, list[float], tuple[int, int]]:
    """`clients` concurrent streaming clients (openai SDK); wall seconds, TTFTs, cache hits."""
    import openai

    ttfts: list[float] = []
    hits = [0, 0]

    async def client(c: int) -> None:
        api = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=3600
        )
        for n in range(args.requests):
            doc, messages = request_messages(docs, c, n)
            headers = {"X-Session-Id": f"doc-{doc}"} if affinity else {}
            sent = time.perf_counter()
            first = None
            stream = await api.chat.completions.create(
                model=MODEL_ID,
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and first is None:
                    first = time.perf_counter() - sent
                if chunk.usage is not None:
                    hits[0] += chunk.usage.model_extra["rapid"]["cached_prefix_tokens"]
                    hits[1] += chunk.usage.prompt_tokens
            ttfts.append(first or time.perf_counter() - sent)
        await api.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - start, ttfts, (hits[0], hits[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, alive: Callable[[], bool], timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the server exited during start-up")
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not start")


def run_server(
    args: argparse.Namespace, docs: list[str], client_counts: list[int]
) -> list[Figures]:
    """`rapid serve` in a subprocess, with as many slots as the most clients."""
    port = free_port()
    cmd = [sys.executable, "-m", "rapid_integrations.cli", "serve", "--port", str(port)]
    cmd += [
        "--dtype",
        args.dtype,
        "--max-running",
        str(max(client_counts)),
        "--served-model-name",
        MODEL_ID,
    ]
    cmd += ["--model", args.model] if args.model else []
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, lambda: proc.poll() is None)
        warm_up(url)
        out = []
        for clients in client_counts:
            seconds, ttfts, hits = asyncio.run(http_clients(url, args, docs, clients, False))
            out.append(figures("server", clients, seconds, ttfts, hits))
            print(out[-1], file=sys.stderr)
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def run_ray(args: argparse.Namespace, docs: list[str], client_counts: list[int]) -> list[Figures]:
    """2 (`--replicas`) Ray Serve replicas on a local Ray instance; with and without affinity."""
    import ray
    from ray import serve

    from rapid_integrations.serve import ray_app
    from rapid_integrations.serve.settings import ServeSettings

    root = str(Path(__file__).resolve().parents[1])
    ray.init(
        include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": root}}
    )
    port = free_port()
    settings = ServeSettings(
        model=args.model,
        dtype=args.dtype,
        served_model_name=MODEL_ID,
        max_running=max(client_counts),
    )
    url = f"http://127.0.0.1:{port}"
    out = []
    try:
        for affinity in (True, False):
            # Fresh replicas for each mode: caches warmed by the other mode would hide the
            # prefills that affinity saves.
            ray_app.start(
                settings,
                host="127.0.0.1",
                port=port,
                replicas=args.replicas,
                cpus=args.replica_cpus,
            )
            for _ in range(2 * args.replicas):  # requests without a session spread over replicas
                warm_up(url)
            for clients in client_counts:
                seconds, ttfts, hits = asyncio.run(http_clients(url, args, docs, clients, affinity))
                name = f"ray x{args.replicas}" + (" affinity" if affinity else " no affinity")
                out.append(figures(name, clients, seconds, ttfts, hits))
                print(out[-1], file=sys.stderr)
            serve.delete(ray_app.APP_NAME)
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


# ---- report ---------------------------------------------------------------------------------


def table(rows: list[Figures]) -> str:
    head = "| setup | clients | requests | req/s | TTFT p50 (s) | TTFT p95 (s) | prefix cache hit rate |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.setup} | {r.clients} | {r.requests} | {r.requests_per_second:.2f} | "
            f"{r.ttft_p50:.2f} | {r.ttft_p95:.2f} | {r.cache_hit_rate:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--setups", default="inprocess,server,ray", help="comma-separated setups")
    p.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=int, default=4, help="requests per client")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens (about)")
    p.add_argument("--documents", type=int, default=4, help="different documents asked about")
    p.add_argument("--max-tokens", type=int, default=32, help="answer tokens")
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--api-key", help="(unused unless the server requires one)")
    p.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    client_counts = [int(c) for c in args.clients.split(",")]
    docs = documents(args.model, args.context, args.documents)
    rows: list[Figures] = []
    for setup in args.setups.split(","):
        if setup == "inprocess":
            for clients in client_counts:
                rows.append(run_inprocess(args, docs, clients))
                print(rows[-1], file=sys.stderr)
        elif setup == "server":
            rows += run_server(args, docs, client_counts)
        elif setup == "ray":
            rows += run_ray(args, docs, client_counts)
        else:
            p.error(f"unknown setup {setup!r}")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
