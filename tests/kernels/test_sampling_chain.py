"""The chain's kernel (kernels/cpu/csrc/sampling_chain.cpp) against its NumPy twin (engine/runner/chain.py): the same
token and the same Mirostat mu for every row — top-nσ, typical-p, XTC and Mirostat alone and beside top-k,
top-p and min-p, on peaked, flat, tied and masked rows of 49k and 152k tokens, with and without a grammar's
mask, at thousands of Philox positions. The twin's own distributions are held to float64 references of each
sampler's definition in tests/engine/test_samplers.py; equal tokens here carry that over to the kernel."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.models.ops import CpuOps, TorchOps
from minibatch.engine.runner.chain import pack

from .test_sampling import logits_of

CHAT = dict(temperature=0.7, top_p=0.95)
# each chained sampler alone, beside the chat's top-p, and beside top-k, min-p, at other temperatures
SETTINGS = [
    SamplingParams(top_n_sigma=1.0, temperature=1.0),
    SamplingParams(top_n_sigma=1.0, **CHAT),
    SamplingParams(top_n_sigma=2.5, temperature=0.8, top_k=40, top_p=0.9),
    SamplingParams(typical_p=0.9, temperature=1.0),
    SamplingParams(typical_p=0.5, **CHAT),
    SamplingParams(typical_p=0.95, temperature=1.3, min_p=0.05),
    SamplingParams(xtc_probability=1.0, xtc_threshold=0.1, temperature=1.0),
    SamplingParams(xtc_probability=0.5, xtc_threshold=0.1, **CHAT),
    SamplingParams(xtc_probability=0.5, xtc_threshold=0.05, temperature=0.9, top_k=20),
    SamplingParams(mirostat=2, mirostat_tau=5.0, mirostat_eta=0.1, temperature=1.0),
    SamplingParams(mirostat=2, mirostat_tau=3.0, mirostat_eta=0.1, temperature=0.7),
    SamplingParams(top_n_sigma=1.5, typical_p=0.8, xtc_probability=0.3, xtc_threshold=0.2, temperature=1.1, top_p=0.9),
]


def both(ext, x, params, mu, positions, masks=None):
    settings = pack(params, mu)
    streams = torch.tensor([[1234 + i, int(p)] for i, p in enumerate(positions)], dtype=torch.long)
    return CpuOps(ext).sample_chain(x, settings, streams, masks), TorchOps().sample_chain(x, settings, streams, masks)


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_the_kernel_draws_the_twins_token_for_every_setting(any_build, vocab, kind):
    g = torch.Generator().manual_seed(vocab + 7 * len(kind))
    rows = SETTINGS * 3
    x = logits_of(kind, len(rows), vocab, g)
    mu = [None if i < len(SETTINGS) else 6.5 for i in range(len(rows))]  # Mirostat's first draw, and a later one
    got, want = both(any_build, x, rows, mu, range(100, 100 + len(rows)))
    for i, (a, b) in enumerate(zip(got.tolist(), want.tolist())):
        assert a[0] == b[0], f"{kind} {vocab}, row {i} ({rows[i]}): kernel token {a[0]}, twin {b[0]}"
        assert same(a[1], b[1]), f"{kind} {vocab}, row {i}: kernel mu {a[1]}, twin {b[1]}"


def test_many_positions_give_the_twins_draws(any_build):
    """400 draws of one row per setting (the positions move the uniform and XTC's coin): the same token every
    time, so the kernel's distribution is the twin's. The row has a few dozen likely tokens, so that every
    setting keeps a real choice."""
    g = torch.Generator().manual_seed(11)
    row = torch.randn(1, 4096, generator=g) * 1.5
    n = 400
    for p in SETTINGS:
        x = row.expand(n, -1).contiguous()
        got, want = both(any_build, x, [p] * n, [None] * n, range(n))
        assert torch.equal(got[:, 0], want[:, 0]), p
        assert len(set(got[:, 0].tolist())) > 1, p  # a real choice among several tokens


def test_a_grammars_mask_and_a_row_with_nothing_finite(any_build):
    g = torch.Generator().manual_seed(5)
    x = logits_of("peaked", len(SETTINGS), 4096, g)
    masks = torch.zeros(len(SETTINGS), 4096 // 32, dtype=torch.int32)
    masks[:, 3] = 0b1011  # the grammar allows tokens 96, 97 and 99
    got, want = both(any_build, x, SETTINGS, [None] * len(SETTINGS), range(len(SETTINGS)), masks)
    assert torch.equal(got, want) or all(same(a, b) for a, b in zip(got.flatten().tolist(), want.flatten().tolist()))
    assert set(got[:, 0].long().tolist()) <= {96, 97, 99}
    x[:] = float("-inf")  # every token banned: the first (as the fused pass's argmax)
    got, want = both(any_build, x[:2], SETTINGS[:2], [None, 4.0], [0, 1])
    assert got[:, 0].tolist() == want[:, 0].tolist() == [0.0, 0.0]
    assert math.isnan(got[0, 1]) and got[1, 1] == 4.0  # a Mirostat mu passes through a row with no draw


def test_the_sampler_runs_the_kernel_where_it_is_built(any_build):
    """The engine's sampler hands chained rows to its ops: the kernel's tokens through CpuOps, the twin's
    through TorchOps, and they are the same."""
    from minibatch.engine.core.request import Request
    from minibatch.engine.runner.sampler import Sampler

    g = torch.Generator().manual_seed(2)
    x = logits_of("peaked", len(SETTINGS), 49152, g)
    reqs = [Request(f"r{i}", [1, 2, 3], dataclasses.replace(p, seed=40 + i)) for i, p in enumerate(SETTINGS)]
    a = Sampler(CpuOps(any_build))(x.clone(), reqs)
    b = Sampler(TorchOps())(x.clone(), reqs)
    assert a == b


def test_many_candidates_in_groups_of_equal_logits_keep_the_order_of_their_ids(any_build):
    """Thousands of candidates (the kernel's radix order, not std::stable_sort's) in a few groups of equal
    logits, zero written as both +0 and -0: equal logits stay in id order, so every draw is the twin's."""
    g = torch.Generator().manual_seed(3)
    levels = torch.tensor([6.0, 4.0, 0.0, -0.0, -2.0, -5.0, -12.0])
    share = torch.tensor([0.002, 0.058, 0.2, 0.2, 0.24, 0.2, 0.1])  # a small top group: Mirostat keeps a choice
    row = levels[torch.multinomial(share, 8192, replacement=True, generator=g)][None]
    n = 120
    for p in SETTINGS:
        x = row.expand(n, -1).contiguous()
        got, want = both(any_build, x, [p] * n, [None] * n, range(n))
        assert torch.equal(got[:, 0], want[:, 0]), p
        assert len(set(got[:, 0].tolist())) > 1, p


def test_xtc_keeps_the_last_of_equal_least_likely_tokens_over_its_threshold(any_build):
    """Three tokens over XTC's threshold, the two least likely equal: XTC keeps the last of them in the order
    (the higher id), drops the others, and the draws are the twin's."""
    x = torch.full((1, 4096), -5.0)
    x[0, 10], x[0, 20], x[0, 30] = 3.0, 2.0, 2.0  # p = 0.32, 0.12, 0.12; the rest 0.007 each
    n = 200
    p = SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.1)
    got, want = both(any_build, x.expand(n, -1).contiguous(), [p] * n, [None] * n, range(n))
    assert torch.equal(got[:, 0], want[:, 0])
    drawn = set(got[:, 0].long().tolist())
    assert 30 in drawn and not drawn & {10, 20}
