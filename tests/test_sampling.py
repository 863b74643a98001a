"""Token sampling: greedy, top-k, top-p, min-p, temperature, repeat penalty and reproducible seeds."""

import numpy as np
import pytest

from llama_chat.inference.sampling import Sampler, SamplingParams

# Four tokens with probabilities 0.5, 0.3, 0.15 and 0.05 at temperature 1.
PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = np.log(PROBS).astype(np.float32)

PLAIN = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}  # every filter off


def random_logits(n: int, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def draws(params: SamplingParams, logits: np.ndarray, n: int, recent=()) -> np.ndarray:
    sampler = Sampler(params)
    return np.array([sampler.sample(logits, recent) for _ in range(n)])


def survivors(params: SamplingParams, logits: np.ndarray, recent=()) -> set[int]:
    ids, _ = Sampler(params).distribution(logits, recent)
    return set(ids.tolist())


def reference_distribution(logits: np.ndarray, params: SamplingParams, recent=()) -> dict[int, float]:
    """llama.cpp's chain written the slow, obvious way: a full sort, then each filter in turn."""
    x = logits.astype(np.float32).copy()
    if params.repeat_penalty != 1.0 and params.repeat_last_n != 0:
        for t in set(recent[-params.repeat_last_n :]):
            x[t] = x[t] / params.repeat_penalty if x[t] > 0 else x[t] * params.repeat_penalty
    order = np.argsort(-x, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    values = x[order].astype(np.float64)
    if params.top_p < 1.0:
        probs = np.exp(values - values[0])
        cumulative = np.cumsum(probs / probs.sum())
        keep = next((i + 1 for i, c in enumerate(cumulative) if c >= params.top_p), len(values))
        order, values = order[:keep], values[:keep]
    if params.min_p > 0.0:
        probs = np.exp(values - values[0])  # relative to the best token, whose weight is 1
        keep = probs >= params.min_p
        order, values = order[keep], values[keep]
    weights = np.exp((values - values[0]) / params.temperature)
    return dict(zip(order.tolist(), (weights / weights.sum()).tolist(), strict=True))


# --- greedy -------------------------------------------------------------------------------------------------


def test_greedy_picks_the_argmax():
    for seed in range(5):
        logits = random_logits(1000, seed)
        assert Sampler(SamplingParams(temperature=0)).sample(logits) == int(np.argmax(logits))


def test_temperature_zero_ignores_the_seed():
    logits = random_logits(1000)
    picks = {Sampler(SamplingParams(temperature=0, seed=seed)).sample(logits) for seed in (None, 1, 2, 3)}
    assert picks == {int(np.argmax(logits))}


def test_greedy_uses_the_penalised_logits():
    logits = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=0, repeat_penalty=2.0)
    assert Sampler(params).sample(logits, recent_tokens=[0]) == 1  # 3/2 < 2


# --- the filters --------------------------------------------------------------------------------------------


def test_top_k_never_picks_outside_the_k_best():
    logits = random_logits(5000, scale=0.5)  # a flat distribution, so the filter is what keeps the draws in
    best5 = set(np.argsort(logits)[-5:].tolist())
    picks = draws(SamplingParams(**{**PLAIN, "top_k": 5, "temperature": 3.0}, seed=0), logits, 2000)
    assert set(picks.tolist()) == best5  # only the five best, and all of them


def test_top_k_on_a_large_vocabulary_finds_the_k_best():
    logits = random_logits(262_144)
    for k in (1, 7, 40, 300):
        best = set(np.argsort(logits)[-k:].tolist())
        assert survivors(SamplingParams(**{**PLAIN, "top_k": k}), logits) == best


def test_top_p_keeps_the_smallest_head_reaching_p():
    # Cumulative 0.5, 0.8, 0.95, 1.0: the token that carries the sum over top_p is kept.
    assert survivors(SamplingParams(**{**PLAIN, "top_p": 0.75}), LOGITS) == {0, 1}
    assert survivors(SamplingParams(**{**PLAIN, "top_p": 0.85}), LOGITS) == {0, 1, 2}
    assert survivors(SamplingParams(**{**PLAIN, "top_p": 0.0}), LOGITS) == {0}
    picks = draws(SamplingParams(**{**PLAIN, "top_p": 0.75}, seed=1), LOGITS, 1000)
    assert set(picks.tolist()) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # The best token has p = 0.5: min_p 0.2 keeps p >= 0.1, min_p 0.5 keeps p >= 0.25.
    assert survivors(SamplingParams(**{**PLAIN, "min_p": 0.2}), LOGITS) == {0, 1, 2}
    assert survivors(SamplingParams(**{**PLAIN, "min_p": 0.5}), LOGITS) == {0, 1}
    picks = draws(SamplingParams(**{**PLAIN, "min_p": 0.5}, seed=1), LOGITS, 1000)
    assert set(picks.tolist()) == {0, 1}


def test_filters_judge_probabilities_before_temperature():
    # As in llama.cpp: temperature reweighs the survivors but does not change which tokens survive.
    for temperature in (0.1, 1.0, 10.0):
        params = SamplingParams(**{**PLAIN, "top_p": 0.75, "min_p": 0.05, "temperature": temperature})
        assert survivors(params, LOGITS) == {0, 1}


def test_temperature_flattens_or_sharpens():
    def p_best(temperature):
        ids, probs = Sampler(SamplingParams(**{**PLAIN, "temperature": temperature})).distribution(LOGITS)
        return probs[list(ids).index(0)]

    assert p_best(0.5) > p_best(1.0) > p_best(2.0)
    assert p_best(1.0) == pytest.approx(0.5)


def test_draws_follow_the_probabilities():
    picks = draws(SamplingParams(**PLAIN, seed=7), LOGITS, 20_000)
    frequencies = np.bincount(picks, minlength=4) / len(picks)
    np.testing.assert_allclose(frequencies, PROBS, atol=0.015)


CHAINS = {
    "defaults": SamplingParams(),
    "no-top-k": SamplingParams(top_k=0),
    "wide-nucleus": SamplingParams(top_k=0, min_p=0.0, top_p=0.9),  # most of the vocabulary survives
    "temperature-only": SamplingParams(top_k=0, min_p=0.0, top_p=1.0),
    "top-k-1000-top-p": SamplingParams(top_k=1000, top_p=0.5, min_p=0.0, temperature=1.5),
    "all-and-penalty": SamplingParams(top_k=100, top_p=0.99, min_p=0.01, repeat_penalty=1.3),
}


@pytest.mark.parametrize("params", CHAINS.values(), ids=CHAINS.keys())
@pytest.mark.parametrize("scale", [1.0, 4.0], ids=["flat", "peaked"])
def test_distribution_matches_the_obvious_implementation(params, scale):
    logits = random_logits(262_144, seed=3, scale=scale)
    recent = list(range(0, 262_144, 1000))
    ids, probs = Sampler(params).distribution(logits, recent)
    expected = reference_distribution(logits, params, recent)
    assert set(ids.tolist()) == set(expected)
    np.testing.assert_allclose(probs, [expected[i] for i in ids.tolist()], rtol=1e-5, atol=1e-12)


# --- repetition penalty -------------------------------------------------------------------------------------


def test_repeat_penalty_lowers_a_repeated_tokens_chance():
    logits = np.array([2.0, 2.0, 1.0], dtype=np.float32)
    params = SamplingParams(**PLAIN, repeat_penalty=1.5, seed=3)
    picks = draws(params, logits, 4000, recent=[0])
    counts = np.bincount(picks, minlength=3)
    assert counts[0] < 0.6 * counts[1]


def test_repeat_penalty_follows_llama_cpp():
    # A positive logit is divided, a negative one multiplied (both lower it); each token counts once.
    logits = np.array([2.0, 2.0, -1.0, -1.0], dtype=np.float32)
    params = SamplingParams(**PLAIN, repeat_penalty=2.0)
    ids, probs = Sampler(params).distribution(logits, recent_tokens=[0, 2, 0, 0])
    penalised = np.array([1.0, 2.0, -2.0, -1.0])
    expected = np.exp(penalised) / np.exp(penalised).sum()
    np.testing.assert_allclose(probs[np.argsort(ids)], expected, rtol=1e-6)


def test_repeat_penalty_only_looks_at_the_last_n_tokens():
    logits = np.array([2.0, 2.0], dtype=np.float32)
    params = SamplingParams(**PLAIN, repeat_penalty=2.0, repeat_last_n=3)
    _, probs = Sampler(params).distribution(logits, recent_tokens=[0, 1, 1, 1])
    assert probs[0] == pytest.approx(probs[1] * np.exp(1.0))  # token 0 is older than the window: unpenalised
    off = SamplingParams(**PLAIN, repeat_penalty=2.0, repeat_last_n=0)
    _, probs = Sampler(off).distribution(logits, recent_tokens=[0])
    np.testing.assert_allclose(probs, [0.5, 0.5])


# --- seeds, types and robustness ----------------------------------------------------------------------------


def test_the_same_seed_repeats_a_run_and_different_seeds_differ():
    logits = random_logits(32_000, scale=1.0)
    run = draws(SamplingParams(seed=42, top_k=0, min_p=0.0), logits, 50)
    again = draws(SamplingParams(seed=42, top_k=0, min_p=0.0), logits, 50)
    other = draws(SamplingParams(seed=43, top_k=0, min_p=0.0), logits, 50)
    assert np.array_equal(run, again)
    assert not np.array_equal(run, other)


def test_no_seed_gives_different_runs():
    logits = random_logits(32_000, scale=1.0)
    runs = {tuple(draws(SamplingParams(top_k=0, min_p=0.0), logits, 20).tolist()) for _ in range(3)}
    assert len(runs) > 1


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0), SamplingParams(seed=0)], ids=["greedy", "drawn"]
)
def test_sample_returns_a_python_int_in_range(params):
    for n in (2, 151_936, 262_144):
        token = Sampler(params).sample(random_logits(n))
        assert type(token) is int
        assert 0 <= token < n


def test_callers_logits_are_left_alone():
    logits = random_logits(1000)
    logits[5] = np.nan
    before = logits.copy()
    Sampler(SamplingParams(repeat_penalty=1.5, seed=0)).sample(logits, recent_tokens=list(range(100)))
    np.testing.assert_array_equal(logits, before)


def test_nan_and_masked_tokens_are_never_picked():
    logits = np.full(100, -np.inf, dtype=np.float32)
    logits[[3, 7]] = [1.0, 1.0]
    logits[50] = np.nan
    picks = draws(SamplingParams(**PLAIN, seed=0), logits, 500)
    assert set(picks.tolist()) == {3, 7}
    assert Sampler(SamplingParams(temperature=0)).sample(logits) in (3, 7)


def test_every_token_masked_still_returns_a_token():
    logits = np.full(10, -np.inf, dtype=np.float32)
    assert 0 <= Sampler(SamplingParams(seed=0)).sample(logits) < 10


def test_out_of_range_recent_tokens_are_ignored():
    token = Sampler(SamplingParams(seed=0, repeat_penalty=1.2)).sample(LOGITS, recent_tokens=[-1, 99, 0])
    assert 0 <= token < 4


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"repeat_penalty": 0.0},
    ],
)
def test_nonsense_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_logits_must_be_a_vector():
    with pytest.raises(ValueError):
        Sampler(SamplingParams()).sample(np.zeros((2, 3), dtype=np.float32))
