"""logprobs / top_logprobs in chat completions, streamed and not, with the real `openai` client on the
tiny model."""

from __future__ import annotations

import math

import openai
import pytest


def test_logprobs_give_each_token_of_the_reply_and_the_likeliest(served):
    reply = served.ask("x y z", temperature=0, logprobs=True, top_logprobs=3, max_tokens=8)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    # a token may hold part of a character: its bytes, joined, are the reply
    assert (
        b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace")
        == reply.choices[0].message.content
    )
    for e in entries:
        assert e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and math.isclose(
            tops[0], e.logprob
        )  # greedy: the likeliest
    assert sum(math.exp(t) for t in tops) <= 1 + 1e-6


def test_streamed_logprobs_are_those_of_the_reply_sent_whole(served):
    whole = (
        served.ask("x y z", temperature=0, logprobs=True, top_logprobs=2, max_tokens=8)
        .choices[0]
        .logprobs.content
    )
    stream = served.ask("x y z", temperature=0, logprobs=True, top_logprobs=2, max_tokens=8, stream=True)
    streamed = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
        (e.token, round(e.logprob, 5)) for e in whole
    ]


def test_without_logprobs_none_are_sent(served):
    assert served.ask("x y z", max_tokens=3).choices[0].logprobs is None


@pytest.mark.parametrize("extra", [{"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}])
def test_top_logprobs_out_of_range_or_alone_is_400(served, extra):
    with pytest.raises(openai.BadRequestError) as e:
        served.ask("hi", **extra)
    assert e.value.body["param"] == "top_logprobs"
