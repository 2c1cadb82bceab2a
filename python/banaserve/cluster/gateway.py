"""The cluster's HTTP front: SGLang's API on one port, routed over prefill and decode instances.

Per generation request (``/generate``, ``/v1/completions``, ``/v1/chat/completions``), after
:mod:`banaserve.router.placement` has decided whether it needs a handoff:

1. *Prefill* (handoff only): one token of the request on the prefill instance the policy
   picks; that instance writes the prompt's KV pages to the store. A prefill that cannot be
   reached is retried on another; if none answers, step 2 computes the prompt itself (slower,
   never wrong). A 4xx (bad input) goes back to the client as is.
2. *Decode*: the unchanged request on the instance the decode policy picks among the decode
   instances (and the prefill instances too, for a short direct request), whose answer
   (streamed or not) goes back to the client byte for byte. With no decode instance healthy,
   a prefill instance serves the whole request, so the cluster keeps serving.

Before either step, :mod:`banaserve.cluster.intake` decodes and checks the body off the event
loop (a 4xx that names the limit, or 503 when the intake is full), and a body quarantined by
:mod:`banaserve.cluster.poison` is refused. Bodies and whole answers are held within the
budget of :mod:`banaserve.cluster.client_guard` (503 beyond it).

Faults: an instance that refuses connections leaves routing at once, one whose polls fail
within a few seconds (:mod:`banaserve.cluster.load_board`). A request that never reached an
instance, or whose instance did not die, is retried on another while nothing has reached the
client; after that the stream ends with an error event. A request whose instance *died* while
serving it is retried at most once, as the poison-pill guard says (on the same instance
once restarted, when the instance crashed by itself), and answered 500 and quarantined at a
second death. A client never waits on an instance that has left routing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web

from banaserve.api.request_limits import RequestRejected
from banaserve.api.request_validation import GENERATION_PATHS
from banaserve.cluster import cache_admin
from banaserve.cluster.cache_admin import ClearStore
from banaserve.cluster.client_guard import HOLDING, ByteBudget, read_body, read_within
from banaserve.cluster.counters import GatewayCounters, multi_turn_state
from banaserve.cluster.credentials import (
    IS_ADMIN,
    SERVER_INFO_PATHS,
    authorize,
    bearer,
    cluster_state_shown,
    redacted_server_info,
)
from banaserve.cluster.failover import Failover, InstanceDeaths, InstanceDied
from banaserve.cluster.host_guard import host_guard
from banaserve.cluster.http_errors import error_response, unavailable
from banaserve.cluster.intake import Admitted, Intake, IntakeBusy
from banaserve.cluster.leaders import Leaders
from banaserve.cluster.load_board import InstanceGone, LoadBoard
from banaserve.cluster.migration_loop import MigrationLoop
from banaserve.cluster.poison import PoisonGuard
from banaserve.cluster.prometheus import render_metrics
from banaserve.cluster.relay_bodies import StreamTail, prefill_body, whole_reply_prompt_tokens
from banaserve.config.client_limits import ClientLimits
from banaserve.router.base import NoHealthyInstance, Policy, Role
from banaserve.router.placement import Placement, Placer
from banaserve.router.request_shape import RequestShape
from banaserve.router.router import Router
from banaserve.router.spare_prefill import SERVE_ON_SPARE_PREFILL
from banaserve.router.spill import SPILL_PREFILL

logger = logging.getLogger("banaserve.cluster")

JSON = "application/json"
#: Paths answered by any one instance (they describe the model, not one instance's state).
INFO_PATHS = ("/v1/models", "/get_model_info", "/model_info", "/get_server_info",
              "/server_info")  # fmt: skip


class Gateway:
    """Serves SGLang's API over the cluster's instances: parses, relays, races an instance's
    death and retries; every routing decision is :attr:`router`'s.

    Owns the aiohttp client session (opened and closed with the app, :meth:`app`), the
    counters, and the prompts being computed that requests follow (:attr:`leaders`). Every
    handler runs on that app's event loop, so no state is locked; the board, the router and
    the failover are confined to the same loop. Handlers block only on the network (the
    instances, the store's CLEAR); body decoding and validation run in the intake's threads.
    """

    def __init__(
        self,
        board: LoadBoard,
        prefill_policy: Policy,
        decode_policy: Policy,
        intake: Intake | None = None,
        placer: Placer | None = None,
        extra_info: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        deaths: InstanceDeaths | None = None,
        guard: PoisonGuard | None = None,
        clear_store: ClearStore | None = None,
        migration: MigrationLoop | None = None,
        spill_prefill: bool = SPILL_PREFILL,
        serve_on_spare_prefill: bool = SERVE_ON_SPARE_PREFILL,
        api_key: str | None = None,
        admin_token: str | None = None,
        allowed_hosts: frozenset[str] | None = None,
        client_limits: ClientLimits | None = None,
    ) -> None:
        self.client_limits = client_limits if client_limits is not None else ClientLimits()
        self.buffers = ByteBudget(self.client_limits.buffer_budget_bytes)
        self.board = board
        self.allowed_hosts = allowed_hosts  # None: any Host header (see api.host_names)
        self.api_key = api_key  # --api-key: asked of clients, sent to the instances
        # Needed for admin calls, here and on the instances (a random one when not given).
        self.admin_token = admin_token or secrets.token_urlsafe(24)
        placer = placer if placer is not None else Placer()
        self.router = Router(board, prefill_policy, decode_policy, placer, spill_prefill,
                             serve_on_spare_prefill)  # fmt: skip
        self.intake = intake if intake is not None else Intake()
        self.leaders = Leaders(self.router)
        self.extra_info = extra_info
        self.clear_store = clear_store  # None: the cluster has no store
        self.counters = GatewayCounters()
        self.failover = Failover(board, self.counters, deaths, guard)
        self.session: aiohttp.ClientSession | None = None
        self.migration = migration  # None: --migration off

    # -- app ---------------------------------------------------------------------------------

    def app(self) -> web.Application:
        # aiohttp's own limit bounds the other routes' bodies (read_body the generation ones').
        app = web.Application(
            client_max_size=self.intake.limits.max_body_bytes + 1,
            middlewares=[
                host_guard(self.allowed_hosts),
                authorize(self.api_key, self.admin_token),
                self.buffers.middleware(),
            ],
        )
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
        app.router.add_post("/clear_caches", self.handle_clear_caches)
        app.router.add_get("/migration", self.handle_migration)
        app.router.add_post("/migration", self.handle_migration)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, _: web.Application) -> None:
        self.session = aiohttp.ClientSession(
            headers=bearer(self.api_key),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(limit=0),
        )

    async def _close_session(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()
        self.intake.close()

    # -- generation --------------------------------------------------------------------------

    async def handle_generation(self, request: web.Request) -> web.StreamResponse:
        self.counters.requests += 1
        try:
            raw = await read_body(request, self.intake.limits, self.client_limits.body_timeout_s)
            admitted = await self.intake.admit(request.path, raw)
        except RequestRejected as exc:
            self.counters.rejected += 1
            return web.json_response(exc.payload(), status=exc.status)
        except IntakeBusy as exc:
            self.counters.intake_busy += 1
            return unavailable(f"The gateway is overloaded: {exc}.")
        refusal = self.failover.guard.refusal(admitted.digest)
        if refusal is not None:
            self.counters.quarantine_refusals += 1
            return error_response(400, refusal)
        shape = admitted.shape
        self.counters.follow_up_turns += shape.prior_turns > 0
        if self.migration is not None:
            self.migration.arrived(shape.prompt_tokens, shape.max_new_tokens or 0)
        placement = self.router.plan(shape)
        computed = self.leaders.begin(shape) if placement.followed else None
        try:
            if placement.handoff:
                refused, on = await self._prefill(admitted)
                computed()  # the prompt is computed: release its followers now
                if refused is not None:
                    return refused
                self.counters.handoffs += 1
                placement = Placement(True, uncached_tokens=0, any_role=False, prefilled_on=on)
            else:
                self.counters.direct += 1
                self.counters.spilled += placement.spilled
                followed = self.leaders.computing(placement.follows)
                if followed is not None:
                    self.counters.followed += 1
                    await self.leaders.wait(followed)
            return await self._decode(request, admitted, raw, placement, computed)
        finally:
            if computed is not None:
                computed()

    async def _prefill(self, admitted: Admitted) -> tuple[web.Response | None, str | None]:
        """Run the prompt on a prefill instance. Returns the response to give the client when
        the instance refused the request (4xx) or it was quarantined, else None (also when
        no prefill could be reached: the decode instance then computes the prompt itself);
        and the url of the instance that computed it (None if none did)."""
        if not self.router.can_prefill():
            return None, None
        shape = admitted.shape
        payload = prefill_body(shape.path, admitted.body)
        tried: set[str] = set()
        only: str | None = None  # the restarted instance a suspect request goes back to
        while True:
            try:
                pick = self.router.pick(Role.PREFILL, shape, tried, only=only)
            except NoHealthyInstance:
                return None, None
            url = pick.url
            tried.add(url)
            only = None
            pid = self.failover.pid_of(url)
            try:
                status, data = await self.board.race(
                    self._post_json(url + shape.path, payload), url
                )
                await self.failover.raise_if_died(url, pid, status)
            except (aiohttp.ClientError, OSError, InstanceGone, InstanceDied) as exc:
                refused, only = await self.failover.next_try(url, pid, exc, admitted, "prefill")
                if refused is not None:
                    return refused, None
                continue
            finally:
                self.router.done(pick, shape)
            if 400 <= status < 500:
                return web.Response(status=status, body=data, content_type=JSON), None
            if status != 200:
                logger.warning("prefill on %s answered %d: %s", url, status, data[:300])
                self.counters.retries += 1
                continue
            self._count_prompt(url, shape, whole_reply_prompt_tokens(shape.path, data), True)
            return None, url

    def _count_prompt(self, url: str, shape: RequestShape, counts: tuple[int, int],
                      computes_prompt: bool) -> None:  # fmt: skip
        """Book (prompt tokens, of them cached) that an instance's reply reported; a
        conversation's next turn is booked by the step that ``computes_prompt`` (a handoff's
        prefill, or the one instance a direct request ran on)."""
        prompt, cached = counts
        if not prompt:
            return
        self.board.count_prompt(url, prompt, cached)
        if computes_prompt and shape.prior_turns:
            self.counters.follow_up(prompt, cached)

    async def _post_json(self, url: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        assert self.session is not None
        async with self.session.post(url, json=payload) as response:
            return response.status, await response.read()

    async def _decode(
        self, request: web.Request, admitted: Admitted, raw: bytes, placement: Placement,
        computed: Callable[[], None] | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        """Serve the request on a decode instance (or, for ``placement.any_role``, any one).
        ``placement.uncached_tokens`` count as the instance's queued prefill work meanwhile;
        ``computed`` is called at its first token (its prompt is computed)."""
        assert self.session is not None
        shape = admitted.shape
        tried: set[str] = set()
        only: str | None = None  # the restarted instance a suspect request goes back to
        last_error = "no decode instance is healthy"
        while True:
            try:
                pick = self.router.pick(Role.DECODE, shape, tried, only=only,
                                        any_role=placement.any_role, leads=placement.leads,
                                        prefill_tokens=placement.uncached_tokens,
                                        prefilled_on=placement.prefilled_on)  # fmt: skip
            except NoHealthyInstance:
                self.counters.errors += 1
                return unavailable(f"No instance could serve the request: {last_error}.")
            url = pick.url
            tried.add(url)
            only = None
            if pick.fallback:
                if self.counters.fallbacks_to_prefill == 0:
                    logger.warning("no decode instance is healthy: prefill instances decode too")
                self.counters.fallbacks_to_prefill += 1
            if pick.role == Role.PREFILL:
                self.counters.direct_on_prefill += 1
                if not (placement.any_role or pick.fallback):
                    self.counters.long_on_prefill += 1
            pid = self.failover.pid_of(url)

            def first_token() -> None:
                nonlocal pick
                pick = self.router.first_token(pick)
                if computed is not None:
                    computed()

            try:
                return await self._relay(request, url, admitted, raw, pid, first_token,
                                         not placement.handoff)  # fmt: skip
            except (aiohttp.ClientError, OSError, InstanceGone, InstanceDied) as exc:
                # Nothing reached the client yet (_relay handles failures after that).
                last_error = f"{url} failed: {exc!r}"
                refused, only = await self.failover.next_try(url, pid, exc, admitted, "serve")
                if refused is not None:
                    return refused
            finally:
                self.router.done(pick, shape)

    async def _relay(
        self, request: web.Request, url: str, admitted: Admitted, raw: bytes, pid: int | None,
        first_token: Callable[[], None], computes_prompt: bool,
    ) -> web.StreamResponse:  # fmt: skip
        """Send the request to ``url`` and pass its answer through; ``first_token`` is called
        at a stream's first chunk (its prompt is computed). The prompt tokens the answer
        reports are booked (:meth:`_count_prompt`). Raises (for a retry) only while nothing has
        been sent to the client."""
        assert self.session is not None
        shape = admitted.shape
        headers = {"Content-Type": JSON}
        upstream = await self.board.race(
            self.session.post(url + shape.path, data=raw, headers=headers), url
        )
        async with upstream:
            content_type = upstream.headers.get("Content-Type", JSON)
            if "text/event-stream" not in content_type:
                if upstream.content_length is not None:
                    request[HOLDING].check(upstream.content_length)
                data = await self.board.race(
                    read_within(upstream.content.iter_any(), request[HOLDING]), url
                )
                await self.failover.raise_if_died(url, pid, upstream.status)
                if upstream.status == 200:
                    counts = whole_reply_prompt_tokens(shape.path, data)
                    self._count_prompt(url, shape, counts, computes_prompt)
                return web.Response(
                    status=upstream.status, body=data, headers={"Content-Type": content_type}
                )
            out = web.StreamResponse(status=upstream.status, headers={
                "Content-Type": content_type, "Cache-Control": "no-cache",
            })  # fmt: skip
            try:
                await out.prepare(request)
            except ConnectionError:
                return out  # the client left before its first byte: its failure, not the instance's
            failure: BaseException | None = None
            pending: Callable[[], None] | None = first_token
            tail, booked = StreamTail(), False
            while True:
                try:
                    chunk = await self.board.race(upstream.content.readany(), url)
                except (aiohttp.ClientError, OSError, InstanceGone) as exc:
                    failure = exc
                    break
                if not chunk:
                    break
                if pending is not None:
                    pending()
                    pending = None
                tail.add(chunk)
                if not booked and tail.ended:  # before the client can read the end
                    booked = True
                    self._count_prompt(url, shape, tail.prompt_tokens(shape.path), computes_prompt)
                try:
                    await out.write(chunk)
                except (ConnectionError, aiohttp.ClientError):
                    return out  # the client left; leaving `async with` aborts upstream
            if failure is not None:
                self.counters.errors += 1
                # Too late to retry, but a death still counts against the request's body.
                await self.failover.after_failure(url, pid, failure, admitted, "stream")
                message = f"The instance serving this request failed mid-stream: {failure!r}"
                error = {"error": {"message": message, "code": 503}}
                with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                    await out.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            elif not booked:
                self._count_prompt(url, shape, tail.prompt_tokens(shape.path), computes_prompt)
            with contextlib.suppress(ConnectionError, aiohttp.ClientError):
                await out.write_eof()
            return out

    # -- everything else -----------------------------------------------------------------------

    def _any_healthy(self) -> list[Any]:
        return self.board.healthy(Role.DECODE) + self.board.healthy(Role.PREFILL)

    async def handle_health(self, _: web.Request) -> web.Response:
        if not self._any_healthy():
            return unavailable("no healthy instance")
        return web.Response(text="")

    async def handle_info(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for load in self._any_healthy():
            try:
                async with self.session.get(load.url + request.path_qs) as response:
                    body = await response.read()
                    if request.path in SERVER_INFO_PATHS and response.status == 200:
                        admin = request.get(IS_ADMIN, False)
                        secrets_known = (self.api_key, self.admin_token)
                        info = redacted_server_info(json.loads(body), admin, secrets_known)
                        return web.json_response(info)
                    return web.Response(
                        status=response.status, body=body,
                        headers={"Content-Type": response.headers.get("Content-Type", JSON)},
                    )  # fmt: skip
            except (aiohttp.ClientError, OSError) as exc:
                self.board.mark_failed(load.url, f"{request.path} failed: {exc!r}")
        return error_response(503, "no healthy instance", "ServiceUnavailableError")

    async def handle_flush_cache(self, request: web.Request) -> web.Response:
        """Flush every instance's local caches (the shared store keeps its pages)."""
        assert self.session is not None
        urls = [load.url for load in self._any_healthy()]
        return await cache_admin.handle_flush_cache(
            self.session, urls, request.method, bearer(self.admin_token)
        )

    async def handle_clear_caches(self, _: web.Request) -> web.Response:
        """Every cache of the cluster cleared: see :mod:`banaserve.cluster.cache_admin`."""
        assert self.session is not None
        urls = [load.url for load in self._any_healthy()]
        return await cache_admin.handle_clear_caches(
            self.session, urls, self.router.placer, self.clear_store, bearer(self.admin_token)
        )

    def cluster_state(self) -> dict[str, Any]:
        instances = []
        for spec in self.board.specs:
            load = self.board.loads[spec.url]
            stats = self.board.stats[spec.url]
            instances.append({
                "name": spec.name, "role": str(self.board.role_of(spec.url)),
                "home_role": spec.role, "url": spec.url,
                "cores": list(spec.cores), "args": list(spec.args), "load": load.to_json(),
                "routed": stats.routed, "failed": stats.failed, "stalls": stats.stalls,
                "inflight": self.board.inflight_requests(spec.url),
                "prompt_tokens": stats.prompt_tokens,
                "computed_prompt_tokens": stats.computed_prompt_tokens,
            })  # fmt: skip
        counters, router, placer = self.counters, self.router, self.router.placer
        return {
            "policy": {"prefill": router.prefill_policy.name, "decode": router.decode_policy.name},
            "handoffs": placer.hands_off,  # False without a store: requests run whole
            "handoff_min_tokens": placer.handoff_min_tokens,
            "in_place_max_new_tokens": placer.in_place_max_new_tokens,
            "spill_prefill": router.spill_prefill,
            "serve_on_spare_prefill": router.serve_on_spare_prefill,
            "gateway": {
                **{k: v for k, v in asdict(counters).items() if k != "started_at"},
                "uptime_s": round(time.time() - counters.started_at, 1),
            },
            "multi_turn": multi_turn_state(counters),
            "supervisor": self.failover.deaths.report() if self.failover.deaths else {},
            "migration": self.migration_state(),
            "instances": instances,
        }

    async def handle_cluster(self, request: web.Request) -> web.Response:
        state = self.cluster_state()
        if self.extra_info is not None:
            state.update(await self.extra_info())
        return web.json_response(cluster_state_shown(state, request.get(IS_ADMIN, False)))

    def migration_state(self) -> dict[str, Any]:
        if self.migration is not None:
            return self.migration.state()
        return {"mode": "off"}

    async def handle_migration(self, request: web.Request) -> web.Response:
        """``--migration``'s state and admin calls: see :mod:`banaserve.cluster.migration_loop`."""
        if self.migration is not None and request.method == "POST":
            return await self.migration.handle_post(request)
        if self.migration is not None:
            return await self.migration.handle_get(request)
        if request.method == "POST":
            message = "migration is off: start the cluster with --migration role or layer"
            return web.json_response({"message": message}, status=409)
        return web.json_response(self.migration_state())

    async def handle_metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            text=render_metrics(self.cluster_state()), content_type="text/plain", charset="utf-8"
        )
