"""The cluster's HTTP front: SGLang's API on one port, routed over prefill and decode instances.

Per generation request (``/generate``, ``/v1/completions``, ``/v1/chat/completions``), after
:mod:`banaserve.cluster.placement` has decided whether it needs a handoff:

1. *Prefill* (handoff only): one token of the request on the prefill instance the policy
   picks; that instance writes the prompt's KV pages to the store. A prefill that cannot be
   reached is retried on another; if none answers, step 2 computes the prompt itself (slower,
   never wrong). A 4xx (bad input) goes back to the client as is.
2. *Decode*: the unchanged request on the instance the decode policy picks among the decode
   instances (and the prefill instances too, for a short direct request), whose answer
   (streamed or not) goes back to the client byte for byte. With no decode instance healthy,
   a prefill instance serves the whole request, so the cluster keeps serving.

Faults: an instance that refuses connections leaves routing at once, one whose polls fail
within a few seconds (:mod:`banaserve.cluster.load_board`). A request is retried on another
instance while nothing has reached the client; after that the stream ends with an error
event. A client never waits on an instance that has left routing: its request is cut loose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from banaserve.cluster.load_board import LoadBoard
from banaserve.cluster.placement import Placement, Placer
from banaserve.cluster.prometheus import render_metrics
from banaserve.cluster.request_shape import (
    GENERATION_PATHS,
    RequestShape,
    computed_prompt_tokens,
    prefill_body,
    shape_request,
)
from banaserve.cluster.topology import DECODE, PREFILL
from banaserve.router.policies import NoHealthyInstance, Policy

logger = logging.getLogger("banaserve.cluster")

T = TypeVar("T")

JSON = "application/json"
#: The longest a direct request waits for the prefill step of the handoff it follows.
FOLLOW_WAIT_S = 30.0
#: Paths answered by any one instance (they describe the model, not one instance's state).
INFO_PATHS = ("/v1/models", "/get_model_info", "/model_info", "/get_server_info",
              "/server_info")  # fmt: skip


class InstanceGone(Exception):
    """The instance a request was waiting on left routing (died or stopped answering)."""


def error_response(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """An error in the shape SGLang's OpenAI server uses (its native API reads it too)."""
    payload = {"object": "error", "message": message, "type": kind, "code": status}
    return web.json_response(payload, status=status)


@dataclass
class GatewayCounters:
    requests: int = 0
    handoffs: int = 0
    direct: int = 0
    direct_on_prefill: int = 0
    followed: int = 0
    retries: int = 0
    errors: int = 0
    fallbacks_to_prefill: int = 0
    started_at: float = field(default_factory=time.time)


class Gateway:
    """Routes requests. Owns the aiohttp client session, opened and closed with the app
    (:meth:`app`); every handler runs on that app's event loop, so no state is locked."""

    def __init__(
        self,
        board: LoadBoard,
        prefill_policy: Policy,
        decode_policy: Policy,
        count_tokens: Callable[[str], int] | None = None,
        placer: Placer | None = None,
        extra_info: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.board = board
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.count_tokens = count_tokens
        self.placer = placer if placer is not None else Placer()
        self._prefilling: dict[str, asyncio.Event] = {}  # by prompt, handoffs in prefill
        self.extra_info = extra_info
        self.counters = GatewayCounters()
        self.session: aiohttp.ClientSession | None = None

    # -- app ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        for path in GENERATION_PATHS:
            app.router.add_post(path, self.handle_generation)
        for path in INFO_PATHS:
            app.router.add_get(path, self.handle_info)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/health_generate", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/cluster", self.handle_cluster)
        app.router.add_post("/flush_cache", self.handle_flush_cache)
        app.router.add_get("/flush_cache", self.handle_flush_cache)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(limit=0),
        )

    async def _close_session(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # -- generation --------------------------------------------------------------------------

    async def handle_generation(self, request: web.Request) -> web.StreamResponse:
        self.counters.requests += 1
        path = request.path
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return error_response(400, f"The request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "The request body must be a JSON object.")
        shape = shape_request(path, body, self.count_tokens)
        placement = self.placer.place(shape)
        if placement.handoff:
            done = self._prefilling.setdefault(shape.prompt, asyncio.Event())
            try:
                refused = await self._prefill(shape, body)
            finally:
                self.placer.prefilled(shape.prompt)
                done.set()
                if self._prefilling.get(shape.prompt) is done:
                    del self._prefilling[shape.prompt]
            if refused is not None:
                return refused
            self.counters.handoffs += 1
            placement = Placement(handoff=True, uncached_tokens=0, any_role=False)
        else:
            self.counters.direct += 1
            followed = self._prefilling.get(placement.follows or "")
            if followed is not None:
                self.counters.followed += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(followed.wait(), FOLLOW_WAIT_S)
        return await self._decode(request, shape, raw, placement)

    async def _prefill(self, shape: RequestShape, body: dict[str, Any]) -> web.Response | None:
        """Run the prompt on a prefill instance. Returns the response to give the client when
        the instance refused the request (4xx), else None (also when no prefill could be
        reached: the decode instance then computes the prompt itself)."""
        if not self.board.healthy(PREFILL):
            return None
        payload = prefill_body(shape.path, body)
        tried: set[str] = set()
        while True:
            candidates = [c for c in self.board.healthy(PREFILL) if c.url not in tried]
            if not candidates:
                return None
            url = self.prefill_policy.choose(candidates, shape.prompt).url
            tried.add(url)
            self.board.begin(url, shape.prompt_tokens)
            try:
                status, data = await self._race(self._post_json(url + shape.path, payload), url)
            except (aiohttp.ClientError, OSError, InstanceGone) as exc:
                self.board.mark_failed(url, f"prefill request failed: {exc!r}")
                self.counters.retries += 1
                continue
            finally:
                self.board.end(url, shape.prompt_tokens)
                self.prefill_policy.on_done(url, shape.prompt)
            if 400 <= status < 500:
                return web.Response(status=status, body=data, content_type=JSON)
            if status != 200:
                logger.warning("prefill on %s answered %d: %s", url, status, data[:300])
                self.counters.retries += 1
                continue
            self._count_prompt(url, shape.path, data)
            return None

    def _count_prompt(self, url: str, path: str, reply: bytes) -> None:
        """Book the prompt tokens an instance's JSON reply says it computed."""
        try:
            self.board.count_prompt(url, *computed_prompt_tokens(path, json.loads(reply)))
        except ValueError:
            pass  # not JSON: nothing to book

    async def _post_json(self, url: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        assert self.session is not None
        async with self.session.post(url, json=payload) as response:
            return response.status, await response.read()

    def _decode_candidates(self, any_role: bool) -> list[Any]:
        candidates = self.board.healthy(DECODE)
        if any_role:
            return candidates + self.board.healthy(PREFILL)
        if candidates:
            return candidates
        fallback = self.board.healthy(PREFILL)
        if fallback:
            if self.counters.fallbacks_to_prefill == 0:
                logger.warning("no decode instance is healthy: prefill instances decode too")
            self.counters.fallbacks_to_prefill += 1
        return fallback

    async def _decode(
        self, request: web.Request, shape: RequestShape, raw: bytes, placement: Placement
    ) -> web.StreamResponse:
        """Serve the request on a decode instance (or, for ``placement.any_role``, any one).
        ``placement.uncached_tokens`` count as the instance's queued prefill work meanwhile."""
        assert self.session is not None
        tried: set[str] = set()
        last_error = "no decode instance is healthy"
        prefill_tokens = placement.uncached_tokens
        while True:
            candidates = [
                c for c in self._decode_candidates(placement.any_role) if c.url not in tried
            ]
            if not candidates:
                self.counters.errors += 1
                return error_response(
                    503, f"No instance could serve the request: {last_error}.",
                    "ServiceUnavailableError",
                )  # fmt: skip
            try:
                url = self.decode_policy.choose(candidates, shape.prompt).url
            except NoHealthyInstance as exc:
                self.counters.errors += 1
                return error_response(503, str(exc), "ServiceUnavailableError")
            tried.add(url)
            if self.board.loads[url].role == PREFILL:
                self.counters.direct_on_prefill += 1
            self.board.begin(url, prefill_tokens)
            try:
                return await self._relay(request, url, shape, raw)
            except (aiohttp.ClientError, OSError, InstanceGone) as exc:
                # Nothing reached the client yet (_relay handles failures after that).
                last_error = f"{url} failed: {exc!r}"
                self.board.mark_failed(url, f"decode request failed: {exc!r}")
                self.counters.retries += 1
            finally:
                self.board.end(url, prefill_tokens)
                self.decode_policy.on_done(url, shape.prompt)

    async def _relay(
        self, request: web.Request, url: str, shape: RequestShape, raw: bytes
    ) -> web.StreamResponse:
        """Send the request to ``url`` and pass its answer through. Raises (for a retry) only
        while nothing has been sent to the client."""
        assert self.session is not None
        headers = {"Content-Type": JSON}
        upstream = await self._race(
            self.session.post(url + shape.path, data=raw, headers=headers), url
        )
        async with upstream:
            content_type = upstream.headers.get("Content-Type", JSON)
            if "text/event-stream" not in content_type:
                data = await self._race(upstream.read(), url)
                if upstream.status == 200:
                    self._count_prompt(url, shape.path, data)
                return web.Response(
                    status=upstream.status, body=data, headers={"Content-Type": content_type}
                )
            out = web.StreamResponse(status=upstream.status, headers={
                "Content-Type": content_type, "Cache-Control": "no-cache",
            })  # fmt: skip
            await out.prepare(request)
            failure: BaseException | None = None
            while True:
                try:
                    chunk = await self._race(upstream.content.readany(), url)
                except (aiohttp.ClientError, OSError, InstanceGone) as exc:
                    failure = exc
                    break
                if not chunk:
                    break
                try:
                    await out.write(chunk)
                except (ConnectionError, aiohttp.ClientError):
                    return out  # the client left; leaving `async with` aborts upstream
            if failure is not None:
                self.counters.errors += 1
                self.board.mark_failed(url, f"stream broke: {failure!r}")
                message = f"The instance serving this request failed mid-stream: {failure!r}"
                error = {"error": {"message": message, "code": 503}}
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    await out.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await out.write_eof()
            return out

    async def _race(self, awaitable: Awaitable[T], url: str) -> T:
        """Await ``awaitable`` unless ``url`` leaves routing first (then InstanceGone)."""
        gone = self.board.gone_event(url)
        task = asyncio.ensure_future(awaitable)
        if gone.is_set():
            task.cancel()
            raise InstanceGone(url)
        waiter = asyncio.ensure_future(gone.wait())
        try:
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            waiter.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise InstanceGone(f"{url} left routing")

    # -- everything else -----------------------------------------------------------------------

    def _any_healthy(self) -> list[Any]:
        return self.board.healthy(DECODE) + self.board.healthy(PREFILL)

    async def handle_health(self, _: web.Request) -> web.Response:
        if not self._any_healthy():
            return error_response(503, "no healthy instance", "ServiceUnavailableError")
        return web.Response(text="")

    async def handle_info(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for load in self._any_healthy():
            try:
                async with self.session.get(load.url + request.path_qs) as response:
                    return web.Response(
                        status=response.status, body=await response.read(),
                        headers={"Content-Type": response.headers.get("Content-Type", JSON)},
                    )  # fmt: skip
            except (aiohttp.ClientError, OSError) as exc:
                self.board.mark_failed(load.url, f"{request.path} failed: {exc!r}")
        return error_response(503, "no healthy instance", "ServiceUnavailableError")

    async def handle_flush_cache(self, request: web.Request) -> web.Response:
        """Flush every instance's local caches (the shared store keeps its pages)."""
        assert self.session is not None

        async def flush(url: str) -> int:
            try:
                async with self.session.request(request.method, url + "/flush_cache") as r:
                    return r.status
            except (aiohttp.ClientError, OSError):
                return 503

        loads = self._any_healthy()
        statuses = await asyncio.gather(*(flush(load.url) for load in loads))
        failed = [load.url for load, s in zip(loads, statuses, strict=True) if s != 200]
        if failed:
            return error_response(500, f"flush failed on {failed}", "InternalServerError")
        return web.Response(text="Cache flushed on every instance.\n")

    def cluster_state(self) -> dict[str, Any]:
        instances = []
        for spec in self.board.specs:
            load = self.board.loads[spec.url]
            stats = self.board.stats[spec.url]
            instances.append({
                "name": spec.name, "role": spec.role, "url": spec.url,
                "cores": list(spec.cores), "load": load.to_json(),
                "routed": stats.routed, "failed": stats.failed,
                "prompt_tokens": stats.prompt_tokens,
                "computed_prompt_tokens": stats.computed_prompt_tokens,
            })  # fmt: skip
        counters = self.counters
        return {
            "policy": {"prefill": self.prefill_policy.name, "decode": self.decode_policy.name},
            "handoff_min_tokens": self.placer.handoff_min_tokens,
            "in_place_max_new_tokens": self.placer.in_place_max_new_tokens,
            "gateway": {
                "requests": counters.requests,
                "handoffs": counters.handoffs,
                "direct": counters.direct,
                "direct_on_prefill": counters.direct_on_prefill,
                "followed": counters.followed,
                "retries": counters.retries,
                "errors": counters.errors,
                "fallbacks_to_prefill": counters.fallbacks_to_prefill,
                "uptime_s": round(time.time() - counters.started_at, 1),
            },  # fmt: skip
            "instances": instances,
        }

    async def handle_cluster(self, _: web.Request) -> web.Response:
        state = self.cluster_state()
        if self.extra_info is not None:
            state.update(await self.extra_info())
        return web.json_response(state)

    async def handle_metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            text=render_metrics(self.cluster_state()), content_type="text/plain", charset="utf-8"
        )
