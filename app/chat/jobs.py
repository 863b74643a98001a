"""A job: one reply being made (or n alternatives of it) — a state, a cancel, and a stream of events.
The chat engine's verbs make jobs and the scheduler (scheduler.py) runs them; front ends hold what a
verb returned (JobView) and render its events."""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from llama_chat.inference import GenerationStats, KVSequence, SamplingParams
from llama_chat.inference.thinking import ThinkingSplitter


class QueueFull(Exception):
    """Too many jobs wait already: try again later."""


class State(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (State.DONE, State.CANCELLED, State.FAILED)


@dataclass(frozen=True)
class Event:
    """What happened to a job. kind: "state" (the job entered `state`), "prefill" (done of total prompt
    tokens computed), "text" (a piece of alternative `alt`'s answer), "thinking" (a piece of its
    thinking), "end" (the job ended: see job.state, job.error, job.result)."""

    kind: str
    job: Job
    alt: int = 0
    text: str = ""
    done: int = 0
    total: int = 0
    state: State | None = None


class JobView(Protocol):
    """A job as a front end holds it (what the chat engine's verbs return): it reads its state, text,
    stats and result, and may cancel it; the scheduler alone runs it."""

    n: int  # replies made side by side (alternatives)
    state: State
    stats: list[GenerationStats]  # one per alternative, filled in as it goes
    result: Any  # what the verb says it leaves once the job ended (a SavedReply, …)
    error: BaseException | None  # why it failed
    remote: Any  # what the remote KV tier did for its prompt (a RemoteRead), if there is one

    @property
    def cancelled(self) -> bool: ...

    @property
    def answered(self) -> bool: ...

    def cancel(self) -> None: ...

    def text(self, alt: int = 0) -> str: ...

    def thinking(self, alt: int = 0) -> str: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def events(self) -> Iterator[Event]: ...


# prepare() → (prompt token ids, the sequence to prefill them into), run by the scheduler when the job
# is admitted; finish(job) → job.result, run once when the job ends, however it ends (job.has_reply:
# whether it made a reply to keep);
# thinking(prompt) → how a reply to the prompt is told apart into thinking and answer (None: all answer).
Prepare = Callable[[], tuple[list[int], KVSequence]]
Finish = Callable[["Job"], Any]
Thinking = Callable[[list[int]], ThinkingSplitter | None]


class Job:
    def __init__(
        self,
        prepare: Prepare,
        *,
        n: int = 1,
        sampling: SamplingParams | None = None,
        max_tokens: int,
        stop: Sequence[str] = (),
        lookup: bool | None = None,
        finish: Finish | None = None,
        on_event: Callable[[Event], None] | None = None,
        cancel: threading.Event | None = None,
        stats: GenerationStats | None = None,
        session_id: str | None = None,
        drop_unanswered: bool = False,
        continues_text: bool = False,
        thinking: Thinking | None = None,
    ):
        self._prepare = prepare
        self._thinking = thinking
        # The chat layer's end of the job (on the scheduler's thread, which holds the pool), before its
        # "end" event: what it made kept (also after a failure), its KV given back. What it raises fails
        # the job (the reply could not be stored, …).
        self.finish = finish
        self.n = n
        self.sampling = sampling or SamplingParams()
        self.max_tokens = max_tokens
        self.stop = tuple(stop)
        self.lookup = lookup  # None: as the model was loaded
        self.continues_text = continues_text  # a raw prompt's completion, not a reply to a turn
        # The jobs of one session run one after another, in the order submitted: each is prepared from
        # what the one before it stored.
        self.session_id = session_id
        # Cancelled before its first token, the job keeps nothing: a server's client that left before
        # its turn began (a person's cancelled message, by default, is kept with an empty reply).
        self.drop_unanswered = drop_unanswered
        self.state = State.QUEUED
        self.started = False  # its prompt was admitted to a run (set by the scheduler)
        self.stats = [stats or GenerationStats()] + [GenerationStats() for _ in range(n - 1)]
        self.pieces: list[list[str]] = [[] for _ in range(n)]  # each alternative's answer, as it came
        self.thoughts: list[list[str]] = [[] for _ in range(n)]  # and its thinking
        self._splitters: list[ThinkingSplitter | None] = [None] * n
        self.seqs: list[KVSequence] = []  # one per alternative, once decoding starts
        self.result: Any = None  # what finish() returned
        self.remote: Any = None  # what the remote KV tier did for its prompt (a RemoteRead), if there is one
        self.error: BaseException | None = None  # why it failed
        self._cancel = cancel or threading.Event()
        self._ended = threading.Event()
        self._on_event = on_event
        self._queue: queue.SimpleQueue[Event] | None = queue.SimpleQueue() if on_event is None else None

    # -- what front ends call ----------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop before the next token (or between two prefill batches); what was made is kept."""
        self._cancel.set()

    @property
    def cancel_event(self) -> threading.Event:
        return self._cancel

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def answered(self) -> bool:
        """Whether any reply has a token yet."""
        return any(s.generated_tokens for s in self.stats)

    @property
    def dropped(self) -> bool:
        """Cancelled before its first token, with nothing to keep (drop_unanswered)."""
        return self.drop_unanswered and self.cancelled and not self.answered

    @property
    def has_reply(self) -> bool:
        """Whether it made replies to keep, however short or cut (by a cancel, a failure): it started,
        and was not dropped."""
        return self.started and not self.dropped

    def text(self, alt: int = 0) -> str:
        """The answer of alternative `alt` so far (its thinking apart)."""
        return "".join(self.pieces[alt])

    def thinking(self, alt: int = 0) -> str:
        return "".join(self.thoughts[alt])

    def wait(self, timeout: float | None = None) -> bool:
        """Until the job ended (True) or the timeout passed (False)."""
        return self._ended.wait(timeout)

    def events(self) -> Iterator[Event]:
        """The job's events as they come, up to its end (for a job submitted without on_event)."""
        if self._queue is None:
            raise RuntimeError("this job's events go to its on_event callback")
        while True:
            event = self._queue.get()
            yield event
            if event.kind == "end":
                return

    # -- what the scheduler calls ------------------------------------------------------------------

    def prepare(self) -> tuple[list[int], KVSequence]:
        """The prompt and its sequence; replies to the prompt are told apart from here on."""
        prompt, seq = self._prepare()
        if self._thinking is not None:
            self._splitters = [self._thinking(prompt) for _ in range(self.n)]
        return prompt, seq

    def emit(self, kind: str, **fields) -> None:
        """Tell of an event; a "text" one is the reply as written: its thinking and its answer go out
        apart, each as soon as it is told apart."""
        splitter = self._splitters[fields.get("alt", 0)] if kind == "text" else None
        if splitter is None:
            return self._emit(kind, **fields)
        for piece in splitter.feed(fields["text"]):
            self._emit("thinking" if piece.thinking else "text", alt=fields.get("alt", 0), text=piece.text)

    def replies_written(self) -> None:
        """The replies are written (however they ended): what was held as a marker's possible start
        goes out, before they are stored."""
        for alt, splitter in enumerate(self._splitters):
            for piece in splitter.finish() if splitter is not None else []:
                self._emit("thinking" if piece.thinking else "text", alt=alt, text=piece.text)
        self._splitters = [None] * self.n

    def _emit(self, kind: str, **fields) -> None:
        event = Event(kind, self, **fields)
        if kind in ("text", "thinking"):
            (self.pieces if kind == "text" else self.thoughts)[event.alt].append(event.text)
        if self._on_event is not None:
            self._on_event(event)
        else:
            self._queue.put(event)

    def set_state(self, state: State) -> None:
        self.state = state
        self._emit("state", state=state)

    def end(self, state: State, error: BaseException | None = None) -> None:
        """On the scheduler's thread: finish() — what it returns the job's result; what it raises its
        failure, where it had none — then the "end" event."""
        try:
            if self.finish is not None:
                try:
                    self.result = self.finish(self)
                except Exception as e:  # noqa: BLE001 — e.g. the reply could not be stored: the job says so
                    state, error = (State.FAILED, e) if error is None else (state, error)
        finally:
            self.state, self.error = state, error
            self._ended.set()  # before the event: whoever hears "end" may wait() on it
            self._emit("end")


def stream_text(
    job: JobView,
    on_prefill: Callable[[int, int], None] | None = None,
    on_thinking: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """A job's first reply's answer as text pieces, as they come; on_prefill(done, total) hears of a
    long prompt's progress, on_thinking(text) of each piece of its thinking. Leaving early (an
    exception, Ctrl+C) cancels the job and waits for it to end, so what it made is kept; a job that
    failed raises its error at the end."""
    try:
        for event in job.events():
            if event.kind == "text" and event.alt == 0:
                yield event.text
            elif event.kind == "thinking" and event.alt == 0 and on_thinking is not None:
                on_thinking(event.text)
            elif event.kind == "prefill" and on_prefill is not None:
                on_prefill(event.done, event.total)
    finally:
        if not job.state.ended:
            job.cancel()
            job.wait()
    if job.error is not None:
        raise job.error
