"""`dflash-iree serve`: an OpenAI-compatible HTTP server on starlette + uvicorn.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (whole or `stream: true` as
server-sent events), `GET /v1/models`, `GET /health` (503 while the model loads, 200 after),
`GET /metrics` (Prometheus text, runtime/serve_metrics.py). The request format is
runtime/openai_api.py's; runtime/scheduler.py's worker thread owns the engine. With `--api-key`
every route but /health needs `Authorization: Bearer KEY`.

A client that leaves (a closed stream, or a whole request's connection) has its request cancelled:
the engine frees its stream at the next step. SIGTERM (and Ctrl-C) stop accepting, let the running
and queued requests finish for up to `--shutdown-timeout` seconds, then cancel what remains through
the scheduler, so that each of those still gets an answer: a whole request a 503 ("send it again"),
a stream an error event and `data: [DONE]` after the tokens it had; then the server exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import socket
import sys
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from dflash_iree.errors import DFlashError

from . import openai_api as api
from .scheduler import QueueFull, Rejected, Scheduler, Submission, Unavailable
from .serve_metrics import CONTENT_TYPE_LATEST, ServeMetrics

RETRY_AFTER_S = 1  # a full queue drains at the speed of a request; a loading model takes longer
LOADING_RETRY_AFTER_S = 5
DISCONNECT_POLL_S = 0.25
# After --shutdown-timeout the requests left are cancelled; uvicorn kills the handlers this much later
# (a 500 and a cut stream), by which time each has sent its cancelled answer: the next step ends them.
SHUTDOWN_GRACE_S = 10.0
STOPPED = "the server stopped while the request ran; send it again"


class _ClientGone(Exception):
    """The client closed the connection before its response was whole."""


def _error(e: api.ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(scheduler: Scheduler, metrics: ServeMetrics, model: str, api_key: str | None = None) -> Starlette:
    """The starlette application over a Scheduler (whose worker it starts and stops with its lifespan).

    Args:
        model: the id this server answers to (GET /v1/models; a request's "model" must equal it
            when given).
        api_key: the bearer token every route but /health requires; None: no authentication.
    """

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110, 11.1); the token is compared in constant time
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), api_key.encode())

    def guarded(handler):
        async def route(request: Request):
            if not authorized(request):
                metrics.rejected.labels("unauthorized").inc()
                return _error(api.ApiError(401, "missing or wrong API key: send the header "
                                           "'Authorization: Bearer KEY' with the server's --api-key", None,
                                           "invalid_api_key"), {"WWW-Authenticate": "Bearer"})
            return await handler(request)
        return route

    async def health(request: Request):
        if scheduler.error:
            return JSONResponse({"status": "error", "error": scheduler.error}, status_code=503)
        if not scheduler.ready:
            return JSONResponse({"status": "loading"}, status_code=503,
                                headers={"Retry-After": str(LOADING_RETRY_AFTER_S)})
        return JSONResponse({"status": "ok"})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "created": 0,
                                                         "owned_by": "dflash-iree"}]})

    async def metrics_route(request: Request):
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    async def completions(request: Request):
        return await _generate(request, "completions")

    async def chat(request: Request):
        return await _generate(request, "chat")

    async def _generate(request: Request, kind: str):
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise api.ApiError(400, f"the request body is not valid JSON ({e})") from None
            p = api.parse(kind, body, model)
            rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
            sub = Submission(rid, p.prompt, p.options, p.max_tokens, p.enable_thinking)
            try:
                scheduler.submit(sub)
            except QueueFull as e:
                metrics.rejected.labels("queue_full").inc()
                return _error(api.ApiError(429, str(e), None, "queue_full"), {"Retry-After": str(RETRY_AFTER_S)})
            except Unavailable as e:
                metrics.rejected.labels("unavailable").inc()
                return _error(api.ApiError(503, str(e)), {"Retry-After": str(LOADING_RETRY_AFTER_S)})
            getter = _Getter(request, sub, scheduler)
            try:
                first = await getter.next()
            except _ClientGone:
                return Response(status_code=499)  # nobody reads it
            if isinstance(first, Rejected):
                raise api.ApiError(first.status, first.message, api.param_of(first.message))
        except api.ApiError as e:
            metrics.rejected.labels("bad_request" if e.status < 500 else
                                    "unavailable" if e.status == 503 else "error").inc()
            return _error(e)
        if p.stream:
            return StreamingResponse(_events(kind, rid, sub, p, first, getter), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(kind, rid, sub, p, first, getter)

    async def _whole(kind, rid, sub, p, item, getter):
        ids, text = [], []
        try:
            while True:
                if isinstance(item, Rejected):
                    return _error(api.ApiError(item.status, item.message))
                ids += item.token_ids
                text.append(item.text)
                if item.finished:
                    break
                item = await getter.next()
        except _ClientGone:
            return Response(status_code=499)
        if item.result is None:  # cancelled before it started (the server is stopping)
            return _error(api.ApiError(503, "the server stopped before the request ran; send it again"))
        if item.finish_reason == "cancelled":  # the client is still here: the server is stopping
            return _error(api.ApiError(503, STOPPED))
        extra = {"usage": api.usage(len(sub.prompt_ids), len(ids)), "timings": _timings(sub, item)}
        return JSONResponse(api.completion(kind, rid, model, "".join(text), ids if p.return_token_ids else None,
                                           item.finish_reason, extra))

    async def _events(kind, rid, sub, p, item, getter):
        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        done = False
        try:
            if kind == "chat":
                yield sse(api.chunk(kind, rid, model, "", [] if p.return_token_ids else None, role=True))
            n = 0
            while True:
                if isinstance(item, Rejected):  # an engine fault mid-stream: OpenAI's error object as an event
                    yield sse(api.ApiError(item.status, item.message).body())
                    break
                n += len(item.token_ids)
                ids = item.token_ids if p.return_token_ids else None
                if item.finished:
                    extra = {"timings": _timings(sub, item)} if item.result is not None else {}
                    yield sse(api.chunk(kind, rid, model, item.text, ids, item.finish_reason, extra=extra))
                    if item.finish_reason == "cancelled":  # the client is still reading: the server is stopping
                        yield sse(api.ApiError(503, STOPPED).body())
                    if p.include_usage:
                        yield sse(api.chunk(kind, rid, model, None, None, extra={
                            "usage": api.usage(len(sub.prompt_ids), n)}, choices=False))
                    done = True
                    break
                if item.text or (ids and p.return_token_ids):
                    yield sse(api.chunk(kind, rid, model, item.text, ids))
                item = await getter.next(watch=False)  # starlette cancels us when the client leaves
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                scheduler.cancel(sub.request_id)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    routes = [Route("/health", health), Route("/metrics", guarded(metrics_route)),
              Route("/v1/models", guarded(models)),
              Route("/v1/completions", guarded(completions), methods=["POST"]),
              Route("/v1/chat/completions", guarded(chat), methods=["POST"])]

    async def no_route(request: Request, exc):
        """404 and 405 in OpenAI's error shape, as every other refusal."""
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "another method")
            message = f"{where}: the method is not allowed here; use {allowed}"
        else:
            message = f"{where}: no such route; the routes are {', '.join(r.path for r in routes)}"
        return _error(api.ApiError(exc.status_code, message), exc.headers)

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: no_route, 405: no_route})


def _timings(sub: Submission, ev) -> dict:
    return api.timings(len(sub.prompt_ids), ev.result, max(sub.t_admit - sub.t_arrival, 0.0))


class _Getter:
    """A request's next item from its queue; while the response has not started, it also watches
    for the client leaving (then cancels the request and raises _ClientGone)."""

    def __init__(self, request: Request, sub: Submission, scheduler: Scheduler):
        self.request, self.sub, self.scheduler = request, sub, scheduler

    async def next(self, watch: bool = True):
        get = asyncio.ensure_future(self.sub.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S if watch else None)
                # checked on every event too: a whole response's client may leave between two rounds
                if watch and await self.request.is_disconnected():
                    self.scheduler.cancel(self.sub.request_id)
                    raise _ClientGone()
                if done:
                    return get.result()
        finally:
            get.cancel()


def serve(artifacts: str, target: str | None = None, drafter: str | None = None, device: str | None = None,
          host: str = "127.0.0.1", port: int = 8000, parallel: int | None = None, api_key: str | None = None,
          max_queue: int = 64, model_name: str | None = None, shutdown_timeout: float = 30.0,
          log_level: str = "info") -> int:
    """Serve `artifacts` over HTTP until SIGTERM or Ctrl-C; returns the exit status (0).

    The artifacts' manifest, `--parallel` and the address are checked, and the socket bound, before
    anything starts; the weights load in the worker thread while /health answers 503.

    Raises:
        DFlashError: a bad artifact folder, `parallel` outside 1..the artifacts' streams (the fix:
            compile with --streams N), `max_queue` < 1, a negative `shutdown_timeout`, an address
            that cannot be bound, or an engine that fails to load (the server then stops).
        KeyboardInterrupt: after Ctrl-C, once the server has shut down.
    """
    import uvicorn

    from dflash_iree import validate

    from .artifacts import Artifacts

    arts = Artifacts.load(artifacts)
    streams = int(arts.manifest.streams)
    if parallel is None:
        parallel = streams
    validate.count(parallel, "--parallel", "streams served at once")
    if parallel > streams:
        raise DFlashError(f"--parallel {parallel} is more than the {streams} stream{'s' * (streams != 1)} that "
                          f"{artifacts} was compiled for (manifest streams); use --parallel {streams}, or recompile "
                          f"with dflash-iree compile --streams {parallel}")
    validate.count(max_queue, "--max-queue", "requests that may wait for a stream")
    validate.integer(port, "--port", 0, 65535)
    shutdown_timeout = validate.seconds(shutdown_timeout, "--shutdown-timeout")
    model = model_name or arts.checkpoint_folder("target", target).name
    sock = _bind(host, port)
    metrics = ServeMetrics(arts.block_size)
    server: uvicorn.Server | None = None

    def load():
        from .batch import BatchEngine
        from .engine import Engine
        from .solo import SoloEngine

        loaded = Engine.load(artifacts, target, drafter, device)
        # one stream: the one-stream module's own calls (decode ahead, the fused round); several: one round for all
        engine = BatchEngine(loaded) if streams > 1 else SoloEngine(loaded)
        print("dflash-iree: the model is loaded; serving", file=sys.stderr, flush=True)
        return engine

    def failed(message: str) -> None:
        server.should_exit = True

    scheduler = Scheduler(load, metrics, max_queue, failed, parallel)
    config = uvicorn.Config(build_app(scheduler, metrics, model, api_key), log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + SHUTDOWN_GRACE_S)
    server = _draining_server(config, scheduler, shutdown_timeout)
    # uvicorn raises the signal it stopped for again once it has shut down; a no-op handler makes a
    # SIGTERM stop end with status 0, as a stop asked for (Ctrl-C keeps Python's KeyboardInterrupt: 130)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"dflash-iree: serving {model!r} ({artifacts}, {parallel} stream{'s' * (parallel != 1)}) on "
          f"http://{_url_host(bound_host)}:{bound_port}; loading the model", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if scheduler.error and not scheduler.ready:
        raise DFlashError(scheduler.error)
    return 0


def _draining_server(config, scheduler: Scheduler, drain_s: float):
    """uvicorn's Server, whose shutdown (SIGTERM, Ctrl-C) cancels the requests still running or
    queued `drain_s` seconds after it began, through `scheduler.cancel_all`: they end as cancelled
    requests, answered (module docstring), before uvicorn's own graceful timeout would cancel their
    handlers' tasks (SHUTDOWN_GRACE_S later)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            async def cancel_late():
                await asyncio.sleep(drain_s)
                scheduler.cancel_all()

            late = asyncio.ensure_future(cancel_late())
            try:
                await super().shutdown(sockets)
            finally:
                late.cancel()

    return DrainingServer(config)


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one), or a DFlashError naming the address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        raise DFlashError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose another "
                          "--port (0: any free one) or --host") from None
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
