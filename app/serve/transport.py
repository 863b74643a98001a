"""Between HTTP and the scheduler thread: request bodies read under a size limit, a job's events handed
to the event loop, and a client's disconnect noticed while its reply is made."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

from starlette.requests import Request

from ..chat.jobs import Event
from .errors import invalid, too_large


def _declared_size(request: Request, limit: int) -> None:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (read no further), 400 when it is not JSON."""
    _declared_size(request, limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # also bytes that are not UTF-8, and nesting past any use
        raise invalid("The body is not valid JSON.") from None
    if not isinstance(value, dict):
        raise invalid("The body must be a JSON object.")
    return value


async def save_body(request: Request, path: Path, limit: int) -> None:
    """The body written to `path`, as it comes; 413 past `limit` bytes."""
    _declared_size(request, limit)
    size = 0
    with open(path, "wb") as f:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            f.write(chunk)


class JobEvents:
    """A job's on_event: called on the scheduler thread, which must never wait, it hands each event
    to the event loop; the loop reads them with `async for`, up to the job's end."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.ended = asyncio.Event()
        self.at_end: Callable[[], None] | None = None  # called on the loop when the job has ended

    def __call__(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def _put(self, event: Event) -> None:
        self.queue.put_nowait(event)
        if event.kind == "end":
            self.ended.set()
            if self.at_end is not None:
                self.at_end()

    async def __aiter__(self):
        while True:
            event = await self.queue.get()
            yield event
            if event.kind == "end":
                return


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def ended_or_gone(request: Request, events: JobEvents) -> bool:
    """Wait for the job's end (True) or the client's leaving (False), whichever comes first."""
    ended = asyncio.ensure_future(events.ended.wait())
    gone = asyncio.ensure_future(_disconnect(request))
    done, pending = await asyncio.wait({ended, gone}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return ended in done
