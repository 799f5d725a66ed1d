"""Helpers for running several requests at once and for Server-Sent Events responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from starlette.responses import Response, StreamingResponse

T = TypeVar("T")
_DONE = object()


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def gather_or_cancel(aws: list[Awaitable[T]]) -> list[T]:
    """Like asyncio.gather, but the first failure cancels the others (so their requests are aborted)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        aclose = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()


async def started(gens: list[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    """Wait for the first item of every stream before a response starts, so an error the first item
    brings (a grammar the scheduler refused) can still be answered with an HTTP error status. On an
    error every stream is closed (aborting the requests that did start) and the error is raised."""
    try:
        firsts = await gather_or_cancel([anext(g) for g in gens])
    except BaseException:
        for g in gens:
            await g.aclose()
        raise
    return [_prepend(first, g) for first, g in zip(firsts, gens, strict=True)]


async def merge(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item); an error in one ends the merge with it.
    Closing the merged iterator cancels the sources (which abort their requests)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item))
        except Exception as e:  # handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class SSEResponse(StreamingResponse):
    """An event stream whose body iterator is always closed, even when the client goes away mid-stream,
    so that the generators behind it run their cleanup (abort) at once rather than at garbage collection."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
