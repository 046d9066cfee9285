"""Load test: output tokens/s, requests/s, time to first token (TTFT) and inter-token latency.

Two workloads (`--workload`):
  rag     questions about `--documents` different ~`--context`-token (2K) slices of the bundled
          demo document (demo_messages: the document, then a question), `--max-tokens` (32)
          answer tokens, stopping at end of sequence; clients 1, 4, 16
  decode  one ~`--context`-token (4K) slice of the same document, read once before the clients
          start (a server-side `--collection` for the server; in-process, the same prompt
          prefix and the collection's retriever), then each client asks its own questions with
          `--max-tokens` (128) answer tokens, end of sequence ignored; clients 1, 4, 8, 16

Setups (`--setups`), all on the same target model, greedy, RAPID defaults:
  threads    today's engine: one thread per client calling `engine.stream` (each call its
             own forward passes); `inprocess` is the same, under its old name
  batched    the same calls through the engine's shared `Batcher` (`batched_stream`): one
             packed forward pass per model and step for every running call
  hf-batch   transformers' continuous batching on the target's weights, no speculation: the
             `ContinuousBatchingManager` that `model.generate_batch` runs, fed one streamed
             request per client (`generate_batch` itself takes a closed list and does not
             stream, so it cannot serve clients that arrive one after another)
  server     `rapid serve` in a subprocess, clients streaming over HTTP (openai SDK)
  ray        2 Ray Serve replicas on a local Ray instance, with and without session affinity
             (rag only)

Each client sends `--requests` requests one after another, streaming. TTFT is from sending a
request to its first text; ITL is the time between two bursts of a request's text (a RAPID
burst carries every token one verify pass committed, so this is the stall a streaming client
sees, as vLLM's benchmark measures it under speculation; hf-batch streams one token at a
time); TPOT is a request's (last arrival - first arrival) / (tokens - 1). Output tokens are
the engines' own counts. The lead's full runs (on a quiet machine):

    python scripts/loadtest.py --workload decode --out loadtest-decode.json
    python scripts/loadtest.py --setups threads,batched,hf-batch --out loadtest-rag.json

A smoke run (seconds):

    python scripts/loadtest.py --workload decode --clients 1,2 --context 512 --max-tokens 8
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

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
# The decode workload's clients each ask their own question (32: 16 clients x 2 requests).
DECODE_QUESTIONS = (
    *QUESTIONS,
    "Explain the document to a new programmer, step by step.",
    "List every function the document names and what each one returns.",
    "Which arguments are optional, and what are their defaults?",
    "Describe the exceptions the document mentions and when they are raised.",
    "Write a short tutorial based on the document.",
    "What would you test first if you implemented these functions?",
    "Compare the two longest sections of the document.",
    "Which parts of the document are about files or paths?",
    "What does the field note say, and who wrote it?",
    "Rewrite the first paragraph for a non-technical reader.",
    "Which behaviours depend on the operating system?",
    "Give three examples of using the functions described.",
    "What are the performance caveats in the document?",
    "Which names in the document are deprecated or discouraged?",
    "Summarise the last section in detail.",
    "What questions does the document leave unanswered?",
    "Describe how the modules in the document relate to each other.",
    "Which functions take a callback, and what is it for?",
    "Explain every mention of encoding or bytes in the document.",
    "Draft an FAQ of five questions about the document, with answers.",
    "What does the document say about threads or concurrency?",
    "Which constants does the document define, and what are they used for?",
    "Write a review of the document's clarity, section by section.",
    "How would you explain the observatory note to a child?",
    "What are the differences between the functions with similar names?",
    "Turn the document into a checklist for a code review.",
)
MODEL_ID = "rapid"
COLLECTION = "doc"  # the decode workload's document, as the server's collection is named
WARM_UP = [{"role": "user", "content": "Hello!"}]
DOCUMENT_WARM_UP = "Say hello."  # the question of the untimed request that reads the document
HF_PAGE_SIZE = 256  # transformers' default KV page: the paged cache is sized in these
BURST_SECONDS = 0.001  # a pass's deltas arrive microseconds apart; passes, tens of ms or more


@dataclass
class Sample:
    """One request as its client saw it."""

    sent: float
    arrivals: list[float]  # perf_counter times at which its text arrived
    tokens: int  # output tokens, the engine's count
    cached: int | None = 0  # prompt tokens whose KV came from the prefix cache (None: unknown)
    prompt: int = 0


@dataclass
class Figures:
    setup: str
    clients: int
    requests: int
    seconds: float
    requests_per_second: float
    ttft_p50: float
    ttft_p95: float
    cache_hit_rate: float | None  # None: the engine does not say (hf-batch)
    workload: str = "rag"
    output_tokens: int = 0
    tokens_per_second: float = 0.0
    itl_p50: float | None = None  # None: no request had two bursts of text
    itl_p95: float | None = None
    tpot_p50: float | None = None
    tpot_p95: float | None = None
    prompt_tokens: float = 0.0  # mean per request


@dataclass
class Load:
    """The workload's requests: what a client sends and what an engine reads in-process."""

    workload: str
    docs: list[str]  # rag: the slices asked about; decode: the one document
    max_tokens: int
    requests: int
    retriever: Any = None  # decode in-process: the collection's retriever (set with the engine)

    @property
    def ignore_eos(self) -> bool:
        return self.workload == "decode"  # every answer is max_tokens long

    def messages(self, client: int, n: int, clients: int) -> tuple[int, list[dict[str, str]]]:
        """The document index and messages a client sends (decode: the question only; the
        server puts the collection before it)."""
        if self.workload == "rag":
            return request_messages(self.docs, client, n)
        question = DECODE_QUESTIONS[(n * clients + client) % len(DECODE_QUESTIONS)]
        return 0, [{"role": "user", "content": question}]

    def prompt(self, client: int, n: int, clients: int) -> list[dict[str, str]]:
        """The messages an in-process engine reads: decode inserts the document as the server
        inserts its collection (`Collection.messages`), so the prompts are the server's."""
        _, messages = self.messages(client, n, clients)
        return self.with_document(messages)

    def with_document(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        if self.workload == "rag":
            return messages
        from rapid_integrations.serve.collection import Collection

        return Collection(COLLECTION, self.docs[0], self.retriever).messages(messages)

    def options(self) -> dict[str, Any]:
        """The engine's per-call options (decode: the collection's retriever, as the server)."""
        options: dict[str, Any] = {"max_new_tokens": self.max_tokens}
        if self.ignore_eos:
            options["ignore_eos"] = True
        if self.retriever is not None:
            options["retriever"] = self.retriever
        return options


# ---- workload -------------------------------------------------------------------------------


def documents(model: str | None, context: int, count: int) -> list[str]:
    """`count` slices of about `context` tokens of the bundled document (wrapping around)."""
    from transformers import AutoTokenizer

    from rapid_integrations.demo_data import demo_document
    from rapid_integrations.models.loading import default_model_dir, ensure_default_model

    if model is None:
        ensure_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(model or str(default_model_dir()))
    ids = tok.encode(demo_document(), add_special_tokens=False)
    size = context - 100  # room for the chat template, the question and the answer
    slices = []
    for i in range(count):
        start = (i * size) % max(1, len(ids) - size)
        slices.append(cast(str, tok.decode(ids[start : start + size])))
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


def bursts(arrivals: list[float]) -> list[float]:
    """The arrival times of a request's bursts of text: the engines hand out each token (or
    text piece) one pass committed as a delta of its own, back to back, so arrivals less than
    `BURST_SECONDS` apart are one burst (one pass's text), not zero inter-token latencies."""
    starts = [b for a, b in itertools.pairwise(arrivals) if b - a >= BURST_SECONDS]
    return arrivals[:1] + starts


def gaps(sample: Sample) -> list[float]:
    """The inter-token latencies of a request: the time between two bursts of its text."""
    return [b - a for a, b in itertools.pairwise(bursts(sample.arrivals))]


def tpot(sample: Sample) -> float | None:
    """Time per output token after the first, (last arrival - first) / (tokens - 1), as vLLM's
    benchmark defines it; None for a request whose text came in one burst (nothing to time)."""
    if sample.tokens < 2 or len(bursts(sample.arrivals)) < 2:
        return None
    return (sample.arrivals[-1] - sample.arrivals[0]) / (sample.tokens - 1)


def rounded_percentile(values: list[float], q: float, digits: int = 4) -> float | None:
    """None where nothing was measured (no request had two bursts of text), not 0 ms."""
    return round(percentile(values, q), digits) if values else None


def figures(
    setup: str, workload: str, clients: int, seconds: float, samples: list[Sample]
) -> Figures:
    ttfts = [(s.arrivals[0] if s.arrivals else s.sent) - s.sent for s in samples]
    itls = [g for s in samples for g in gaps(s)]
    tpots = [t for s in samples if (t := tpot(s)) is not None]
    tokens = sum(s.tokens for s in samples)
    prompt = sum(s.prompt for s in samples)
    known = [s.cached for s in samples if s.cached is not None]
    hit_rate = round(sum(known) / prompt, 3) if prompt and len(known) == len(samples) else None
    return Figures(
        setup=setup,
        clients=clients,
        requests=len(samples),
        seconds=round(seconds, 2),
        requests_per_second=round(len(samples) / seconds, 3),
        ttft_p50=round(percentile(ttfts, 50), 3),
        ttft_p95=round(percentile(ttfts, 95), 3),
        cache_hit_rate=hit_rate,
        workload=workload,
        output_tokens=tokens,
        tokens_per_second=round(tokens / seconds, 2),
        itl_p50=rounded_percentile(itls, 50),
        itl_p95=rounded_percentile(itls, 95),
        tpot_p50=rounded_percentile(tpots, 50),
        tpot_p95=rounded_percentile(tpots, 95),
        prompt_tokens=round(prompt / len(samples), 1) if samples else 0.0,
    )


# ---- in-process engines: threads and batched ------------------------------------------------

_ENGINE: Any = None


def _engine(args: argparse.Namespace) -> Any:
    global _ENGINE
    if _ENGINE is None:
        from rapid_integrations.serve.settings import ServeSettings

        _ENGINE = ServeSettings(model=args.model, dtype=args.dtype).load_engine()
        _ENGINE.generate(WARM_UP, max_new_tokens=4)  # first-call costs are not load
    return _ENGINE


def with_retriever(load: Load, engine: Any) -> Load:
    """The decode load with its collection's retriever, built once as the server builds it at
    start-up (so the draft's context is not re-indexed per request)."""
    if load.workload != "decode" or load.retriever is not None:
        return load
    from rapid_integrations.retrieval import FaissContextRetriever

    load.retriever = FaissContextRetriever.from_config(
        load.docs[0], engine.tokenizer, engine.config
    )
    return load


OpenStream = Callable[[Any, Any], Any]  # (prompt, CallOptions) -> RapidStream


def stream_opener(setup: str, engine: Any) -> OpenStream:
    """How a setup starts a call: `engine.stream` alone, or through the shared batcher."""
    if setup in ("threads", "inprocess"):
        return lambda prompt, options: engine.stream(prompt, options=options)
    from rapid_integrations.batching.batcher import batched_stream
    from rapid_integrations.batching.runner import BatchRunner

    BatchRunner(engine)  # raises where the models cannot pack: no silent per-thread fallback
    return lambda prompt, options: batched_stream(engine, prompt, options)


def engine_request(open_stream: OpenStream, prompt: Any, options: dict[str, Any]) -> Sample:
    """One streamed call; its text arrivals and the engine's token count."""
    from rapid_integrations.engine.call_options import CallOptions

    call = CallOptions.of(options)
    sent = time.perf_counter()
    stream = open_stream(prompt, call)
    arrivals = [time.perf_counter() for delta in stream.deltas() if delta.text]
    out = stream.output
    return Sample(
        sent, arrivals, len(out.token_ids), out.stats.cached_prefix_tokens, out.prompt_tokens
    )


def thread_clients(
    clients: int, requests: int, one: Callable[[int, int], Sample]
) -> tuple[float, list[Sample]]:
    """`clients` threads, each running `one(client, n)` for its `requests` in turn."""
    samples: list[Sample] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for n in range(requests):
            sample = one(c, n)
            with lock:
                samples.append(sample)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, samples


def run_engine(
    setup: str, args: argparse.Namespace, load: Load, client_counts: list[int]
) -> list[Figures]:
    """`threads` / `inprocess` or `batched`: in-process clients on one engine."""
    engine = _engine(args)
    # Every in-process setup starts from the same state, whichever ran before it on this
    # engine: no document KV cached, no gamma schedule learned (hf-batch starts cold too).
    engine.prefix_cache.clear()
    engine.schedules.clear()
    load = with_retriever(load, engine)
    open_stream = stream_opener(setup, engine)
    options = load.options()
    if load.workload == "decode":  # the document is read once, before the clients start
        engine_request(
            open_stream,
            load.with_document([{"role": "user", "content": DOCUMENT_WARM_UP}]),
            {**options, "max_new_tokens": 4},
        )
    out = []
    for clients in client_counts:

        def one(c: int, n: int, clients: int = clients) -> Sample:
            return engine_request(open_stream, load.prompt(c, n, clients), options)

        seconds, samples = thread_clients(clients, load.requests, one)
        out.append(figures(setup, load.workload, clients, seconds, samples))
        print(out[-1], file=sys.stderr)
    return out


# ---- transformers continuous batching (hf-batch) ----------------------------------------------


def hf_model(args: argparse.Namespace, engine: Any) -> Any:
    """The target's weights loaded again for transformers, in the engine's dtype, with SDPA
    (the engine's own model runs RAPID's attention, which continuous batching refuses)."""
    from transformers import AutoModelForCausalLM

    from rapid_integrations.models.loading import default_model_dir

    path = args.model or str(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=engine.target.dtype, attn_implementation="sdpa"
    )
    return model.to(engine.target.device).eval()


def hf_configs(engine: Any, load: Load, prompt_tokens: int, clients: int) -> tuple[Any, Any]:
    """Greedy generation, and a paged cache sized for `clients` full requests: left to
    itself, transformers sizes it from device memory, which on a CPU allocates for most of a
    minute; prefill chunks as large as the engine's (`prefill_chunk_size`)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    generation = GenerationConfig(
        max_new_tokens=load.max_tokens,
        do_sample=False,
        eos_token_id=sorted(engine.eos_token_ids) or -1,
    )
    per_request = math.ceil((prompt_tokens + load.max_tokens) / HF_PAGE_SIZE) + 1
    batching = ContinuousBatchingConfig(
        page_size=HF_PAGE_SIZE,
        num_blocks=clients * per_request + 4,
        max_batch_tokens=engine.config.prefill_chunk_size,
        max_requests_per_batch=clients,
        auto_switch_to_flash=False,  # the same SDPA kernels as the engine
    )
    return generation, batching


async def hf_request(manager: Any, ids: list[int], load: Load, rid: str) -> Sample:
    """One streamed request on the manager; each streamed output is one new token."""
    outputs: asyncio.Queue[Any] = asyncio.Queue()
    manager.register_result_handler(rid, outputs.put_nowait)  # before the request: no output missed
    sent = time.perf_counter()
    eos = -1 if load.ignore_eos else None  # -1: no end of sequence; None: the config's
    manager.add_request(
        ids, request_id=rid, max_new_tokens=load.max_tokens, streaming=True, eos_token_id=eos
    )
    arrivals: list[float] = []
    while True:
        out = await outputs.get()
        if out.error:
            raise RuntimeError(f"transformers continuous batching: {out.error}")
        arrivals += [time.perf_counter()] * (len(out.generated_tokens) - len(arrivals))
        if out.is_finished():
            return Sample(sent, arrivals, len(out.generated_tokens), None, len(ids))


async def hf_clients(
    manager: Any, encode: Callable[[Any], list[int]], load: Load, clients: int
) -> tuple[float, list[Sample]]:
    """`clients` concurrent clients on the manager, each sending its requests in turn."""
    samples: list[Sample] = []
    ids = itertools.count()

    async def client(c: int) -> None:
        for n in range(load.requests):
            prompt = encode(load.prompt(c, n, clients))
            samples.append(await hf_request(manager, prompt, load, f"c{clients}-{next(ids)}"))

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - start, samples


def run_hf_batch(args: argparse.Namespace, load: Load, client_counts: list[int]) -> list[Figures]:
    """transformers' continuous batching on the target, one manager for every client count."""
    from rapid_integrations.tokens import encode_prompt

    engine = _engine(args)
    load = with_retriever(load, engine)  # same prompts as the engine's (the retriever is unused)
    model = hf_model(args, engine)

    def encode(prompt: Any) -> list[int]:
        return encode_prompt(prompt, engine.tokenizer, engine.vocab_size)

    longest = max(
        len(encode(load.prompt(c, 0, max(client_counts)))) for c in range(max(client_counts))
    )
    generation, batching = hf_configs(engine, load, longest, max(client_counts))
    out = []
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=batching, timeout=60
    ) as manager:
        warm = load.with_document([{"role": "user", "content": DOCUMENT_WARM_UP}])
        asyncio.run(
            hf_request(manager, encode(warm), Load(load.workload, load.docs, 4, 1), "warm-up")
        )
        for clients in client_counts:
            seconds, samples = asyncio.run(hf_clients(manager, encode, load, clients))
            out.append(figures("hf-batch", load.workload, clients, seconds, samples))
            print(out[-1], file=sys.stderr)
    return out


# ---- over HTTP: server and Ray ----------------------------------------------------------------


def warm_up(url: str, load: Load) -> None:
    """One short request first: first-call costs are not load; decode's reads the document."""
    import openai

    api = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
    if load.workload == "decode":
        messages = cast(
            "list[ChatCompletionMessageParam]", [{"role": "user", "content": DOCUMENT_WARM_UP}]
        )
        api.chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=4, extra_body={"collection": COLLECTION}
        )
    else:
        api.chat.completions.create(
            model=MODEL_ID, messages=cast("list[ChatCompletionMessageParam]", WARM_UP), max_tokens=4
        )


async def http_clients(
    url: str, args: argparse.Namespace, load: Load, clients: int, affinity: bool
) -> tuple[float, list[Sample]]:
    """`clients` concurrent streaming clients (openai SDK); wall seconds and their samples."""
    import openai

    samples: list[Sample] = []
    extra = {"collection": COLLECTION, "ignore_eos": True} if load.workload == "decode" else {}

    async def client(c: int) -> None:
        api = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=3600
        )
        for n in range(load.requests):
            doc, messages = load.messages(c, n, clients)
            headers = {"X-Session-Id": f"doc-{doc}"} if affinity else {}
            sample = Sample(time.perf_counter(), [], 0)
            stream = await api.chat.completions.create(
                model=MODEL_ID,
                messages=cast("list[ChatCompletionMessageParam]", messages),
                max_tokens=load.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers=headers,
                extra_body=extra,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    sample.arrivals.append(time.perf_counter())
                if chunk.usage is not None:
                    sample.tokens = chunk.usage.completion_tokens
                    sample.cached = (chunk.usage.model_extra or {})["rapid"]["cached_prefix_tokens"]
                    sample.prompt = chunk.usage.prompt_tokens
            samples.append(sample)
        await api.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - start, samples


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


def server_command(
    args: argparse.Namespace, port: int, clients: int, collection: Path | None
) -> list[str]:
    cmd = [sys.executable, "-m", "rapid_integrations.cli", "serve", "--port", str(port)]
    cmd += ["--dtype", args.dtype, "--max-running", str(clients), "--served-model-name", MODEL_ID]
    cmd += ["--model", args.model] if args.model else []
    cmd += ["--collection", f"{COLLECTION}={collection}"] if collection else []
    return cmd


def run_server(args: argparse.Namespace, load: Load, client_counts: list[int]) -> list[Figures]:
    """`rapid serve` in a subprocess, with as many slots as the most clients; decode's
    document is the server's collection."""
    with tempfile.TemporaryDirectory() as tmp:
        collection = None
        if load.workload == "decode":
            collection = Path(tmp) / "document.txt"
            collection.write_text(load.docs[0], encoding="utf-8")
        port = free_port()
        cmd = server_command(args, port, max(client_counts), collection)
        proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, lambda: proc.poll() is None)
            warm_up(url, load)
            out = []
            for clients in client_counts:
                seconds, samples = asyncio.run(http_clients(url, args, load, clients, False))
                out.append(figures("server", load.workload, clients, seconds, samples))
                print(out[-1], file=sys.stderr)
            return out
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)


def run_ray(args: argparse.Namespace, load: Load, client_counts: list[int]) -> list[Figures]:
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
                warm_up(url, load)
            for clients in client_counts:
                seconds, samples = asyncio.run(http_clients(url, args, load, clients, affinity))
                name = f"ray x{args.replicas}" + (" affinity" if affinity else " no affinity")
                out.append(figures(name, load.workload, clients, seconds, samples))
                print(out[-1], file=sys.stderr)
            serve.delete(ray_app.APP_NAME)
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


# ---- report ---------------------------------------------------------------------------------


def table(rows: list[Figures]) -> str:
    head = (
        "| setup | clients | requests | output tok/s | req/s | TTFT p50 (s) | TTFT p95 (s) "
        "| ITL p50 (ms) | ITL p95 (ms) | TPOT p50 (ms) | prefix cache hit rate |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r.setup} | {r.clients} | {r.requests} | {r.tokens_per_second:.1f} | "
            f"{r.requests_per_second:.2f} | {r.ttft_p50:.2f} | {r.ttft_p95:.2f} | "
            f"{_ms(r.itl_p50)} | {_ms(r.itl_p95)} | {_ms(r.tpot_p50)} | "
            f"{'n/a' if r.cache_hit_rate is None else f'{r.cache_hit_rate:.2f}'} |"
        )
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.0f}"


def settings(args: argparse.Namespace, load: Load, client_counts: list[int]) -> dict[str, Any]:
    """What a figure depends on besides the code: written beside the figures."""
    import torch
    import transformers

    root = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    commit = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
    )
    return {
        "commit": commit + ("-dirty" if dirty else ""),
        "workload": load.workload,
        "context": args.context,
        "max_tokens": load.max_tokens,
        "ignore_eos": load.ignore_eos,
        "requests_per_client": load.requests,
        "clients": client_counts,
        "setups": args.setups,
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "dtype": str(_ENGINE.target.dtype) if _ENGINE is not None else args.dtype,
        "torch_threads": torch.get_num_threads(),
        "RAPID_NUM_THREADS": os.environ.get("RAPID_NUM_THREADS"),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),  # a quiet machine reads near 0
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


DEFAULTS = {  # per workload: context, max tokens, requests per client, clients, setups
    "rag": (2048, 32, 4, "1,4,16", "inprocess,server,ray"),
    "decode": (4096, 128, 2, "1,4,8,16", "threads,batched,hf-batch"),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", choices=sorted(DEFAULTS), default="rag")
    p.add_argument(
        "--setups",
        help="comma-separated (default: rag inprocess,server,ray; decode threads,batched,hf-batch)",
    )
    p.add_argument(
        "--clients", help="concurrent clients, comma-separated (rag 1,4,16; decode 1,4,8,16)"
    )
    p.add_argument("--requests", type=int, help="requests per client (rag 4, decode 2)")
    p.add_argument("--context", type=int, help="prompt tokens, about (rag 2048, decode 4096)")
    p.add_argument("--documents", type=int, default=4, help="rag: different documents asked about")
    p.add_argument("--max-tokens", type=int, help="answer tokens (rag 32, decode 128)")
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--api-key", help="(unused unless the server requires one)")
    p.add_argument("--out", type=Path, help="also write the settings and figures as JSON here")
    args = p.parse_args(argv)
    context, max_tokens, requests, clients, setups = DEFAULTS[args.workload]
    args.context = args.context or context
    args.max_tokens = args.max_tokens or max_tokens
    args.requests = args.requests or requests
    args.clients = args.clients or clients
    args.setups = args.setups or setups
    if args.workload == "decode" and "ray" in args.setups.split(","):
        p.error("ray runs the rag workload only")
    return args


SETUPS: dict[str, Callable[[argparse.Namespace, Load, list[int]], list[Figures]]] = {
    "inprocess": lambda args, load, counts: run_engine("inprocess", args, load, counts),
    "threads": lambda args, load, counts: run_engine("threads", args, load, counts),
    "batched": lambda args, load, counts: run_engine("batched", args, load, counts),
    "hf-batch": run_hf_batch,
    "server": run_server,
    "ray": run_ray,
}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    client_counts = [int(c) for c in args.clients.split(",")]
    setups = args.setups.split(",")
    unknown = [s for s in setups if s not in SETUPS]
    if unknown:
        raise SystemExit(f"unknown setup(s) {unknown}; known: {', '.join(SETUPS)}")
    count = args.documents if args.workload == "rag" else 1
    load = Load(
        args.workload, documents(args.model, args.context, count), args.max_tokens, args.requests
    )
    start = settings(args, load, client_counts)
    rows: list[Figures] = []
    for setup in setups:
        rows += SETUPS[setup](args, load, client_counts)
    print(table(rows))
    if args.out:
        report: dict[str, Any] = {
            "settings": {**start, **settings(args, load, client_counts)},
            "figures": [asdict(r) for r in rows],
        }
        report["settings"]["load_average_at_start"] = start["load_average_at_start"]
        report["settings"]["load_average_at_end"] = os.getloadavg()  # others ran meanwhile?
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
