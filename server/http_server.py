"""The FastAPI app: SGLang-native routes, OpenAI-compatible routes, health, info and metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse, Response

from treespec.sampling_params import SamplingParams
from treespec.server.io_struct import GenerateReq
from treespec.server.metrics import render_metrics
from treespec.server.openai_api import OpenAIServing
from treespec.server.protocol import (
    ApiError,
    ModelLimits,
    parse_abort,
    parse_detokenize,
    parse_generate,
    parse_json_body,
    parse_tokenize,
)
from treespec.server.streaming import (
    SSE_DONE,
    SSEResponse,
    gather_or_cancel,
    json_response,
    merge,
    sse,
    started,
)
from treespec.server.tokenizer_manager import Chunk, TokenizerManager

if TYPE_CHECKING:  # a type only: this process (HTTP) stays free of the model stack
    from treespec.args import ServerArgs

logger = logging.getLogger("treespec.http_server")

HEALTH_GENERATE_TIMEOUT_S = 20.0
VERSION = "0.1.0"


@dataclass
class ServerState:
    """What the launcher knows about the running server; read by /health and the info routes."""

    args: ServerArgs
    model_dir: str
    tokenizer_path: str
    model_name: str
    limits: ModelLimits
    procs: dict[str, Any] = field(default_factory=dict)  # name -> multiprocessing.Process
    ipc_dir: str = ""
    ready: bool = False
    unhealthy: str | None = None
    start_time: float = field(default_factory=time.time)

    def problem(self) -> str | None:
        if self.unhealthy:
            return self.unhealthy
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"the {name} process (pid {proc.pid}) exited with code {proc.exitcode}"
        return None if self.ready else "starting"

    def public_args(self) -> dict[str, Any]:
        args = dataclasses.asdict(self.args)
        if args.get("api_key"):
            args["api_key"] = "<redacted>"
        return args


class ApiKeyMiddleware:
    """Bearer-token auth on every route except /health (pure ASGI, so streaming is untouched)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        err = ApiError("missing or invalid API key: send 'Authorization: Bearer <key>'", status=401,
                       code="invalid_api_key")
        await json_response(err.body(), 401)(scope, receive, send)


def create_app(state: ServerState, tm: TokenizerManager) -> FastAPI:
    served = {state.model_name, state.args.model_path or state.model_name, "default"}
    openai = OpenAIServing(tm, state.model_name, served)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        yield
        await tm.close()

    app = FastAPI(title="treespec", version=VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    if state.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.args.api_key)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        return json_response(exc.body(), exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        err = ApiError(f"internal server error: {type(exc).__name__}: {exc}", status=500, type="server_error")
        return json_response(err.body(), 500)

    async def body_of(request: Request) -> dict[str, Any]:
        return parse_json_body(await request.body())

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Response:
        problem = state.problem()
        if problem:
            return json_response({"status": "unhealthy", "reason": problem}, 503)
        return json_response({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        if state.problem():
            return json_response({"status": "unhealthy", "reason": state.problem()}, 503)
        ids = tm.tokenizer.encode("Hi", add_special_tokens=False) or [0]
        gen = GenerateReq(ids, SamplingParams(max_new_tokens=1, temperature=0))
        try:
            await asyncio.wait_for(tm.generate_full(gen, request), HEALTH_GENERATE_TIMEOUT_S)
        except (TimeoutError, ApiError) as e:
            return json_response({"status": "unhealthy", "reason": str(e) or "timed out"}, 503)
        return json_response({"status": "ok"})

    # SGLang serves the info routes as /model_info and /server_info; the /get_ names are its old ones
    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> Response:
        return json_response({"model_path": state.model_dir, "tokenizer_path": state.tokenizer_path,
                              "served_model_name": state.model_name, "is_generation": True,
                              "context_length": state.limits.context_len})

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> Response:
        stats = (await tm.control("get_stats")).data
        pids = {"launcher": os.getpid(), **{name: p.pid for name, p in state.procs.items()}}
        return json_response({
            **state.public_args(),
            "version": VERSION,
            "model_dir": state.model_dir,
            "served_model_name": state.model_name,
            "context_len": state.limits.context_len,
            "max_total_num_tokens": state.limits.max_total_num_tokens,
            "pids": pids,
            "ipc_dir": state.ipc_dir,
            "stats": stats,
            "kv_pool_balanced": stats.get("kv_pool_balanced"),
            "avg_spec_accept_length": stats.get("avg_spec_accept_length"),
            "internal_states": [stats],
            "num_pending_http_requests": tm.num_pending(),
            "num_client_aborts": tm.num_client_aborts,
            "uptime_s": time.time() - state.start_time,
        })

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        reply = await tm.control("flush_cache")
        if not reply.ok:
            raise ApiError("cannot flush the cache while requests are running or waiting; retry when idle")
        return json_response({"success": True, "message": "Cache flushed."})

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = (await tm.control("get_stats")).data
        text = render_metrics(stats, state.model_name) + tm.latency.render(state.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ tokenizer (HTTP process only)
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        prompts, single, add_special = parse_tokenize(await body_of(request))
        tokens = [tm.tokenizer.encode(p, add_special_tokens=add_special) for p in prompts]
        counts = [len(t) for t in tokens]
        return json_response({"tokens": tokens[0] if single else tokens, "count": counts[0] if single else counts,
                              "max_model_len": state.limits.context_len})

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(request: Request) -> Response:
        lists, single, skip = parse_detokenize(await body_of(request), state.limits.vocab_size)
        texts = [tm.tokenizer.decode(ids, skip_special_tokens=skip) for ids in lists]
        return json_response({"text": texts[0] if single else texts})

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": int(state.start_time), "owned_by": "treespec",
            "root": state.model_dir, "max_model_len": state.limits.context_len}]})

    # ------------------------------------------------------------------ generation
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        inputs, single, stream = parse_generate(await body_of(request), tm.tokenizer)
        for g in inputs:
            tm.validate(g)
        if stream:
            streams = [tm.generate(g, request) for g in inputs]
            if any(g.sampling_params.grammar is not None for g in inputs):
                streams = await started(streams)  # a grammar the scheduler refuses is a 400, not an event
            return SSEResponse(_generate_stream(streams, single))
        results = await gather_or_cancel([tm.generate_full(g, request) for g in inputs])
        outs = [{"text": c.text, "output_ids": c.output_ids, "meta_info": c.meta_info} for c in results]
        return json_response(outs[0] if single else outs)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        rid, abort_all = parse_abort(await body_of(request))
        return json_response({"aborted": tm.abort(rid, abort_all)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai.completions(await body_of(request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai.chat(await body_of(request), request)

    return app


@dataclass
class _StreamedOutput:
    """One request of a native /generate stream, whose events carry everything so far (SGLang's form)."""

    text: str = ""
    output_ids: list[int] = field(default_factory=list)

    def event(self, c: Chunk) -> dict[str, Any]:
        if c.finished:  # the exact final text, all ids and logprobs
            return {"text": c.text, "output_ids": c.output_ids, "meta_info": c.meta_info}
        self.text += c.delta
        self.output_ids += c.new_ids
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": c.meta_info}


async def _generate_stream(streams: list[AsyncIterator[Chunk]], single: bool):
    """SGLang-native stream: each event carries the text and output ids so far."""
    streamed = [_StreamedOutput() for _ in streams]
    try:
        async for i, c in merge(streams):
            out = streamed[i].event(c)
            if not single:
                out["index"] = i
            yield sse(out)
    except ApiError as e:
        yield sse(e.body())
    yield SSE_DONE
