"""The HTTP gateway: OpenAI- and TGI-compatible routes in front of the Celery queue.

    weightq gateway            # or: uvicorn --factory weightq.gateway:create_app

Every generation request becomes a `weightq.generate` job; streaming responses follow the job's
Redis stream. A client that disconnects cancels its job. Bad input is a 4xx whose JSON names the
field; the gateway holds no model and no GPU, so any number of gateways can front the same Redis.
"""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from kombu.exceptions import OperationalError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from weightq.settings import Settings
from weightq.tasks.contract import JobFailed
from weightq.tasks.request import RequestError

from . import lora_routes, openai_api, openai_routes, tgi_api, tgi_routes
from .core import VERSION, Gateway
from .errors import HTTPError, error_response
from .guard import Guard

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, url: str | None = None) -> FastAPI:
    gw = Gateway(settings or Settings.from_env(), url)
    app = FastAPI(title="weightq gateway", version=VERSION, lifespan=gw.lifespan)
    app.state.gateway = gw
    app.add_middleware(Guard, gateway=gw)
    # outermost: the client's address from X-Forwarded-For, when a trusted proxy sent it (Guard's limits)
    app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=gw.settings.gateway.trusted_proxies)

    @app.exception_handler(HTTPError)
    async def on_http_error(request: Request, e: HTTPError) -> Response:
        return error_response(request.url.path, e)

    def client_field(path: str, field: str | None) -> str | None:
        """The field as the client sent it (OpenAI's max_tokens is the job's max_new_tokens)."""
        names = openai_api.CLIENT_FIELDS if path.startswith("/v1/") else tgi_api.CLIENT_FIELDS
        return names.get(field, field) or None if field else None

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError) -> Response:
        path = request.url.path
        return error_response(path, HTTPError(400, str(e), client_field(path, e.field)))

    @app.exception_handler(JobFailed)
    async def on_job_failed(request: Request, e: JobFailed) -> Response:
        # the worker refused the request (a field is named: the client's fault) or failed the job
        path = request.url.path
        field = client_field(path, e.field)
        return error_response(path, HTTPError(400 if field else 500, str(e), field))

    @app.exception_handler(redis.RedisError)
    @app.exception_handler(OperationalError)
    async def on_broker_down(request: Request, e: Exception) -> Response:
        log.warning("queue unavailable: %s", e)
        return error_response(request.url.path, HTTPError(503, f"queue unavailable: {e}", None, "unavailable"))

    openai_routes.register(app, gw)
    lora_routes.register(app, gw)
    tgi_routes.register(app, gw)

    @app.get("/live")
    def live() -> Response:
        """Liveness: the process answers. Never on Redis or the workers, or a Kubernetes liveness
        probe would restart every gateway whenever they are gone."""
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    def ready() -> Response:
        """Readiness: the gateway can take jobs (its Redis answers). Not on the workers: with none
        (scaled to zero) jobs must still be taken, so that the queue grows and an autoscaler adds one."""
        try:
            for shard in gw.client.plane.shards:
                shard.ping()
            gw.client.broker.ping()
        except redis.RedisError as e:
            return JSONResponse({"status": "redis unreachable", "error": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health")
    def health() -> Response:
        """For people and load balancers that route only to a stack that can answer now: 503 without
        a live worker. (Kubernetes: /live and /ready.)"""
        try:
            for shard in gw.client.plane.shards:  # the token plane's servers
                shard.ping()
            gw.client.broker.ping()  # the same server unless STREAMS_REDIS_URL is set
        except redis.RedisError as e:
            return JSONResponse({"status": "redis unreachable", "error": str(e)}, status_code=503)
        n = len(gw.workers())
        return JSONResponse({"status": "ok" if n else "no workers", "workers": n}, status_code=200 if n else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        """This gateway's own series: scrape every gateway."""
        return Response(generate_latest(gw.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/cluster")
    def cluster_metrics() -> Response:
        """Every live worker's series, the queue depth and the dead letters, read from Redis: the same
        from any gateway, so scrape it as one target (never every gateway: that counts each twice)."""
        return Response(generate_latest(gw.cluster), media_type=CONTENT_TYPE_LATEST)

    return app
