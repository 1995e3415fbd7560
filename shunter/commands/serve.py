"""`shunter serve`: an OpenAI-compatible HTTP server over one engine."""

from __future__ import annotations

import argparse
from pathlib import Path

import anyio

from engine.config import EngineConfig
from engine.errors import ConfigError
from shunter.commands.cluster_options import add_cluster_options, cluster_fields, start_engine
from shunter.commands.common import add_engine_options, engine_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description="Serve /v1/completions, /v1/chat/completions and friends "
                                   "over HTTP (loopback only unless --host says otherwise).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /version")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model directory's name)")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="Jinja2 chat template replacing the model's own")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted (default: 1 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds running requests get to finish")
    p.add_argument("--backend", default="torch", choices=("torch", "sim"),
                   help="torch runs the model; sim only simulates its timing (token-id prompts)")
    add_engine_options(p)
    add_cluster_options(p)
    p.set_defaults(run=run)


async def serve(config: EngineConfig, args: argparse.Namespace) -> None:
    from shunter.server.app import build_app
    from shunter.server.chat import ChatTemplateError
    from shunter.server.serve import drain_on_signal, serve_app
    from shunter.server.settings import ServerSettings

    settings = ServerSettings(
        api_key=args.api_key, served_model_name=args.served_model_name,
        chat_template=args.chat_template, max_body_bytes=args.max_body_bytes)
    async with start_engine(config, args) as engine:
        try:
            app = build_app(engine, settings)
        except ChatTemplateError as exc:
            raise ConfigError(str(exc)) from None
        state = app.state.server

        async def trigger() -> None:
            await drain_on_signal(state, args.drain_timeout)

        async with anyio.create_task_group() as tg:
            url = await tg.start(lambda task_status: serve_app(
                app, args.host, args.port, shutdown_trigger=trigger, task_status=task_status))
            print(f"shunter: serving {state.model_name} on {url} "
                  f"(policy {engine.policy.settings.name}; Ctrl-C to stop)", flush=True)


def run(args: argparse.Namespace) -> int:
    config = engine_config(args, backend=args.backend, **cluster_fields(args))
    try:
        anyio.run(serve, config, args, backend=args.async_backend)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    return 0
