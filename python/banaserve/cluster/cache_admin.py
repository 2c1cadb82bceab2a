"""The gateway's cache admin calls: ``/flush_cache`` and ``/clear_caches``.

``/flush_cache`` (POST or GET, as SGLang takes it) flushes the local caches of every healthy
instance (SGLang's ``/flush_cache``: its radix cache and HiCache host pool); the store keeps
its pages, so the next request loads its prefix from there.

``POST /clear_caches`` brings the whole cluster back to cold caches, for benchmark runs that
must not see each other's prefixes: every healthy instance flushed as above, then every page
and claim of the KV store dropped (CLEAR, through the gateway's store client, which holds the
cluster's shared token), and the gateway's own prompt index and pending handoffs forgotten
(:meth:`~banaserve.router.placement.Placer.reset`). Instances go first: a page an instance
was still writing back lands before the store is cleared, not after. Every part is tried
whatever the others did; any failure makes it a 500 naming each one (an instance busy with
requests refuses to flush: SGLang flushes only when idle), and a retry is safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence

import aiohttp
from aiohttp import web

from banaserve.cluster.http_errors import error_response
from banaserve.router.placement import Placer

#: Clears the store and returns the pages it dropped (``KvStoreClient.clear``); blocking.
ClearStore = Callable[[], int]


async def flush_instances(
    session: aiohttp.ClientSession, urls: Sequence[str], method: str = "POST",
    headers: Mapping[str, str] | None = None,
) -> list[str]:  # fmt: skip
    """Ask every instance in ``urls`` to flush its caches, all at once (``headers``: the admin
    credential their ``/flush_cache`` needs); the URLs that did not answer 200 (refused,
    unreachable or busy)."""

    async def flush(url: str) -> int:
        try:
            async with session.request(method, url + "/flush_cache", headers=headers) as response:
                return response.status
        except (aiohttp.ClientError, OSError):
            return 503

    statuses = await asyncio.gather(*(flush(url) for url in urls))
    return [url for url, status in zip(urls, statuses, strict=True) if status != 200]


async def handle_flush_cache(
    session: aiohttp.ClientSession, urls: Sequence[str], method: str,
    headers: Mapping[str, str] | None = None,
) -> web.Response:  # fmt: skip
    failed = await flush_instances(session, urls, method, headers)
    if failed:
        return error_response(500, f"flush failed on {failed}", "InternalServerError")
    return web.Response(text="Cache flushed on every instance.\n")


async def handle_clear_caches(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    placer: Placer,
    clear_store: ClearStore | None,
    headers: Mapping[str, str] | None = None,
) -> web.Response:
    """200 ``{"instances_flushed", "store_pages_dropped", "prompt_index_chars_dropped"}``
    once every part succeeded (``store_pages_dropped`` is 0 without a store); else 500 with
    what failed and those counts in the message."""
    failures: list[str] = []
    failed = await flush_instances(session, urls, "POST", headers)
    if failed:
        failures.append(f"flush failed on {failed} (SGLang flushes only an idle instance)")
    dropped = 0
    if clear_store is not None:
        try:
            dropped = await asyncio.to_thread(clear_store)
        except Exception as exc:  # KvStoreError and kin: reported, the other parts still done
            failures.append(f"the KV store was not cleared: {exc}")
    counts = {
        "instances_flushed": len(urls) - len(failed),
        "store_pages_dropped": dropped,
        "prompt_index_chars_dropped": placer.reset(),
    }
    if failures:
        message = f"clear_caches failed: {'; '.join(failures)} (done: {counts})"
        return error_response(500, message, "InternalServerError")
    return web.json_response(counts)
