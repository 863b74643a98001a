"""Between HTTP and the scheduler thread: request bodies read under a size limit, a job's events handed
to the event loop, and a client's disconnect noticed while its reply is made."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import ClientDisconnect, Request

from ..chat.jobs import Event
from .errors import ApiError, invalid, too_large

JSON = "application/json"
FILE = "application/octet-stream"


def _declared_size(request: Request, limit: int) -> None:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(limit)


def tenant_of(request: Request) -> str | None:
    """The tenant whose API key the request carries (app.ApiKeyCheck); None with one key, or none."""
    return request.scope.get("state", {}).get("tenant")


def _check_type(request: Request, media_type: str) -> None:
    """415 unless the body is said to be `media_type`. Neither is one a web page may send without
    asking first (a CORS preflight, which OriginCheck answers), as it may text/plain or a form."""
    given = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if given != media_type:
        said = f"not '{given}'" if given else "and none was given"
        message = f"The body must be sent with 'Content-Type: {media_type}', {said}."
        raise ApiError(415, message, code="unsupported_media_type")


@dataclass
class Deadline:
    """When a request must have arrived whole (server.Connection puts one in each request's scope):
    its head and body within `within_s` of the head's first byte, plus one second per `min_rate` bytes
    of body received, so that a large upload at a fair speed goes on and a trickle is cut."""

    start: float  # the event loop's clock
    within_s: float
    min_rate: float  # bytes a second

    def at(self, received: int) -> float:
        return self.start + self.within_s + received / self.min_rate


def client_gone() -> ApiError:
    """A client that left before its request arrived whole: nobody reads the answer, and the access
    log says it in its one line (nginx's 499), without a traceback."""
    message = "The client closed the connection before its request arrived."
    return ApiError(499, message, code="client_closed_request")


async def _chunks(request: Request, timeout_s: float) -> AsyncIterator[bytes]:
    """The body's chunks as they come; 408 when the client sends none for `timeout_s`, or the
    request's Deadline passes (a client that stops or trickles mid-body must not hold its connection),
    499 when it leaves."""
    deadline: Deadline | None = request.scope.get("state", {}).get("deadline")
    loop = asyncio.get_running_loop()
    chunks = aiter(request.stream())
    received = 0
    while True:
        whole_by = deadline.at(received) if deadline is not None else math.inf
        try:
            async with asyncio.timeout_at(min(loop.time() + timeout_s, whole_by)):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except ClientDisconnect:
            raise client_gone() from None
        except TimeoutError:
            if loop.time() >= whole_by:
                message = (
                    f"The request did not arrive in time: its head and body must arrive within "
                    f"{deadline.within_s:g} s, and a longer body at {deadline.min_rate / 1024:g} KiB/s "
                    "at least."
                )
            else:
                message = f"The request body stopped arriving (nothing for {timeout_s:g} s)."
            raise ApiError(408, message, code="request_timeout", headers={"Connection": "close"}) from None
        received += len(chunk)
        yield chunk


async def read_json(request: Request, limit: int, timeout_s: float) -> dict:
    """The body as a JSON object; 415 when not sent as JSON, 413 past `limit` bytes (read no further),
    408 when it stops arriving, 400 when it is not JSON."""
    _check_type(request, JSON)
    _declared_size(request, limit)
    body = bytearray()
    async for chunk in _chunks(request, timeout_s):
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    value = json_value(body, "The body")
    if not isinstance(value, dict):
        raise invalid("The body must be a JSON object.")
    return value


# JSON nested deeper than this, anywhere in a request (its body, a tool call's arguments), is refused:
# no API use comes near it, and what walks a value (a chat template's tojson, the control-text
# shield) would otherwise go past Python's recursion limit.
MAX_JSON_DEPTH = 64


def json_value(text: str | bytes | bytearray, what: str, param: str | None = None):
    """JSON text from a request as a value; 400 naming `what` when it is not JSON (bytes that are not
    UTF-8 too) or nests deeper than MAX_JSON_DEPTH."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        raise invalid(f"{what} is not JSON.", param=param) from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise invalid(f"{what} nests JSON more than {MAX_JSON_DEPTH} deep.", param=param)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value


async def save_file(
    request: Request,
    path: Path,
    limit: int,
    timeout_s: float,
    head_size: int,
    check_head: Callable[[bytes], int],
) -> None:
    """The body (a file, sent as application/octet-stream) written to `path` as it comes. Its first
    `head_size` bytes go to check_head as soon as they are in: it refuses a body that is not the file
    expected, or says how long the whole may be; 413 past that or `limit` bytes (read no further)."""
    _check_type(request, FILE)
    _declared_size(request, limit)
    head, size = b"", 0
    with open(path, "wb") as f:
        async for chunk in _chunks(request, timeout_s):
            if len(head) < head_size:
                head += chunk[: head_size - len(head)]
                if len(head) == head_size:
                    limit = min(limit, check_head(head))
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            f.write(chunk)
    if len(head) < head_size:
        check_head(head)


class JobEvents:
    """A job's on_event: called on the scheduler thread, which must never wait, it hands each event
    to the event loop; the loop reads them with `async for`, up to the job's end."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.ended = asyncio.Event()

    def __call__(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self._put, event)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def _put(self, event: Event) -> None:
        self.queue.put_nowait(event)
        if event.kind == "end":
            self.ended.set()

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
