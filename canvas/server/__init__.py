"""The dcanvas/1 server: `dcanvas serve [--host 127.0.0.1] [--port 8765] [--model DIR] [--db PATH] [--token T]`.

A Starlette app on uvicorn (`app`): the web client at `/`, `/health`, `/schema`, and the websocket `/ws` that
speaks dcanvas/1 (docs/protocol.md). Modules: `config` (ServerConfig), `security` (bind/token policy, Origin,
rate limits), `state` (sessions, live documents), `hub` (request handlers), `hub_port` (what the hub's parts may use
of it), `gens` (one task per generation), `admission` (the engine queue's bound, `busy`), `proposals` (accept,
reject), `peers` (other server processes on a shared store), `persist` (change logs and proposals in the store:
SQLite, or PostgreSQL shared by several servers), `outbox` (per-connection sending with latest-wins progress),
`rebase` (versions), `faults` (injected faults for the soak), `lag` (how late the event loop runs: `/health`'s
`loop_lag_ms`), `embedded` (a server in a thread, for the TUI), `http/` (the OpenAI-compatible and llama.cpp
routes). What it serves with is `canvas.engine.backend`.

It imports the engine, the store, the protocol, the document, the sampler's modes, `canvas.convert` (which model),
`canvas.__version__`, `canvas.env` (the token) and its HTTP dialects (and `canvas.cluster` with `--ray`), never the
eval, the benchmarks or the UI. The TUI (`embedded`), the soak (`faults`), the cluster (`admission`), the HTTP
dialects (`admission`, `config`, `security`) and the CLI import it.
Imports: `canvas`, `canvas.cluster`, `canvas.convert`, `canvas.document`, `canvas.engine`, `canvas.protocol`,
`canvas.sampling`, `canvas.server.http` and `canvas.store`.
Imported by: `canvas.cli`, `canvas.cluster`, `canvas.server.http`, `canvas.soak` and `tui`.

This module stays light (no torch import) so that `dcanvas --help` is fast; `create_app` imports the rest.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from canvas.server.config import ServerConfig


def create_app(config: ServerConfig, **kwargs: Any) -> Starlette:
    from canvas.server.app import create_app as _create_app

    return _create_app(config, **kwargs)


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8765, help="TCP port (default 8765)")
    parser.add_argument("--model", default=None, help="model directory (default: $DCANVAS_MODEL, else the built "
                        "Gemma-3-270M conversion, building it if its packages are installed, else canvas-6m)")
    parser.add_argument(
        "--db",
        default=None,
        help="where documents live: a SQLite file (default ~/.local/share/dcanvas/documents.db), or a PostgreSQL "
        "database (postgresql://user@host/db; the pg extra) that several servers may share",
    )
    parser.add_argument(
        "--token",
        default=None,
        help="shared secret clients send in hello or as a websocket subprotocol (default $DCANVAS_TOKEN); "
        "required off loopback",
    )
    parser.add_argument("--origin", action="append", default=[], help="also allow browser pages from this origin")
    parser.add_argument("--allow-host", action="append", default=[], help="also serve this Host header on loopback")
    parser.add_argument("--web", default=None, help="folder served at / (default: the repository's web/)")
    parser.add_argument("--max-batch", type=int, default=8, help="generations stepped together (default 8)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for the engine (default: the physical cores this process may use)")
    parser.add_argument("--context-cache-mb", type=float, default=None,
                        help="MiB of encoder caches kept from earlier contexts, reused by their longest common prefix "
                        "(an editor's next keystroke re-encodes only what changed); 0 keeps none (default 512)")
    parser.add_argument(
        "--max-queue",
        default="auto",
        help="engine rows a queued generation may wait for before gen.start is refused as busy (HTTP 429); "
        "'auto' (default) sizes it from the measured step time",
    )
    parser.add_argument(
        "--first-frame-slo",
        default="2.5",
        help="cap the generations run side by side so that one's own first frame stays within this many times the "
        "fastest first frame alone (default 2.5); 'off': always --max-batch",
    )
    parser.add_argument("--ray", action="store_true",
                        help="run the engine as Ray Serve replicas (canvas.cluster); this process serves only the "
                        "websocket and HTTP routes")
    parser.add_argument("--replicas", type=int, default=1, help="with --ray: engine replicas to deploy (default 1)")
    parser.add_argument("--ray-address", default=None,
                        help="with --ray: a running Ray cluster's address (default: start a local Ray)")
    parser.add_argument("--ray-app", default="dcanvas",
                        help="with --ray: the Serve application's name; an ingress finding it running attaches to "
                        "its replicas (default dcanvas)")
    parser.add_argument("--gpus-per-replica", type=float, default=0,
                        help="with --ray: GPUs each replica takes (default 0: CPU replicas)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from canvas.env import TOKEN
    from canvas.server.admission import AdmissionConfig
    from canvas.server.config import ServerConfig
    from canvas.server.embedded import uvicorn_options
    from canvas.store.base import StoreError, describe

    fields: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "token": args.token or TOKEN.get() or None,
        "model_dir": args.model,
        "origins": tuple(args.origin),
        "hosts": tuple(args.allow_host),
        "max_batch": args.max_batch,
        "threads": args.threads,
    }
    if args.context_cache_mb is not None:
        fields["context_cache_mb"] = args.context_cache_mb
    admission: dict[str, Any] = {}
    if args.max_queue != "auto":
        if not args.max_queue.isdigit():
            print(f"dcanvas serve: --max-queue must be a number or 'auto', not {args.max_queue!r}")
            return 2
        admission["max_queue"] = int(args.max_queue)
    try:
        admission["first_frame_slo"] = None if args.first_frame_slo == "off" else float(args.first_frame_slo)
        fields["admission"] = AdmissionConfig(**admission)
    except ValueError as e:
        print(f"dcanvas serve: --first-frame-slo: {e}")
        return 2
    if args.db is not None:
        fields["db"] = args.db
    if args.web is not None:
        fields["web_dir"] = args.web
    try:
        config = ServerConfig(**fields)
        if args.ray:
            return _serve_ray(args, config)
        app = create_app(config)
    except (ValueError, FileNotFoundError, StoreError) as e:
        print(f"dcanvas serve: {e}")
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"dcanvas serve: ws://{config.host}:{config.port}/ws  (model {app.state.hub.backend.name}, documents in "
          f"{describe(config.db)})", flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level, **uvicorn_options(config))
    return 0


def _serve_ray(args: argparse.Namespace, config: ServerConfig) -> int:
    """The ingress of `--ray`: replicas deployed on Ray (or found there), this process without a model."""
    import uvicorn

    from canvas.cluster.deploy import Cluster, ClusterConfig
    from canvas.convert.resolve import resolve_model
    from canvas.engine.backend import load_frontend
    from canvas.server.embedded import uvicorn_options

    model_dir = resolve_model(config.model_dir).path
    cluster_config = ClusterConfig(replicas=args.replicas, address=args.ray_address, app=args.ray_app,
                                   num_gpus=args.gpus_per_replica, threads=config.threads)
    backend = load_frontend(model_dir)  # before Ray: a bad directory fails fast
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster = Cluster.start(cluster_config, str(Path(model_dir).resolve()), max_batch=config.max_batch,
                            admission=config.admission)
    try:
        app = create_app(config, backend=backend, admission=cluster.admission())
        print(f"dcanvas serve: ws://{config.host}:{config.port}/ws  (model {backend.name}, documents in {config.db}; "
              f"{args.replicas} engine replicas on Ray)", flush=True)
        uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level, **uvicorn_options(config))
    finally:
        cluster.close()
    return 0
