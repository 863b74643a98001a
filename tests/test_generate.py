"""The generation loop and the headless commands, on tiny models."""

from __future__ import annotations

import io
import json
import threading

import pytest

from llama_chat.app.cli import main
from llama_chat.inference import GenerationStats, SamplingParams, chat_prompt_ids, generate, load_model

GREEDY = SamplingParams(temperature=0)


@pytest.fixture
def qwen2(tiny_model_paths):
    return load_model(tiny_model_paths["qwen2"])


def reply(model, ids, **kwargs):
    stats = GenerationStats()
    text = "".join(generate(model, ids, stats=stats, **kwargs))
    return text, stats


def test_stops_at_the_token_limit(qwen2):
    ids = chat_prompt_ids(qwen2, [{"role": "user", "content": "hello"}])
    text, stats = reply(qwen2, ids, sampling=GREEDY, max_tokens=7)
    assert stats.generated_tokens == 7 and stats.stop_reason == "length"
    assert text == qwen2.tokenizer.decode(stats.token_ids)
    assert (stats.prompt_tokens, stats.prefilled_tokens, stats.decoded_tokens) == (len(ids), len(ids), 6)
    assert stats.prefill_tok_s > 0 and stats.decode_tok_s > 0  # both timed: no 0.0 tok/s printed


def test_stop_string_ends_the_reply_before_it(qwen2):
    ids = chat_prompt_ids(qwen2, [{"role": "user", "content": "hello"}])
    full, _ = reply(qwen2, ids, sampling=GREEDY, max_tokens=40)
    stop = full[10:13]
    assert len(stop) == 3
    text, stats = reply(qwen2, ids, sampling=GREEDY, max_tokens=40, stop=[stop])
    assert stats.stop_reason == "stop"
    assert text == full[: full.index(stop)]


def test_cancel_from_another_thread_stops_within_one_token(qwen2):
    ids = chat_prompt_ids(qwen2, [{"role": "user", "content": "hello"}])
    cancel = threading.Event()
    stats = GenerationStats()
    pieces = generate(qwen2, ids, sampling=GREEDY, max_tokens=100_000, cancel=cancel, stats=stats)
    next(pieces)
    seen = stats.generated_tokens
    threading.Thread(target=cancel.set).start()
    cancel.wait()
    rest = list(pieces)
    assert stats.stop_reason == "cancelled"
    assert stats.generated_tokens <= seen + 1
    assert len(rest) <= 2  # at most the token in flight and what the decoder still held


def test_cancel_during_a_long_prefill_stops_between_batches(qwen2):
    qwen2.prefill_batch = 8
    ids = chat_prompt_ids(qwen2, [{"role": "user", "content": "hello the world and the sun " * 4}])
    cancel = threading.Event()
    seq = qwen2.new_sequence(256)
    text, stats = reply(
        qwen2,
        ids,
        seq=seq,
        sampling=GREEDY,
        max_tokens=10,
        cancel=cancel,
        on_prefill=lambda d, t: cancel.set(),
    )
    assert text == "" and stats.stop_reason == "cancelled" and stats.generated_tokens == 0
    assert stats.prefilled_tokens == seq.n_tokens == 8  # one batch ran; it stays, for the next turn
    cancel.clear()
    resumed, stats = reply(qwen2, ids, seq=seq, sampling=GREEDY, max_tokens=10)
    assert stats.prefilled_tokens == len(ids) - 8
    assert resumed == reply(qwen2, ids, sampling=GREEDY, max_tokens=10)[0]


def test_a_seed_repeats_a_sampled_reply(qwen2):
    ids = chat_prompt_ids(qwen2, [{"role": "user", "content": "the world"}])
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    first, _ = reply(qwen2, ids, sampling=sampling, max_tokens=20)
    again, _ = reply(qwen2, ids, sampling=SamplingParams(**{**sampling.__dict__}), max_tokens=20)
    other, _ = reply(qwen2, ids, sampling=SamplingParams(**{**sampling.__dict__, "seed": 7}), max_tokens=20)
    assert first == again
    assert first != other


def test_a_cache_holding_an_earlier_turn_prefills_only_the_rest(qwen2):
    messages = [{"role": "user", "content": "hello the world"}]
    cache = qwen2.new_sequence(512)
    first, stats1 = reply(qwen2, chat_prompt_ids(qwen2, messages), seq=cache, sampling=GREEDY, max_tokens=10)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "and then"}]
    ids = chat_prompt_ids(qwen2, messages)
    second, stats2 = reply(qwen2, ids, seq=cache, sampling=GREEDY, max_tokens=10)
    assert stats2.prefilled_tokens < stats2.prompt_tokens - stats1.prompt_tokens + 5
    fresh, _ = reply(qwen2, ids, sampling=GREEDY, max_tokens=10)
    assert second == fresh


def test_a_long_prompt_reports_its_prefill_batch_by_batch(qwen2, tiny_model_paths):
    small = load_model(tiny_model_paths["qwen2"], prefill_batch=8)
    ids = chat_prompt_ids(small, [{"role": "user", "content": "hello the world and the sun " * 4}])
    seen = []
    text, stats = reply(
        small, ids, sampling=GREEDY, max_tokens=4, on_prefill=lambda d, t: seen.append((d, t))
    )
    assert len(ids) > 24 and stats.prefilled_tokens == len(ids)
    assert [t for _, t in seen] == [len(ids)] * -(-len(ids) // 8)  # one report per batch
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and seen[-1][0] == len(ids)
    assert text == reply(qwen2, ids, sampling=GREEDY, max_tokens=4)[0]  # batching changes nothing
    seen.clear()
    reply(small, ids[:6], sampling=GREEDY, max_tokens=2, on_prefill=lambda d, t: seen.append((d, t)))
    assert seen == []  # a prompt of one batch has nothing to report


def test_ask_streams_the_reply_to_stdout_and_stats_to_stderr(tiny_model_paths, capsys, monkeypatch):
    path = str(tiny_model_paths["qwen2"])
    assert main(["--model", path, "ask", "--temp", "0", "--max-tokens", "6", "hello"]) == 0
    out, err = capsys.readouterr()
    model = load_model(path)
    expected, _ = reply(
        model, chat_prompt_ids(model, [{"role": "user", "content": "hello"}]), sampling=GREEDY, max_tokens=6
    )
    assert out == expected + "\n"
    assert "6 generated" in err and "tok/s" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("hello"))
    assert main(["--model", path, "ask", "--temp", "0", "--max-tokens", "6", "-"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_tokenize_prints_ids_as_json(tiny_model_paths, capsys):
    path = str(tiny_model_paths["qwen2"])
    model = load_model(path)
    assert main(["--model", path, "tokenize", "--special", "<|im_start|>hello"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids[0] == model.tokenizer.encode("<|im_start|>", special=True)[0]
    assert model.tokenizer.decode(ids) == "<|im_start|>hello"
    assert main(["--model", path, "tokenize", "<|im_start|>"]) == 0
    assert len(json.loads(capsys.readouterr().out)) > 1  # without --special it is plain text



@pytest.mark.parametrize("temperature", [0.0, 0.5], ids=["greedy", "seeded"])
def test_prompt_lookup_changes_no_token(tiny_model_path, temperature):
    """Guessed runs are checked by the model and kept only where it would have produced them itself:
    the same tokens as plain decoding, greedy or with the same draw per position for a seed."""
    model = load_model(tiny_model_path)
    text = "the hello world is in the air, then the water and the sun. " * 4
    ids = chat_prompt_ids(model, [{"role": "user", "content": text}])
    drafted = 0
    for seed in range(4):
        sampling = SamplingParams(temperature=temperature, seed=seed)
        plain, plain_stats = reply(model, ids, sampling=sampling, max_tokens=80, lookup=False)
        looked, stats = reply(model, ids, sampling=sampling, max_tokens=80)
        assert stats.token_ids == plain_stats.token_ids and looked == plain
        assert plain_stats.drafted_tokens == 0
        drafted += stats.drafted_tokens
    assert drafted > 0  # guesses were made and checked


def test_forward_passes_sees_every_row_the_scheduler_computes(qwen2, tmp_path, forward_passes):
    """The fixture that slows the app's tests (conftest.py) must see the passes the scheduler makes:
    two replies at once, so that a prompt's pieces are read beside the other reply's rows."""
    from llama_chat.app.chat.engine import ChatEngine
    from llama_chat.storage import ChatStore

    engine = ChatEngine(qwen2, ChatStore(tmp_path / "chat.db"))
    texts = ("hello the world and the sun " * 8, "the rain over the hills, then the sea " * 8)
    jobs = [engine.reply(engine.new_session(t[:9]), t, sampling=GREEDY, max_tokens=12) for t in texts]
    for job in jobs:
        job.wait()
    stats = [job.stats[0] for job in jobs]
    assert all(s.prefilled_tokens > 40 and s.generated_tokens == 12 for s in stats)
    computed = sum(s.prefilled_tokens + s.generated_tokens - 1 for s in stats)  # the last token needs no pass
    assert sum(forward_passes) >= computed
    engine.close()
