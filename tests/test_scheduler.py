"""The scheduler: jobs from many front ends decoded together, each reply as it would be alone."""

from __future__ import annotations

import threading

import pytest

from llama_chat.app.chat.jobs import Job, State
from llama_chat.app.chat.scheduler import QueueFull, Scheduler
from llama_chat.inference import (
    GenerationStats,
    SamplingParams,
    blas_crossover,
    chat_prompt_ids,
    generate,
    kernels,
    load_model,
)

GREEDY = SamplingParams(temperature=0)
QUESTIONS = ["hello the world", "the sun and the water", "a b c d e f g", "what is the world"]


@pytest.fixture
def model(tiny_model_paths):
    return load_model(tiny_model_paths["qwen2"])


def prompt(model, text: str) -> list[int]:
    return chat_prompt_ids(model, [{"role": "user", "content": text}])


def alone(model, text: str, sampling=GREEDY, max_tokens=24) -> tuple[str, list[int]]:
    stats = GenerationStats()
    out = "".join(generate(model, prompt(model, text), sampling=sampling, max_tokens=max_tokens, stats=stats))
    return out, stats.token_ids


def job_for(model, text: str, sampling=GREEDY, max_tokens=24, **kwargs) -> Job:
    ids = prompt(model, text)
    return Job(
        lambda: (ids, model.new_sequence(len(ids) + max_tokens + 1)),
        sampling=sampling,
        max_tokens=max_tokens,
        finish=lambda job: [s.free() for s in job.seqs],
        **kwargs,
    )


class PassCounter:
    """Counts the forward passes of decoding and the rows in each."""

    def __init__(self, model, monkeypatch):
        self.rows: list[int] = []
        verify_rows = model.verify_rows

        def counted(batch):
            self.rows.append(sum(len(t) for _, t in batch))
            return verify_rows(batch)

        monkeypatch.setattr(model, "verify_rows", counted)


def test_a_prompt_read_while_a_reply_streams_shares_its_pass_and_changes_no_token(model, monkeypatch):
    """A new prompt's piece and the streaming reply's next row go through one pass (the weights read
    once for both), and each gets the tokens it gets alone."""
    monkeypatch.setattr(blas_crossover, "measured_blas_from", lambda progress=None: None)  # the kernels take
    monkeypatch.setattr(kernels, "blas_from", None)  # every pass, whatever this machine measured
    first, second = "hello the world " * 3, "the sun and the water " * 4
    expected = [alone(model, first, max_tokens=30), alone(model, second, max_tokens=8)]
    assert len(expected[0][1]) > 4, "the first reply must still stream when the second prompt comes"
    fused = []
    read_and_verify = model.read_and_verify
    monkeypatch.setattr(model, "read_and_verify", lambda r, c: fused.append(len(r)) or read_and_verify(r, c))
    scheduler = Scheduler(model)
    later = job_for(model, second, max_tokens=8)
    submitted = []

    def on_event(event):
        if event.kind == "text" and not submitted:
            submitted.append(scheduler.submit(later))

    streaming = job_for(model, first, max_tokens=30, on_event=on_event)
    scheduler.submit(streaming)
    assert streaming.wait(60) and later.wait(60)
    assert fused, "the second prompt was read in a pass of its own"
    assert [streaming.stats[0].token_ids, later.stats[0].token_ids] == [ids for _, ids in expected]


def test_replies_decoded_together_are_the_replies_decoded_alone(model, monkeypatch):
    expected = [alone(model, q) for q in QUESTIONS]
    sampled = SamplingParams(temperature=0.9, seed=7)
    expected_sampled = alone(model, QUESTIONS[0], sampled)
    counter = PassCounter(model, monkeypatch)
    scheduler = Scheduler(model, parallel=8)
    jobs = [job_for(model, q) for q in QUESTIONS] + [job_for(model, QUESTIONS[0], sampled)]
    for job in jobs:
        scheduler.submit(job)
    for job in jobs:
        assert job.wait(60)
    assert [(j.text(), j.stats[0].token_ids) for j in jobs[:4]] == expected
    assert (jobs[4].text(), jobs[4].stats[0].token_ids) == expected_sampled
    assert all(j.state is State.DONE for j in jobs)
    assert max(counter.rows) > 1  # some passes decoded several replies at once
    assert sum(counter.rows) < sum(len(j.stats[0].token_ids) for j in jobs)  # fewer passes than tokens


def test_alternatives_of_one_job_differ_and_each_is_its_seeded_reply_alone(model):
    sampled = SamplingParams(temperature=0.9, seed=3)
    job = Scheduler(model).submit(job_for(model, QUESTIONS[1], sampled, n=3))
    assert job.wait(60) and job.state is State.DONE
    for i in range(3):
        seeded = SamplingParams(temperature=0.9, seed=3 + i)
        assert job.text(i) == alone(model, QUESTIONS[1], seeded)[0]
    assert len({job.text(i) for i in range(3)}) > 1


def test_events_arrive_in_order_and_end_once(model):
    job = Scheduler(model).submit(job_for(model, QUESTIONS[0]))
    events = list(job.events())
    assert [e.state for e in events if e.kind == "state"] == [State.PREFILLING, State.DECODING]
    assert [e.kind for e in events][-1] == "end" and [e.kind for e in events].count("end") == 1
    assert "".join(e.text for e in events if e.kind == "text") == alone(model, QUESTIONS[0])[0]
    assert job.state is State.DONE


def test_a_cancelled_job_ends_and_the_others_go_on(model):
    scheduler = Scheduler(model)
    long = job_for(
        model, QUESTIONS[0], max_tokens=500, on_event=lambda e: e.kind == "text" and e.job.cancel()
    )
    other = job_for(model, QUESTIONS[1])
    scheduler.submit(long)
    scheduler.submit(other)
    assert long.wait(60) and other.wait(60)
    assert long.state is State.CANCELLED and long.stats[0].stop_reason == "cancelled"
    assert long.stats[0].generated_tokens < 500
    assert other.state is State.DONE and other.text() == alone(model, QUESTIONS[1])[0]


def test_a_failing_job_fails_alone_with_its_error(model):
    scheduler = Scheduler(model)

    def broken():
        raise ValueError("no such conversation")

    bad = scheduler.submit(Job(broken, max_tokens=4))
    good = scheduler.submit(job_for(model, QUESTIONS[2]))
    assert bad.wait(60) and good.wait(60)
    assert bad.state is State.FAILED and str(bad.error) == "no such conversation"
    assert good.state is State.DONE and good.text() == alone(model, QUESTIONS[2])[0]


def test_a_full_queue_refuses_more_and_frees_every_sequence_after(model):
    in_use = model.pool.memory_breakdown()["in_use_bytes"]
    scheduler = Scheduler(model, parallel=1, max_queued=2)
    gate = threading.Event()
    first = scheduler.submit(job_for(model, QUESTIONS[0], on_event=lambda e: gate.wait(60)))
    while first.state is State.QUEUED:  # admitted, and held at its first event
        first.wait(0.01)
    waiting = [scheduler.submit(job_for(model, q)) for q in QUESTIONS[1:3]]  # the queue holds these
    with pytest.raises(QueueFull):
        scheduler.submit(job_for(model, QUESTIONS[3]))
    gate.set()
    assert all(j.wait(60) for j in [first, *waiting])
    scheduler.close()
    assert model.pool.memory_breakdown()["in_use_bytes"] == in_use and not model.pool.sequences


# Where this machine's BLAS takes over from the kernels (kernels.blas_from): never, past 32 rows, and
# between one prompt's 40-token piece and three of them together.
@pytest.mark.parametrize("blas_from, together", [(None, True), (33, True), (64, False)])
def test_new_prompts_are_read_together_and_a_shared_beginning_once(
    tiny_model_paths, monkeypatch, blas_from, together
):
    """Four clients send a long shared system prompt and questions of their own at once: their prompts
    are read in passes of several jobs where the pass takes the way (kernels or BLAS) each piece takes
    alone, the shared blocks are computed once, and every reply, greedy or seeded, is the one it gets
    when the four come one after the other."""
    # (read at each load)
    monkeypatch.setattr(blas_crossover, "measured_blas_from", lambda progress=None: blas_from)
    monkeypatch.setattr(kernels, "blas_from", blas_from)
    system = " ".join(["the world and the sun and the water"] * 3)
    questions = QUESTIONS
    settings = [
        GREEDY,
        SamplingParams(temperature=0.9, seed=5),
        GREEDY,
        SamplingParams(temperature=0.8, seed=1),
    ]

    def jobs_on(model) -> list[Job]:
        out = []
        for q, s in zip(questions, settings, strict=True):
            ids = chat_prompt_ids(
                model, [{"role": "system", "content": system}, {"role": "user", "content": q}]
            )
            out.append(
                Job(
                    lambda p=ids: (p, model.new_sequence(len(p) + 13)),
                    sampling=s,
                    max_tokens=12,
                    finish=lambda job: [x.free() for x in job.seqs],
                )
            )
        return out

    def load():
        return load_model(tiny_model_paths["qwen2"], block_size=16, prefill_batch=256)

    one_by_one = Scheduler(load())
    expected = []
    for job in jobs_on(one_by_one.model):
        assert one_by_one.submit(job).wait(60) and job.state is State.DONE, job.error
        expected.append((job.stats[0].token_ids, job.stats[0].prefilled_tokens))

    model = load()
    passes: list[int] = []
    step = model.step

    def counted(batch, *args, **kwargs):
        passes.append(len(batch))
        return step(batch, *args, **kwargs)

    monkeypatch.setattr(model, "step", counted)
    scheduler = Scheduler(model, parallel=4)
    jobs = jobs_on(model)
    with scheduler.lock:  # all four are admitted before the first step
        for job in jobs:
            scheduler.submit(job)
    for job in jobs:
        assert job.wait(60) and job.state is State.DONE
    assert [j.stats[0].token_ids for j in jobs] == [tokens for tokens, _ in expected]
    assert (max(passes) > 1) == together, (passes, expected)
    # the shared system prompt was computed once, as when the clients come one after the other
    assert sum(j.stats[0].prefilled_tokens for j in jobs) == sum(n for _, n in expected)
    assert all(n < expected[0][1] - 32 for _, n in expected[1:])  # the later ones took its blocks
