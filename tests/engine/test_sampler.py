"""The sampler at the edges of what the API allows: extreme penalties and temperatures stay distributions,
and a grammar's mask holds whatever came before it."""

from __future__ import annotations

import torch

from minibatch.engine.core.request import Request
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.runner.sampler import Sampler


class AllowOnly:
    def __init__(self, *tokens: int) -> None:
        self.tokens = tokens

    def fill_mask(self, words):
        words[:] = 0
        for t in self.tokens:
            words[t // 32] |= 1 << (t % 32)


def test_an_overflowing_repetition_penalty_keeps_the_grammar_and_a_real_draw():
    torch.manual_seed(0)
    logits = torch.randn(2, 64).abs() + 1  # positive: dividing by a tiny penalty overflows to inf
    prompt = list(range(64))  # every token seen: every logit penalised
    reqs = [
        Request("g", prompt, SamplingParams(temperature=0.7, seed=1, repetition_penalty=5e-324, grammar=AllowOnly(9))),
        Request("s", prompt, SamplingParams(temperature=0.7, seed=2, repetition_penalty=5e-324)),
    ]
    for _ in range(20):
        got = Sampler()(logits.clone(), reqs)
        assert got[0] == 9 and 0 <= got[1] < 64


def test_a_temperature_too_small_to_divide_by_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(1, 100) * 30
    req = Request("t", [1], SamplingParams(temperature=1e-300, seed=4))
    assert req.params.greedy and Sampler()(logits.clone(), [req]) == [int(logits.argmax())]
    warm = Request("w", [1], SamplingParams(temperature=1e-4, seed=4))
    assert not warm.params.greedy and Sampler()(logits.clone(), [warm]) == [int(logits.argmax())]


def test_penalties_never_bring_back_a_token_the_grammar_forbids():
    logits = torch.zeros(1, 64)
    logits[0, 5] = -50.0  # negative: a repetition penalty below 1 multiplies it toward zero, the top
    req = Request("r", [5], SamplingParams(temperature=0, repetition_penalty=1e-300, grammar=AllowOnly(7, 8)))
    assert Sampler()(logits, [req]) in ([7], [8])


def test_seen_tokens_follow_the_output_as_it_grows_and_rolls_back():
    import random

    from minibatch.engine.runner.sampler import SeenTokens

    rng = random.Random(0)
    prompt = [rng.randrange(50) for _ in range(30)]
    seen, output = SeenTokens(prompt), []
    for _ in range(300):
        if output and rng.random() < 0.3:
            del output[len(output) - rng.randrange(1, min(4, len(output)) + 1) :]  # a verify walk's rollback
        else:
            output.extend(rng.randrange(80) for _ in range(rng.randrange(1, 4)))
        seen.sync(output)
        counts = {t: output.count(t) for t in set(output)}
        assert seen.counts == counts
        assert sorted(seen.seen_ids().tolist()) == sorted(set(prompt) | set(output))
    seen.sync([7, 7, 7])  # another history altogether: counted afresh
    assert seen.counts == {7: 3}


def test_penalties_change_exactly_the_seen_tokens_by_the_formula():
    vocab = 200
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, vocab, generator=g) * 3
    prompt = [1, 5, 9, 5]
    reqs = [
        Request("a", prompt, SamplingParams(temperature=0, repetition_penalty=1.3)),
        Request("b", prompt, SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)),
        Request("c", prompt, SamplingParams(temperature=0)),
    ]
    for r in reqs:
        r.output_token_ids = [9, 12, 12, 150]
    sampler = Sampler()
    got = logits.clone()
    sampler(got, reqs)
    want = logits.double().clone()
    for t in {1, 5, 9, 12, 150}:
        v = want[0, t]
        want[0, t] = v / 1.3 if v > 0 else v * 1.3
    for t, n in {9: 1, 12: 2, 150: 1}.items():
        want[1, t] -= 0.25 * n + 0.5
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_draws_with_bias_and_penalties_follow_the_reference():
    """Through the Sampler: 20,000 seeded draws of one request at positions 0..19,999 (penalties and bias
    applied, then top-k/top-p/min-p) against the float64 reference; chi-square at z = 4.75 (a false failure
    once in a million)."""
    import math

    from minibatch.engine.models.ops import _reference_cut

    vocab = 300
    g = torch.Generator().manual_seed(9)
    row = torch.randn(1, vocab, generator=g) * 2
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        min_p=0.02,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.2,
        logit_bias={3: 5.0, 4: -100.0},
        seed=11,
    )
    req = Request("p", [3, 4, 5], params)
    req.output_token_ids = [5, 6, 6]
    ref = row.double().clone()
    ref[0, 3] += 5.0
    ref[0, 4] -= 100.0
    for t in (3, 4, 5, 6):
        v = ref[0, t]
        ref[0, t] = v / 1.2 if v > 0 else v * 1.2
    ref[0, 5] -= 0.3 + 0.2
    ref[0, 6] -= 0.6 + 0.2
    settings = torch.tensor([[0.9, 0.9, 0.02, 50.0]], dtype=torch.float64)
    cut = _reference_cut(ref.float(), settings, None)
    p = (cut.weights * cut.keep)[0]
    p = p / p.sum()
    n = 20000
    sampler = Sampler(ops=_fast_ops())
    batch = row.expand(n, -1).contiguous()
    draws = torch.tensor(sampler(batch, [req] * n, list(range(n))))
    counts = torch.bincount(draws, minlength=vocab).double()
    assert float(counts[~cut.keep[0]].sum()) == 0.0
    expected = n * p
    big = expected >= 5
    obs, exp = (
        [*counts[big].tolist(), float(counts[~big].sum())],
        [*expected[big].tolist(), float(expected[~big].sum())],
    )
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    df = len([e for e in exp if e > 0]) - 1
    critical = df * (1 - 2 / (9 * df) + 4.75 * math.sqrt(2 / (9 * df))) ** 3
    assert df >= 5 and stat < critical, (stat, df)


def _fast_ops():
    from minibatch.engine.models.ops import CpuOps, TorchOps
    from minibatch.kernels.cpu.extension import load_cpu_extension

    ext = load_cpu_extension()
    return CpuOps(ext) if ext is not None else TorchOps()


def test_a_seeded_request_draws_the_same_alone_in_a_mixed_batch_and_after_a_restart():
    """Counter-based draws: the token at a position depends on the seed and the position only, in one
    sampler or a new one (a restarted daemon), beside 15 greedy and sampled rows, with the kernel or its twin."""
    from minibatch.engine.models.ops import TorchOps

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(16, 49152, generator=g) * 4
    mine = Request("mine", [1, 2, 3], SamplingParams(temperature=0.7, top_p=0.95, seed=1234))
    others = [
        Request(f"o{i}", [i], SamplingParams(temperature=0 if i % 3 == 0 else 1.0, top_k=40 if i % 2 else -1))
        for i in range(15)
    ]
    by_ops = []
    for ops in (_fast_ops(), TorchOps()):
        tokens = []
        for pos in range(6):
            mine.output_token_ids = list(range(pos))
            alone = Sampler(ops=ops)(logits[:1].clone(), [mine])[0]
            mixed = Sampler(ops=ops)(logits.clone(), [mine, *others])[0]
            restarted = Sampler(ops=ops, key=99)(logits[:1].clone(), [mine])[0]
            assert alone == mixed == restarted
            tokens.append(alone)
        assert len(set(tokens)) > 1  # the positions draw differently
        by_ops.append(tokens)
    assert by_ops[0] == by_ops[1]
