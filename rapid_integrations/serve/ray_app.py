"""`rapid serve --ray`: the same FastAPI app as a Ray Serve deployment with N replicas.

Each replica loads its own engine (and so holds its own prefix cache). Ray Serve's HTTP proxy
routes requests with `ConsistentHashRouter` (shipped with Ray Serve): a request carrying the
header `X-Session-Id` always goes to the replica its id hashes to (the next one on the ring if
that replica is saturated), so requests about one document, sent with one session id, keep
hitting the replica whose prefix cache holds that document's KV. Requests without the header
are spread evenly (hashed on their request id).

A multi-machine cluster: `ray start --head` on one machine, `ray start --address HEAD:6379` on
the others (each with this package and the model folder installed), then
`rapid serve --ray --ray-address auto --replicas N` on the head (docs/serving.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from .settings import ServeSettings

SESSION_HEADER = "X-Session-Id"
"""Ray Serve's default session header (`RAY_SERVE_SESSION_ID_HEADER_KEY` changes it)."""
AFFINITY_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
APP_NAME = "rapid"


@serve.ingress()
class RapidReplica:
    """One replica: an engine and the app over it (built in the replica's process)."""

    def __init__(self, settings: ServeSettings) -> None:
        from .app import create_app

        replica = serve.get_replica_context().replica_id.unique_id
        self._app = create_app(settings.load_engine(), settings, replica=replica)

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


def rapid_deployment(
    settings: ServeSettings, replicas: int, cpus: float = 1.0, gpus: float = 0.0
) -> Any:
    """The bound Ray Serve application: `replicas` copies of the app with session affinity.

    A replica takes up to `max_running + max_waiting` requests, so that its own queue (and
    its 429 answers) sees the overflow, as a single server does.
    """
    # The ignores: ray types RequestRouterConfig's keywords all as dicts (`**kwargs: dict`), and
    # `deployment(cls, ...)` as its decorator form, which returns a function, not a Deployment.
    deployment = serve.deployment(
        RapidReplica,
        name="RapidReplica",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus, "num_gpus": gpus},
        max_ongoing_requests=settings.max_running + settings.max_waiting,
        request_router_config=RequestRouterConfig(request_router_class=AFFINITY_ROUTER),  # type: ignore[arg-type]
    )
    return deployment.bind(settings)  # type: ignore[attr-defined]


def start(
    settings: ServeSettings,
    *,
    host: str,
    port: int,
    replicas: int,
    cpus: float = 1.0,
    gpus: float = 0.0,
) -> None:
    """Start Serve's HTTP proxy on host:port and deploy the app (Ray must be initialised);
    returns once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(rapid_deployment(settings, replicas, cpus, gpus), name=APP_NAME, route_prefix="/")


def serve_on_ray(settings: ServeSettings, args: argparse.Namespace) -> int:
    """`rapid serve --ray`: join (or start) a Ray cluster, deploy, serve until interrupted."""
    import ray

    ray.init(address=args.ray_address)
    start(
        settings,
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        cpus=args.replica_cpus,
        gpus=args.replica_gpus,
    )
    print(
        f"rapid: serving {settings.served_model_name!r} on Ray Serve, {args.replicas} "
        f"replicas, at http://{args.host}:{args.port}/v1 (session affinity: {SESSION_HEADER})",
        file=sys.stderr,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("rapid: shutting down Ray Serve", file=sys.stderr)
    finally:
        serve.shutdown()
    return 0
