"""The OpenAI-compatible HTTP server: the FastAPI app (completions, chat, models, health, metrics, the chat page
at /), its error bodies and API-key check, and the `specserve serve` command that runs it under uvicorn.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from specserve import __version__
from specserve.server.async_engine import AsyncLLM
from specserve.server.chat import create_chat_completion
from specserve.server.completions import create_completion
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ErrorResponse,
    ModelCard, ModelList)
from specserve.server.replicas import BACKENDS, ReplicaClient
from specserve.server.serving import APIError, ServingContext

logger = logging.getLogger("specserve.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")  # the chat page served at /
# The page loads and talks to nothing but its own origin; model text never runs as script (no inline scripts).
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
_ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "Invalid request: `error.param` names the offending field"), (401, "Missing or wrong API key"),
    (503, "Too many requests waiting (see Retry-After), or shutting down"))}


def error_response(status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# ------------------------------------------------------------------------------------------- the app


def build_app(ctx: ServingContext, metrics: ServerMetrics, api_key: str | None = None) -> FastAPI:
    """The app; its lifespan starts the engine thread and stops it (aborting what still runs)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine.start()
        logger.info("serving %s (max_model_len %d)", ", ".join(ctx.served_model_names), ctx.max_model_len)
        yield
        await ctx.engine.shutdown()

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions with speculative decoding.")
    app.state.ctx, app.state.metrics = ctx, metrics
    _add_error_handlers(app)
    if api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=api_key)
    _add_routes(app, ctx, metrics)
    app.openapi = lambda: _openapi(app)
    return app


def _add_routes(app: FastAPI, ctx: ServingContext, metrics: ServerMetrics) -> None:
    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}, **_ERRORS})
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(ctx, request, raw_request)

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(ctx, request, raw_request)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
                               for name in ctx.served_model_names])

    @app.get("/health", responses={503: {"description": "the engine is not running (with replicas: none is)"}})
    async def health() -> Response:
        status = 200 if ctx.engine.is_running else 503
        replica_states = getattr(ctx.engine, "replica_states", None)  # only the replica router has them
        if replica_states is None:
            return Response(status_code=status)
        states = replica_states()
        return JSONResponse({"replicas_alive": sum(s["alive"] for s in states), "replicas": states},
                            status_code=status)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> Response:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"), headers=PAGE_HEADERS)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.type, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # raised by the body parser's json.loads
            message = "the request body is not valid JSON: it nests objects and arrays too deeply to decode"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {exc!r}", type="server_error")


def describe_validation_error(errors) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: param is the top-level body field at fault."""
    if not errors:
        return "invalid request", None
    # A union field gets one error per alternative: the one whose type the value has says what is wrong with it.
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc:
        return f"the request body must be a JSON object ({first.get('msg')})", None
    param = str(loc[0])
    where = ".".join(str(p) for p in loc)
    return f"{where}: {first.get('msg')}", param


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, with our 400 error body in place of its 422 (we answer invalid input with 400)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for op in operations.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


class BearerAuthMiddleware:
    """Requires `Authorization: Bearer <api_key>` on /v1/*; /health and /metrics stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ------------------------------------------------------------------------------------------- serve command


def add_serve_parser(sub) -> None:
    """`specserve serve`, added to the CLI's subparsers."""
    from specserve.engine_args import add_engine_args

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health, "
                                   "/metrics and a chat page at / with uvicorn.")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model file or folder's name)")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPECSERVE_API_KEY, else none)")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="requests queued before scheduling beyond which new ones get 503 (default: %(default)s)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may run on after SIGTERM before they are aborted")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind this server, each in its own process (or Ray actor) with its own "
                        "KV cache; new requests go to the least-loaded live one (default: %(default)s)")
    p.add_argument("--data-parallel-backend", choices=BACKENDS, default="mp",
                   help="where replicas run: mp, local processes; ray, Ray actors, one CPU bundle each "
                        "(needs pip install specserve[ray]) (default: %(default)s)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster to place replicas on (default: $RAY_ADDRESS, else a cluster started on this "
                        "host with `ray start`, else a new local Ray instance)")
    p.set_defaults(func=cmd_serve)


def served_model_names(args) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model is None:
        return [DEFAULT_MODEL_NAME]
    name = os.path.basename(os.path.normpath(args.model))
    return [name[: -len(".gguf")] if name.endswith(".gguf") else name]


def build_app_from_args(args) -> FastAPI:
    from specserve.engine_args import engine_kwargs
    from specserve.config import EngineConfig
    from specserve.engine.engine import LLMEngine

    if args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    dp_size, dp_backend = getattr(args, "data_parallel_size", 1), getattr(args, "data_parallel_backend", "mp")
    if dp_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {dp_size}")
    if getattr(args, "ray_address", None) and dp_backend != "ray":
        raise ValueError("--ray-address needs --data-parallel-backend ray")
    if dp_backend == "ray":
        from specserve.server.replicas.ray_actor import import_ray

        try:
            import_ray()
        except ImportError as exc:  # a missing extra is the user's setup, reported like bad input
            raise ValueError(str(exc)) from None
    config = EngineConfig(**engine_kwargs(args))
    names = served_model_names(args)
    if dp_size > 1 or dp_backend == "ray":
        return _build_replicated_app(args, config, names)
    engine = LLMEngine(config)
    async_engine = AsyncLLM(engine, max_waiting_requests=args.max_waiting_requests)
    metrics = ServerMetrics(async_engine, names[0])
    async_engine.stat_logger = metrics
    ctx = ServingContext(async_engine, engine.tokenizer, names, engine.max_model_len,
                         engine.model.config.vocab_size, args.model)
    return build_app(ctx, metrics, api_key=args.api_key)


def _build_replicated_app(args, config, names: list[str]) -> FastAPI:
    """The app over `--data-parallel-size` replicas: the router process keeps only the tokenizer; each
    replica loads the model and owns its KV cache."""
    from specserve.tokenizer import load_tokenizer

    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
    client = ReplicaClient(config, args.data_parallel_size, args.data_parallel_backend,
                           max_waiting_requests=args.max_waiting_requests, ray_address=args.ray_address,
                           log_level=args.log_level)
    metrics = ServerMetrics(client, names[0], num_replicas=args.data_parallel_size)
    client.stat_logger = metrics
    info = client.launch()
    ctx = ServingContext(client, tokenizer, names, info.max_model_len, info.vocab_size, args.model)
    return build_app(ctx, metrics, api_key=args.api_key)


def cmd_serve(args) -> int:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop accepting, let in-flight requests run for --shutdown-timeout seconds,
        abort the rest (their responses end with an error event or a 503), then shut uvicorn down."""

        async def shutdown(self, sockets=None) -> None:
            for server in self.servers:
                server.close()
            await ctx.engine.shutdown(drain_timeout=args.shutdown_timeout)
            await super().shutdown(sockets)

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = build_app_from_args(args)
    ctx = app.state.ctx
    # uvicorn's own timeout is only a backstop: the engine has aborted what was left by then.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    DrainingServer(config).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve-serve")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
