"""The scheduler: one thread owns the model and advances every admitted job a step at a time.

A step computes the next piece of the prompts still being read (several jobs' in one pass, up to
`prefill_batch` tokens in all) and the next row of every reply being decoded, of every job together:
where the kernels take all those rows (kernels.kernels_take) in one forward pass, the weights read once
for all of them, as llama.cpp's server batches prompts and replies; else a prefill pass, then a decode
pass. So regenerate ×3 is one job of three replies in one batch, two conversations replying at once
share each step, and eight clients' new turns are read together. Prompts are cut into batches between
steps, so a long prompt never stalls the replies already streaming for more than one batch.

Front ends submit a Job (jobs.py) and render its events. Whoever else touches the model's KV (opening
a session, a snapshot, a fork) holds `scheduler.lock`, which each step holds too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from llama_chat.inference import Model
from llama_chat.inference.generate import ReplyStream, draft_rooms, run_streams, start_streams
from llama_chat.inference.kernels import KERNEL_ROWS, kernels_take

from .jobs import Job, QueueFull, State
from .settings import DEFAULT_PARALLEL, DEFAULT_QUEUE


@dataclass
class _Run:
    """An admitted job: its prompt, where its prefill is, then its replies."""

    job: Job
    prompt: list[int]
    seq: object
    todo: list[int]  # the prompt's tokens after those its sequence held when its prefill began
    done: int = 0  # of todo
    logits: object = None
    streams: list[ReplyStream] = field(default_factory=list)


class Scheduler:
    def __init__(self, model: Model, parallel: int = DEFAULT_PARALLEL, max_queued: int = DEFAULT_QUEUE):
        self.model = model
        self.parallel = parallel
        self.max_queued = max_queued
        self.lock = threading.RLock()
        self._wake = threading.Condition()
        self._queue: deque[Job] = deque()
        self._runs: list[_Run] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- front ends --------------------------------------------------------------------------------

    def submit(self, job: Job) -> Job:
        with self._wake:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"{len(self._queue)} replies are waiting already")
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
                self._thread.start()
            self._wake.notify()
        return job

    def load(self) -> dict:
        """How busy it is: replies being made and jobs waiting."""
        with self._wake:
            return {"active": len(self._runs), "queued": len(self._queue)}

    @property
    def closed(self) -> bool:
        """Whether close() was called: a job cancelled since was cut short by it."""
        return self._closed

    def close(self) -> None:
        """Cancel every job, let them end (their replies are kept), and stop the thread."""
        with self._wake:
            self._closed = True
            for job in [*self._queue, *(r.job for r in self._runs)]:
                job.cancel()
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- the thread --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._runs and not self._closed:
                    self._wake.wait()
                if self._closed and not self._queue and not self._runs:
                    return
                admit = self._next_jobs(self.parallel - len(self._runs))
            with self.lock:
                for job in admit:
                    self._admit(job)
                self._step()
            # Let a thread waiting for the lock in (a front end's fork, snapshot or new session): Python's
            # lock is not fair, and this thread, taking it again at once, could keep it out until every
            # reply ended (a busy loop holding a lock 20 ms at a time kept another thread out for a minute).
            time.sleep(0)

    def _next_jobs(self, room: int) -> list[Job]:
        """Up to `room` waiting jobs taken from the queue, oldest first, but none while its session has
        a job running or an older one waiting: each turn of a session starts from the one before it."""
        busy = {r.job.session_id for r in self._runs}
        taken: list[Job] = []
        for job in list(self._queue):
            if len(taken) == room:
                break
            if job.session_id is None or job.session_id not in busy:
                taken.append(job)
                self._queue.remove(job)
            busy.add(job.session_id)
        return taken

    def _admit(self, job: Job) -> None:
        if job.dropped:  # its client left while it waited: nothing to prepare, nothing to keep
            return job.end(State.CANCELLED)
        # Else a job cancelled while it waited still runs its first batch and ends at once: its
        # finish() keeps what it was for (the user's message, in a chat).
        job.set_state(State.PREFILLING)
        try:
            prompt, seq = job.prepare()
            seq.reuse_prefix(prompt[:-1])  # blocks any sequence computed before are shared
        except Exception as e:  # noqa: BLE001 — whatever the job's own setup raises is its failure
            return job.end(State.FAILED, e)
        job.stats[0].prompt_tokens = len(prompt)
        run = _Run(job, prompt, seq, prompt[seq.n_tokens :])
        job.started = True
        with self._wake:
            self._runs.append(run)

    def _step(self) -> None:
        batch = self._pieces([r for r in self._runs if not r.streams])
        decoding = [r for r in self._runs if r.streams]
        if batch and decoding and self._fits_one_pass(batch, decoding):
            waiting = self._advance(decoding, guesses=False)
            self._pass(batch, waiting)  # prompts' pieces and replies' rows: the weights read once
        else:
            if batch:
                self._pass(batch, [])
            decoding = [r for r in self._runs if r.streams]  # with those whose prompt is now read
            self._pass([], self._advance(decoding))
        for run in decoding:
            if run in self._runs and all(s.done for s in run.streams):
                self._end(run, State.CANCELLED if run.job.cancelled else State.DONE)

    def _fits_one_pass(self, batch: list[tuple[_Run, list[int]]], decoding: list[_Run]) -> bool:
        """Whether the pieces and the replies' next rows (one token each) go in one pass that the
        kernels take, where every row gets the bits of its own pass."""
        streams = [s for r in decoding for s in r.streams if not s.done]
        return kernels_take(sum(len(piece) for _, piece in batch) + len(streams))

    def _advance(self, decoding: list[_Run], guesses: bool = True) -> list[ReplyStream]:
        """Sample every reply's ready tokens (their text goes out); returns the streams that wait for
        a pass. Without `guesses` no prompt-lookup rows are added: beside a prompt's piece a pass is
        compute-bound and every guessed row costs what a prompt's row costs."""
        streams = [s for r in decoding for s in r.streams if not s.done]
        room = draft_rooms(len(streams)) if guesses else 0
        for run in decoding:
            for alt, stream in enumerate(run.streams):
                if not stream.done:
                    for piece in stream.advance(run.job.cancel_event, room):
                        run.job.emit("text", alt=alt, text=piece)
        return [s for s in streams if s.pending]

    def _pass(self, batch: list[tuple[_Run, list[int]]], waiting: list[ReplyStream]) -> None:
        """One forward pass over the next piece of the prompts in `batch` and the rows the `waiting`
        replies need; a prompt all computed starts its replies."""
        if not batch and not waiting:
            return
        t0 = time.perf_counter()
        total = sum(len(piece) for _, piece in batch) + sum(len(s.pending) for s in waiting)
        try:
            if not batch:
                run_streams(self.model, waiting)
                return
            reads = [(run.seq, piece) for run, piece in batch]
            if waiting:
                logits, rows = self.model.read_and_verify(reads, [(s.seq, s.pending) for s in waiting])
            else:
                logits, rows = self.model.step(reads), []
        except Exception as e:  # noqa: BLE001 — e.g. the block pool is full: these cannot go on
            replying = [r for r in self._runs if any(s in waiting for s in r.streams)]
            for run in [run for run, _ in batch] + replying:
                self._end(run, State.FAILED, e)
            return
        for stream, computed in zip(waiting, rows, strict=True):
            stream.computed(computed)
        elapsed = time.perf_counter() - t0
        for (run, piece), last in zip(batch, logits, strict=True):
            stats = run.job.stats[0]
            stats.prefill_s += elapsed * len(piece) / max(total, 1)  # the pass's time, shared by its rows
            stats.prefilled_tokens += len(piece)
            run.done += len(piece)
            run.logits = last
            if len(run.todo) > self.model.prefill_batch:
                run.job.emit("prefill", done=run.done, total=len(run.todo))
            if run.done == len(run.todo):
                self._start(run)

    def _pieces(self, prefilling: list[_Run]) -> list[tuple[_Run, list[int]]]:
        """Which prompts' next pieces share this step's pass, oldest first: up to `prefill_batch` tokens
        in all (the oldest's piece always), at most KERNEL_ROWS prompts, and only pieces longer than
        KERNEL_ROWS together, and only where the pass takes the way each piece takes alone (the kernels,
        or past the measured crossover kernels.blas_from BLAS) — so each row gets the bits it gets when
        its prompt is read alone. A prompt that shares its next block with an older one being read waits, to
        take that block when it is computed (clients sending the same system prompt at once)."""
        batch: list[tuple[_Run, list[int]]] = []
        rows = 0
        for i, run in enumerate(prefilling):
            if run.job.dropped:
                self._end(run, State.CANCELLED)
                continue
            if run.done and run.job.cancelled:  # the sequence keeps the batches done, for the next turn
                self._start(run)
                continue
            try:
                self._take_shared_blocks(run)
                if not run.done:
                    self.model.check_room(run.seq, len(run.todo))  # refused before any pass runs
            except Exception as e:  # noqa: BLE001 — e.g. the context window is full
                self._end(run, State.FAILED, e)
                continue
            if self._waits_for_shared_block(run, prefilling[:i]):
                continue
            piece = self.model.next_piece(run.todo, run.done)
            alone = len(piece) <= KERNEL_ROWS
            shortest = min([len(piece)] + [len(p) for _, p in batch])
            same_way = kernels_take(rows + len(piece)) == kernels_take(shortest)
            if batch and (
                alone
                or not same_way
                or rows + len(piece) > self.model.prefill_batch
                or len(batch) == KERNEL_ROWS
            ):
                continue
            batch.append((run, piece))
            rows += len(piece)
            if alone:
                break
        return batch

    def _take_shared_blocks(self, run: _Run) -> None:
        """Blocks that another job computed since this one began are taken, not computed again."""
        held = run.seq.n_tokens
        if run.seq.reuse_prefix(run.prompt[:-1]) > held:
            run.todo, run.done = run.prompt[run.seq.n_tokens :], 0

    def _waits_for_shared_block(self, run: _Run, older: list[_Run]) -> bool:
        B = self.model.pool.block_size
        at = run.seq.n_tokens
        block = run.prompt[at : at + B]
        # no full block to gain (past a block's start; the last token)
        if at % B or at + B >= len(run.prompt):
            return False
        return any(
            o.seq.n_tokens < at + B
            and o.prompt[at : at + B] == block
            and o.seq.namespace == run.seq.namespace
            for o in older
            if not o.streams
        )

    def _start(self, run: _Run) -> None:
        job = run.job
        complete = run.done == len(run.todo)
        lookup = self.model.prompt_lookup if job.lookup is None else job.lookup
        run.streams = start_streams(
            self.model, run.prompt, run.seq, run.logits if complete else None, job.stats,
            sampling=job.sampling, stop=job.stop, max_tokens=job.max_tokens, lookup=lookup,
            continues_text=job.continues_text,
        )  # fmt: skip
        job.seqs = [s.seq for s in run.streams]
        job.set_state(State.DECODING)

    def _end(self, run: _Run, state: State, error: BaseException | None = None) -> None:
        with self._wake:
            if run in self._runs:
                self._runs.remove(run)
            else:
                return
        for stream in run.streams:
            stream.seq.truncate(stream.seq.n_tokens)  # a guess's KV is given back
        job = run.job
        job.replies_written()
        for stats in job.stats:
            stats.stop_reason = stats.stop_reason or "cancelled"  # a reply cut short by a failure
        job.end(state, error)  # finish(): also after a failure, what was made is kept
