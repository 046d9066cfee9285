"""`rapid serve`: its command-line options, and running the app on uvicorn or on Ray Serve.

This module imports no server library at import time: `rapid --help` and the other commands
work without the serve extra.
"""

from __future__ import annotations

import argparse
import sys

from .settings import API_KEY_ENV, ServeSettings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
EXIT_UNAVAILABLE = 69  # sysexits.h, as the rest of the CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `rapid serve`."""
    d = ServeSettings()
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--model", help="target model: local folder or .gguf (default: embedded)")
    p.add_argument("--draft", help="draft model (default: the target itself)")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: CUDA when present)")
    p.add_argument(
        "--compile-draft",
        action="store_true",
        help="run the draft's decode passes through torch.compile, built at startup "
        "(docs/performance.md, A compiled draft)",
    )
    p.add_argument(
        "--served-model-name",
        default=d.served_model_name,
        help=f"the model id clients send (default {d.served_model_name!r})",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=d.max_running,
        help=f"requests decoded together: the batch size (default {d.max_running})",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help=f"requests that may wait for a slot; more get 429 (default {d.max_waiting})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help=f"seconds from arrival to the last token (default {d.request_timeout:g})",
    )
    p.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else open)",
    )
    p.add_argument(
        "--collection",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a document (file, or folder of .txt/.md) requests may name (repeatable)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM / Ctrl-C (default 30)",
    )
    p.add_argument("--ray", action="store_true", help="deploy on Ray Serve instead of uvicorn")
    p.add_argument("--replicas", type=int, default=1, help="Ray Serve replicas (default 1)")
    p.add_argument(
        "--ray-address", help="Ray cluster to join, e.g. 'auto' (default: start a local one)"
    )
    p.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)"
    )
    p.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (default 0)")


def settings_from(args: argparse.Namespace) -> ServeSettings:
    """The `ServeSettings` the options describe (API key from the environment if not given)."""
    collections = []
    for spec in args.collection:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"rapid serve: error: --collection wants NAME=PATH, got {spec!r}")
        collections.append((name, path))
    return ServeSettings(
        model=args.model,
        draft=args.draft,
        device=args.device,
        dtype=args.dtype,
        compile_draft=args.compile_draft,
        served_model_name=args.served_model_name,
        max_running=args.max_running,
        max_waiting=args.max_waiting,
        request_timeout=args.request_timeout,
        api_key=args.api_key,
        collections=tuple(collections),
    ).with_env_api_key()


def run(args: argparse.Namespace) -> int:
    """`rapid serve`: load the engine, then serve until interrupted."""
    try:
        import uvicorn
    except ImportError:
        print(
            'rapid: error: serving needs the serve extra: pip install "rapid-integrations[serve]"',
            file=sys.stderr,
        )
        return EXIT_UNAVAILABLE
    settings = settings_from(args)
    if args.ray:
        from .ray_app import serve_on_ray

        return serve_on_ray(settings, args)
    from rapid_integrations.quiet import loading_bars

    from .app import create_app

    with loading_bars(args.progress if settings.model else None):  # a named model: a wait
        engine = settings.load_engine()
    app = create_app(engine, settings)
    print(
        f"rapid: serving {settings.served_model_name!r} ({engine.model_name}) on "
        f"http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.shutdown_timeout,
        log_level="info",
    )
    return 0
