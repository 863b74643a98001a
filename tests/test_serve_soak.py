"""benchmarks/serve_load.py --soak: clients leaving and refused against a real `llama-chat serve` on
loopback, then nothing left behind. A few seconds on the tiny model; the real soak is in
docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # serve_load imports its neighbours as a script does

from serve_load import ghost_turns, soak_failed  # noqa: E402


def reply(tokens: int, stop: str = "length") -> dict:
    return {"role": "assistant", "stats": {"generated_tokens": tokens, "stop_reason": stop}}


USER = {"role": "user", "stats": None}


def test_a_ghost_turn_is_a_user_message_without_a_reply_that_wrote_something():
    assert ghost_turns([USER, reply(4), USER, reply(1, "cancelled")]) == 0  # a reply stopped early is kept
    assert ghost_turns([USER, reply(0, "eog")]) == 0  # the model ended its turn at once
    assert ghost_turns([USER, reply(0, "cancelled")]) == 1  # an empty cancelled reply
    assert ghost_turns([USER, reply(3), USER]) == 1  # a message with no reply at all
    assert ghost_turns([{"role": "system", "stats": None}, USER, reply(2)]) == 0


def test_the_soak_fails_on_anything_left_behind():
    clean = {"failed": 0, "kv_in_use_after_bytes": 0, "active_after": 0, "queued_after": 0, "ghost_turns": 0}
    clean["replies_unlike_solo"] = 0
    assert not soak_failed(clean)
    for check in clean:
        assert soak_failed({**clean, check: 1}), check


def test_a_short_soak_on_the_tiny_model_leaves_nothing_behind(qwen2):
    run = subprocess.run(
        [sys.executable, "serve_load.py", "--soak", "4", "--clients", "4", "--model", str(qwen2),
         "--max-tokens", "4", "--system-tokens", "40", "--threads", "1"],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])["soak"]
    assert result["clients"] == 4 and result["completed"] > 0 and result["sessions"] >= 3
    assert result["failed"] == result["ghost_turns"] == result["kv_in_use_after_bytes"] == 0
