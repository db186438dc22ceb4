"""The samplers beyond the fused pass (top-nσ, typical-p, XTC, Mirostat 2.0) and DRY, each against a float64
reference of its definition written here from llama.cpp's description, in plain loops.

Distributions: 4,000 seeded draws of one request at positions 0..3,999 through the Sampler, chi-square over
cells expecting >= 5 (the rest pooled), failing past z = 4.75 (a false failure once in a million per case for
a fresh key; the draws here are fixed by their seed, so the test is deterministic); a token the reference
drops is never drawn.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minibatch.engine.core.request import Request
from minibatch.engine.core.sampling_params import InvalidParameterError, SamplingParams
from minibatch.engine.runner import chain
from minibatch.engine.runner.dry import breaker_mask, dry_penalties
from minibatch.engine.runner.sampler import Sampler

VOCAB = 400
DRAWS = 4000


def chi2_critical(df: int, z: float) -> float:
    """The chi-square quantile at standard-normal quantile z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def row_logits(seed: int = 3) -> np.ndarray:
    """A trained row's shape: a few likely tokens over a long tail, with a tie."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1.5, VOCAB).astype(np.float32).astype(np.float64)
    x[:12] += np.linspace(6.0, 2.0, 12)
    x[20:23] = x[5]  # ties with a likely token
    return x


def reference(x: np.ndarray, p: SamplingParams, xtc_on: bool = True) -> np.ndarray:
    """The chain's distribution for logits `x`, by its definition (engine/runner/chain.py's docstring)."""
    m = x.max()
    z = (x - m) / p.temperature
    order = [i for i in sorted(range(len(x)), key=lambda i: (-x[i], i)) if x[i] >= m - chain.TAIL * p.temperature]
    keep = dict.fromkeys(order, True)
    w = {i: math.exp(z[i]) for i in order}

    def probs():
        total = sum(w[i] for i in order if keep[i])
        return {i: (w[i] / total if keep[i] else 0.0) for i in order}

    if p.top_n_sigma > 0:
        sigma = float(np.std(x[np.isfinite(x)]))
        for i in order:
            keep[i] &= x[i] >= m - p.top_n_sigma * sigma
    if 0 < p.top_k < len(order):
        kth = x[order[p.top_k - 1]]
        for i in order:
            keep[i] &= x[i] >= kth
    if p.typical_p < 1:
        q = probs()
        entropy = -sum(v * math.log(v) for v in q.values() if v > 0)
        kept = [i for i in order if keep[i]]
        by_distance = sorted(kept, key=lambda i: (abs(-math.log(q[i]) - entropy), order.index(i)))
        mass = 0.0
        for i in by_distance:
            keep[i] = mass < p.typical_p
            mass += q[i]
    if p.top_p < 1:
        q, mass = probs(), 0.0
        for i in order:
            if keep[i]:
                keep[i] = mass < p.top_p
                mass += q[i]
    if p.min_p > 0:
        for i in order:
            keep[i] &= z[i] >= math.log(p.min_p)
    if xtc_on and p.xtc_probability > 0 and p.xtc_threshold <= 0.5:
        q = probs()
        over = [i for i in order if keep[i] and q[i] >= p.xtc_threshold]
        if len(over) >= 2:
            for i in over[:-1]:
                keep[i] = False
    out = np.zeros(len(x))
    for i, v in probs().items():
        out[i] = v
    return out


def draws(x: np.ndarray, params: SamplingParams, n: int = DRAWS) -> np.ndarray:
    req = Request("r", [1, 2, 3], params)
    rows = torch.from_numpy(x).float().expand(n, -1).contiguous()
    return np.asarray(Sampler(key=7)(rows, [req] * n, list(range(n))))


def assert_follows(got: np.ndarray, p: np.ndarray) -> None:
    counts = np.bincount(got, minlength=len(p)).astype(np.float64)
    assert counts[p == 0].sum() == 0, np.flatnonzero((p == 0) & (counts > 0))[:10]
    expected = len(got) * p
    big = expected >= 5
    cells_o = [*counts[big], counts[~big].sum()]
    cells_e = [*expected[big], expected[~big].sum()]
    if cells_e[-1] < 5:
        small = min(range(len(cells_e) - 1), key=lambda i: cells_e[i])
        cells_o[small] += cells_o.pop()
        cells_e[small] += cells_e.pop()
    if len(cells_e) < 2:
        assert cells_o == [len(got)]
        return
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    df = len(cells_e) - 1
    assert stat < chi2_critical(df, 4.75), (stat, df)


CASES = {
    "typical": dict(temperature=1.0, typical_p=0.6),
    "typical-hot": dict(temperature=1.6, typical_p=0.3),
    "top-n-sigma": dict(temperature=1.0, top_n_sigma=1.0),
    "top-n-sigma-wide": dict(temperature=0.7, top_n_sigma=2.5),
    "xtc-always": dict(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.05),
    # with top-p and no typical: the chain sorts only the tokens near the top when they hold top-p's mass
    "top-p-sigma": dict(temperature=1.0, top_p=0.9, top_n_sigma=2.0),
    "top-p-k-xtc": dict(temperature=1.2, top_p=0.95, top_k=30, xtc_probability=1.0, xtc_threshold=0.1),
    "all": dict(
        temperature=1.2, top_k=60, top_n_sigma=3.0, typical_p=0.95, top_p=0.97, min_p=0.01, xtc_probability=1.0
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_sampler_draws_from_its_reference_distribution(case):
    x = row_logits()
    params = SamplingParams(**CASES[case], seed=11)
    assert params.needs_chain
    p = reference(x, params)
    assert 1 < (p > 0).sum() < VOCAB  # the case keeps a real choice and drops something
    assert_follows(draws(x, params), p)


def test_top_p_sorts_every_candidate_when_the_tokens_near_the_top_cannot_decide():
    """One token far ahead of 399 just past the narrow window (8.5 nats down): they hold 7.5% of the mass,
    so top-p 0.97 reaches into them and the chain sorts them all, as the reference does."""
    x = np.full(VOCAB, -8.5)
    x[17] = 0.0
    x[200:220] -= np.linspace(0.0, 1.0, 20)  # an order among the rest
    x = x.astype(np.float32).astype(np.float64)
    params = SamplingParams(temperature=1.0, top_p=0.97, top_n_sigma=50.0, seed=3)
    cand = np.flatnonzero(x >= x.max() - chain.TAIL)
    assert chain._narrowed(x, cand, x.max(), params, float(x.std()))[1] is None  # the fallback is taken
    p = reference(x, params)
    assert 1 < (p > 0).sum() < VOCAB
    assert_follows(draws(x, params), p)


def test_xtc_excludes_the_top_choices_as_often_as_its_probability_says():
    """Half the draws see XTC's cut and half not: the mixture of the two reference distributions."""
    x = row_logits(5)
    params = SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.08, seed=4)
    cut, plain = reference(x, params), reference(x, params, xtc_on=False)
    assert not np.allclose(cut, plain)
    assert_follows(draws(x, params), 0.5 * cut + 0.5 * plain)


def test_mirostat_tracks_its_target_surprise():
    """Step by step on one row: each token is inside the reference's truncation at the current mu, mu moves
    exactly by eta x (tau - the surprise observed in the truncated distribution), and the observed surprise
    averages near tau (within 0.4 bits over the last 300 of 600 steps)."""
    x = (row_logits(8) * 0.6).astype(np.float32).astype(np.float64)  # flat enough for the surprise to reach tau
    tau, eta = 4.0, 0.1
    params = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=tau, mirostat_eta=eta, seed=2)
    req = Request("m", [1], params)
    sampler = Sampler(key=1)
    row = torch.from_numpy(x).float()[None]
    mu, observed = 2 * tau, []
    z = x - x.max()
    w = np.where(x >= x.max() - chain.TAIL, np.exp(z), 0.0)  # the chain's candidates: within TAIL nats of the top
    p_all = w / w.sum()
    for step in range(600):
        token = sampler(row.clone(), [req], [step])[0]
        kept = (p_all > 0) & ((-np.log2(np.maximum(p_all, 1e-300)) <= mu) | (np.arange(VOCAB) == x.argmax()))
        assert kept[token], (step, token)
        s = -math.log2(p_all[token] / p_all[kept].sum())
        mu -= eta * (s - tau)
        assert sampler.mu["m"] == pytest.approx(mu, rel=1e-9, abs=1e-9)
        observed.append(s)
    assert abs(np.mean(observed[300:]) - tau) < 0.4, np.mean(observed[300:])
    sampler.forget("m")
    assert "m" not in sampler.mu


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    ids = np.array([5, 6, 7, 8, 9, 1, 2, 5, 6, 7])  # "5 6 7" again: 8 would make the repeat four long
    params = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    tokens, penalty = dry_penalties(ids, None, params)
    assert tokens.tolist() == [8] and penalty.tolist() == pytest.approx([0.8 * 1.75 ** (3 - 2)])
    # a longer earlier match wins over a shorter one for the same token
    ids2 = np.array([3, 5, 6, 7, 8, 0, 6, 7, 8, 4, 3, 5, 6, 7])
    tokens, penalty = dry_penalties(ids2, None, params)
    assert dict(zip(tokens.tolist(), penalty.tolist())) == pytest.approx({8: 0.8 * 1.75 ** (4 - 2)})
    # within the allowed length: nothing
    assert len(dry_penalties(ids, None, SamplingParams(dry_multiplier=0.8, dry_allowed_length=4))[0]) == 0
    # a breaker inside the repeat cuts it to what follows the breaker (6 is a breaker: "7" alone, too short)
    breakers = breaker_mask(["a", "b", "c", "d", "e", "f", "\n", "g", "h", "i"], ["\n"])
    assert len(dry_penalties(ids, breakers, params)[0]) == 0
    # only the last penalty_last_n tokens are searched: the earlier "5 6 7" is out of sight
    assert len(dry_penalties(ids, None, SamplingParams(dry_multiplier=0.8, dry_penalty_last_n=5))[0]) == 0


def test_dry_changes_a_greedy_choice_through_the_sampler_and_breakers_come_from_token_texts():
    x = torch.zeros(1, 16)
    x[0, 8], x[0, 3] = 2.0, 1.5  # 8 would be taken, but it extends the repeat "5 6 7" -> "5 6 7 8"
    prompt = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    plain = Request("a", prompt, SamplingParams(temperature=0))
    dry = Request("b", prompt, SamplingParams(temperature=0, dry_multiplier=0.8))
    assert Sampler()(x.expand(2, -1).clone(), [plain, dry]) == [8, 3]
    texts = [f"t{i}" for i in range(16)]
    texts[6] = ":"  # one of the default breakers
    assert Sampler(token_texts=lambda n: texts[:n])(x.clone(), [dry]) == [8]


def test_greedy_and_default_requests_are_untouched():
    """Temperature 0 takes the argmax whatever the chain's settings; a request that sets none of them never
    reaches the chain (the fused pass alone: they cost nothing when off)."""
    x = torch.from_numpy(row_logits()).float()[None]
    for extra in CASES.values():
        params = SamplingParams(**{**extra, "temperature": 0.0}, mirostat=2)
        assert not params.needs_chain
        assert Sampler()(x.clone(), [Request("g", [1], params)]) == [int(x.argmax())]
    assert not SamplingParams(temperature=0.8).needs_chain and not SamplingParams().needs_dry
    assert not SamplingParams(xtc_probability=1.0, xtc_threshold=0.6).needs_chain  # above 0.5: off


def test_a_chained_row_draws_the_same_alone_and_beside_others():
    x = torch.from_numpy(np.stack([row_logits(s) for s in range(4)])).float()
    reqs = [
        Request("a", [1], SamplingParams(temperature=0.9, seed=5, typical_p=0.7)),
        Request("b", [1], SamplingParams(temperature=0.9, seed=6)),
        Request("c", [1], SamplingParams(temperature=0.9, seed=7, top_n_sigma=1.5, xtc_probability=0.5)),
        Request("d", [1], SamplingParams(temperature=0)),
    ]
    together = Sampler(key=3)(x.clone(), reqs, [4, 4, 4, 4])
    alone = [Sampler(key=3)(x[i : i + 1].clone(), [r], [4])[0] for i, r in enumerate(reqs)]
    assert together == alone


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("typical_p", 0.0, "must be in (0, 1]"),
        ("top_n_sigma", -2.0, "must be in [-1, 100]"),
        ("xtc_probability", 1.5, "must be in [0, 1]"),
        ("dry_base", 0.5, "must be in [1, 100]"),
        ("dry_allowed_length", 0, "must be in [1, "),
        ("dry_sequence_breakers", ["x" * 41], "at most 40 characters"),
        ("mirostat", 1, "only 0 (off) and 2 (Mirostat 2.0)"),
        ("mirostat_eta", 2.0, "must be in [0, 1]"),
    ],
)
def test_settings_out_of_range_name_their_field(field, value, message):
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and message in str(err.value)
