"""The fused sampling kernel (kernels/cpu/csrc/sampling.cpp) against its float64 twin (TorchOps.sample_tokens):
Philox's known answers, the exact set of tokens each setting keeps (ties, -inf, a grammar's single token, on
49k and 152k vocabularies), the same draw for the same uniform, and the distribution of many draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minibatch.engine.models.ops import CpuOps, TorchOps, _reference_cut
from minibatch.engine.runner.philox import philox4x32_10, uniforms

# Random123's tests/kat_vectors, the three philox4x32 10 lines: counter, key -> block.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]

# (temperature, top_p, min_p, top_k): the chat's defaults, Ollama's, each cut alone and together, greedy
SETTINGS = [
    (0.7, 0.95, 0.0, -1),
    (0.8, 0.9, 0.0, 40),
    (1.0, 1.0, 0.0, -1),
    (1.5, 1.0, 0.0, 0),
    (0.7, 1.0, 0.0, 1),
    (0.7, 1.0, 0.0, 7),
    (1.0, 0.5, 0.0, -1),
    (0.3, 0.1, 0.0, -1),
    (1.0, 1.0, 0.05, -1),
    (0.7, 1.0, 0.3, -1),
    (1.2, 0.8, 0.02, 500),
    (0.0, 0.9, 0.1, 40),
    (1e-4, 0.95, 0.0, -1),
    (100.0, 0.95, 0.0, -1),
]


def settings_of(rows: list[tuple]) -> torch.Tensor:
    return torch.tensor([(t, p, m, float(k)) for t, p, m, k in rows], dtype=torch.float64)


def test_philox_known_answers_in_both():
    for counter, key, block in KAT:
        got = philox4x32_10(np.array([counter], dtype=np.uint32), np.array([key], dtype=np.uint32))
        assert tuple(int(v) for v in got[0]) == block


def test_the_kernels_uniforms_are_the_twins(any_build):
    g = torch.Generator().manual_seed(3)
    keys = torch.cat([torch.randint(-(2**63), 2**63 - 1, (500,), generator=g), torch.tensor([0, -1, 2**63 - 1])])
    counters = torch.cat([torch.randint(0, 2**40, (500,), generator=g), torch.tensor([0, 2**32, 2**63 - 1])])
    got = any_build.philox_uniforms(keys, counters)
    assert got.tolist() == uniforms(keys.numpy(), counters.numpy()).tolist()
    assert 0.0 <= float(got.min()) and float(got.max()) < 1.0
    assert len(set(got.tolist())) == len(got)  # distinct keys or counters: distinct draws


def logits_of(kind: str, rows: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, vocab, generator=g) * 3
    if kind == "peaked":  # a real model's shape: a few tokens far above a long tail
        x[:, :: max(1, vocab // 50)] += 12
    elif kind == "ties":  # heavy ties: a handful of distinct values
        x = (x / 2).round()
    elif kind == "masked":  # -inf entries (a ban), and a row with one finite value
        x[:, 1::3] = float("-inf")
        x[0, :] = float("-inf")
        x[0, vocab // 12 * 6] = 0.5  # even and not 1 mod 3
    return x


@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_each_setting_keeps_exactly_the_references_tokens(any_build, vocab, kind):
    """What is kept is a prefix of the order (logit, then id), known by its length and its last token."""
    g = torch.Generator().manual_seed(vocab + len(kind))
    rows = SETTINGS
    x = logits_of(kind, len(rows), vocab, g)
    streams = torch.zeros(len(rows), 2, dtype=torch.long)
    got = CpuOps(any_build).sample_cuts(x, settings_of(rows), streams, None)
    want = TorchOps().sample_cuts(x, settings_of(rows), streams, None)
    for setting, a, b in zip(rows, got.tolist(), want.tolist()):
        assert a == b, f"{kind}, {setting}: kernel keeps {a[0]} tokens to {a[1]}, the reference {b[0]} to {b[1]}"
    cut = _reference_cut(x, settings_of(rows), None)
    prefix = cut.keep.gather(1, cut.order)  # kept tokens are a prefix of the order: no gap
    assert bool((prefix[:, 1:] <= prefix[:, :-1]).all())


def test_a_tie_group_is_split_by_id_and_top_k_keeps_every_tie(any_build):
    """Four tokens of equal logit, the rest banned: top-p 0.5 keeps 3 and 9 (the mass before 17 is exactly half:
    dropped), top-k 2 keeps all four, min-p keeps all four."""
    x = torch.full((3, 64), float("-inf"))
    x[:, [40, 3, 17, 9]] = 5.0
    settings = settings_of([(1.0, 0.5, 0.0, -1), (1.0, 1.0, 0.0, 2), (0.5, 1.0, 0.9, -1)])
    streams = torch.zeros(3, 2, dtype=torch.long)
    for ops in (CpuOps(any_build), TorchOps()):
        assert ops.sample_cuts(x, settings, streams, None).tolist() == [[2, 9], [4, 40], [4, 40]]


def test_a_grammars_single_token_is_the_only_draw(any_build):
    vocab = 49152
    x = torch.randn(len(SETTINGS), vocab) * 5
    masks = np.zeros((len(SETTINGS), (vocab + 31) // 32), dtype=np.int32)
    masks[:, 12345 // 32] = 1 << (12345 % 32)
    streams = torch.stack([torch.arange(len(SETTINGS)), torch.arange(len(SETTINGS))], dim=1)
    for ops in (CpuOps(any_build), TorchOps()):
        got = ops.sample_tokens(x, settings_of(SETTINGS), streams, torch.from_numpy(masks))
        assert got.tolist() == [12345] * len(SETTINGS)
        cuts = ops.sample_cuts(x, settings_of(SETTINGS), streams, torch.from_numpy(masks))
        assert cuts.tolist() == [[1, 12345]] * len(SETTINGS)


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_the_same_uniform_draws_the_same_token(any_build, kind):
    """A draw lands elsewhere only within float rounding of a boundary of the distribution function, which
    these uniforms do not hit; masked tokens are never drawn."""
    g = torch.Generator().manual_seed(11)
    rows = SETTINGS * 3
    x = logits_of(kind, len(rows), 4099, g)  # an odd width: the vector loops' tails
    settings = settings_of(rows)
    masks = np.full((len(rows), (4099 + 31) // 32), -1, dtype=np.int32)
    masks[::2, 5:] = 0x55555555  # even rows: a grammar allows the even tokens from 160 on, all below
    masks = torch.from_numpy(masks)
    for step in range(8):
        streams = torch.stack([torch.arange(len(rows)) * 7919, torch.full((len(rows),), step)], dim=1)
        got = CpuOps(any_build).sample_tokens(x, settings, streams, masks)
        assert got.tolist() == TorchOps().sample_tokens(x, settings, streams, masks).tolist()
        assert all(t < 160 or t % 2 == 0 for t in got[::2].tolist())
        if kind == "masked":
            assert got[0] == 4099 // 12 * 6 and all(t % 3 != 1 for t in got.tolist())


def chi2_critical(df: int, z: float) -> float:
    """The chi-square quantile at standard-normal quantile z (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


DRAWS = 20000


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s[0] >= 0.3 and s[0] <= 1.5])
def test_draws_follow_the_softmax_of_the_kept_logits(setting):
    """20,000 draws (one row, counters 0..19,999) against the reference distribution, softmax over the kept
    tokens in float64: chi-square over cells expecting >= 5 (the rest pooled), failing past z = 4.75 (a
    false failure once in a million per setting); a token the rule drops is never drawn."""
    g = torch.Generator().manual_seed(5)
    row = torch.randn(1, 1000, generator=g) * 2
    row[0, ::10] += 4
    row[0, 7:12] = row[0, 7]  # a tie group
    settings = settings_of([setting])
    cut = _reference_cut(row, settings, None)
    p = (cut.weights * cut.keep)[0]
    p = p / p.sum()
    ext_ops = CpuOps(__import__("minibatch.kernels.cpu.extension", fromlist=["x"]).load_cpu_extension())
    streams = torch.stack([torch.full((DRAWS,), 424242), torch.arange(DRAWS)], dim=1)
    draws = ext_ops.sample_tokens(
        row.expand(DRAWS, -1).contiguous(), settings.expand(DRAWS, -1).contiguous(), streams, None
    )
    counts = torch.bincount(draws, minlength=1000).double()
    assert float(counts[~cut.keep[0]].sum()) == 0.0
    expected = DRAWS * p
    big = expected >= 5
    cells_o = [*counts[big].tolist(), float(counts[~big].sum())]
    cells_e = [*expected[big].tolist(), float(expected[~big].sum())]
    if cells_e[-1] < 5:  # too few to stand alone: pooled with the smallest cell
        small = min(range(len(cells_e) - 1), key=lambda i: cells_e[i])
        cells_o[small] += cells_o.pop()
        cells_e[small] += cells_e.pop()
    if len(cells_e) < 2:
        assert cells_o == [DRAWS]
        return
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    df = len(cells_e) - 1
    assert stat < chi2_critical(df, 4.75), (setting, stat, df)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_the_gpu_sampler_on_the_device_draws_what_the_twin_draws_on_the_cpu(vocab, kind):
    """The Triton sampler compiled (kernels/gpu/sampling.py; tests/kernels/test_triton_sampling.py runs it in the
    interpreter): its tokens on the GPU are the float64 twin's on the CPU for the same uniform."""
    from minibatch.engine.models.ops import TritonOps

    g = torch.Generator().manual_seed(vocab + 7 * len(kind))
    rows = SETTINGS
    x = logits_of(kind, len(rows), vocab, g)
    for step in range(4):
        streams = torch.stack([torch.arange(len(rows)) * 31, torch.full((len(rows),), step)], dim=1)
        got = TritonOps.sample_tokens(x.cuda(), settings_of(rows).cuda(), streams.cuda(), None)
        assert got.device.type == "cuda"
        assert got.cpu().tolist() == TorchOps().sample_tokens(x, settings_of(rows), streams, None).tolist()
