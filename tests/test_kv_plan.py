"""A model's KV plan: bits per layer and head where they buy the most, measured once and cached, and
blocks that read under any plan."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from llama_chat.app.chat.session_cache import SessionCache
from llama_chat.storage import ChatStore, kv_plan
from llama_chat.storage.codec import AUTO, AUTO_ROTATED, KVPlan, block_plan, checksum, decode_kv, encode_kv
from llama_chat.storage.kv_plan import allocate, measure_plan, model_plan, plan_path
from llama_chat.storage.records import StoredBlock


def estimates(kl4: float) -> dict[int, float]:
    """A unit's KL at each bits, shrinking with the square of the step."""
    return {4: kl4, 6: kl4 / 17.6, 8: kl4 / 289, 16: 0.0}


def test_bits_go_where_they_remove_the_most_error():
    units = {"fragile": estimates(1.0), "robust": estimates(1e-5), "middling": estimates(1e-3)}
    bits = allocate(units, budget=1e-3)
    assert bits["robust"] == 4 and bits["fragile"] >= 8 and bits["fragile"] >= bits["middling"]
    assert sum(units[u][b] for u, b in bits.items()) <= 1e-3


def test_within_the_budget_everything_stays_at_the_fewest_bits():
    units = {i: estimates(1e-5) for i in range(10)}
    assert set(allocate(units, budget=1e-3).values()) == {4}


@pytest.fixture(scope="module")
def tiny(tiny_model_paths):
    from llama_chat.inference import load_model

    return load_model(tiny_model_paths["qwen2"])


@pytest.mark.parametrize("codec", [AUTO, AUTO_ROTATED])
def test_a_measured_plan_keeps_the_calibration_text_within_its_budget(tiny, codec):
    loose, _ = measure_plan(tiny, budget=10.0, codec=codec)
    tight, report = measure_plan(tiny, budget=1e-6, codec=codec)
    assert loose == KVPlan.uniform(tiny.config.n_layer, tiny.config.n_head_kv, 4)
    assert report["calibration_kl"] <= 1e-6
    assert tight.bits_per_value() > loose.bits_per_value()


def test_a_models_plan_is_measured_once_then_read_from_the_cache(tiny, monkeypatch):
    first = model_plan(tiny)
    assert plan_path(tiny.fingerprint).is_file()

    def measure_again(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(kv_plan, "measure_plan", measure_again)
    assert model_plan(tiny) == first


def test_each_planned_codec_has_a_plan_of_its_own(tiny):
    """auto-h's plan is measured with its rotated values, and cached beside auto's, not over it."""
    plans = {codec: model_plan(tiny, codec=codec) for codec in (AUTO, AUTO_ROTATED)}
    assert plan_path(tiny.fingerprint, AUTO) != plan_path(tiny.fingerprint, AUTO_ROTATED)
    for codec, plan in plans.items():
        assert kv_plan.read_plan(plan_path(tiny.fingerprint, codec), *plan.shape) == plan


@pytest.mark.parametrize("content", ["not json", '{"format": 1, "k_bits": [[5]], "v_bits": [[5]]}', "{}"])
def test_a_damaged_or_foreign_cached_plan_is_measured_again(tiny, content):
    path = plan_path(tiny.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    plan = model_plan(tiny)
    assert plan.shape == (tiny.config.n_layer, tiny.config.n_head_kv)
    assert kv_plan.read_plan(path, *plan.shape) == plan  # and the good one replaced the bad


def test_a_block_written_under_one_plan_reads_under_another(tiny_model_paths, tmp_path):
    from llama_chat.inference import load_model

    model = load_model(tiny_model_paths["qwen2"])  # of its own: a pool has one block source
    store = ChatStore(tmp_path / "chat.db")
    session = store.create_session()
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((2, 2, 64, 16)).astype(np.float32) for _ in range(2))
    first = KVPlan.uniform(2, 2, 8)
    tokens = list(range(64))
    data = encode_kv(k, v, AUTO, first)
    block = StoredBlock(b"k" * 16, 64, AUTO, data, checksum(data), tokens)
    store.kv.save_snapshot(session.id, model.fingerprint, [block.key], [block], None, 64)
    later = SessionCache(model, store, threading.RLock(), 128, AUTO, plan=KVPlan.uniform(2, 2, 4))
    got = np.empty_like(k), np.empty_like(v)
    assert later.fetch(b"k" * 16, tokens, None, got)
    stored = store.kv.load_block(b"k" * 16, model.fingerprint)
    assert block_plan(stored.data) == first
    assert np.array_equal(got[0], decode_kv(stored.data)[0])
    assert np.abs(got[0] - k).max() < 0.05  # 8 bits, not the 4 of the plan it was read under


def test_the_benchmarks_codec_table_has_a_row_for_the_plan():
    """`bench --json` lists auto beside the uniform codecs, under the model's plan."""
    from llama_chat.app.bench.stored import measure_codecs

    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((2, 2, 100, 16)).astype(np.float32) for _ in range(2))
    table = measure_codecs(k, v, KVPlan.uniform(2, 2, 4))
    assert set(table) == {"f32", "f16", "q8", "q6", "q4", AUTO}
    assert abs(table[AUTO]["bytes"] - table["q4"]["bytes"]) < 0.1 * table["q4"]["bytes"]


@pytest.mark.parametrize("codec", [AUTO, AUTO_ROTATED])
def test_a_conversation_stored_in_planned_blocks_resumes_and_travels_in_a_file(
    tiny_model_paths, tmp_path, codec
):
    """Under a planned codec (auto, auto-h) a conversation is stored under the model's plan, resumes in a
    fresh engine with nothing recomputed, and its export file imports elsewhere with its blocks as they
    are."""
    from llama_chat.app.chat.engine import ChatEngine
    from llama_chat.app.chat.jobs import stream_text
    from llama_chat.inference import SamplingParams, load_model
    from llama_chat.storage.exchange import export_session, import_session

    path = tiny_model_paths["qwen2"]
    engine = ChatEngine(load_model(path, block_size=8), ChatStore(tmp_path / "a.db"), codec=codec)
    session = engine.new_session("auto")
    "".join(
        stream_text(
            engine.reply(
                session, "the sun and the moon and the stars", sampling=SamplingParams(temperature=0)
            )
        )
    )
    session = engine._store.get_session(session.id)
    blocks = engine._store.connection.rows("SELECT codec, data FROM kv_blocks")
    assert blocks and {b["codec"] for b in blocks} == {codec}
    assert {block_plan(b["data"]) for b in blocks} == {model_plan(engine._model, codec=codec)}

    fresh = ChatEngine(load_model(path, block_size=8), ChatStore(tmp_path / "a.db"), codec="q6")
    info = fresh.resume(fresh._store.get_session(session.id))
    assert info.tokens > 8 and info.restored == info.tokens  # read under another codec: nothing computed

    export_session(engine._store, session.id, tmp_path / "s.llamachat")
    target = ChatStore(tmp_path / "b.db")
    result = import_session(target, tmp_path / "s.llamachat", model_fingerprint=engine.model_info.fingerprint)
    assert result.kv == "imported" and result.blocks_added == len(blocks)
    assert {r["codec"] for r in target.connection.rows("SELECT codec FROM kv_blocks")} == {codec}
    elsewhere = ChatEngine(load_model(path, block_size=8), target)
    info = elsewhere.resume(target.get_session(result.session_ids[0]))
    assert info.restored == info.tokens
