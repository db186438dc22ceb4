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
