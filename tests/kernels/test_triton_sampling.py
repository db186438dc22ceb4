"""The Triton sampler (kernels/gpu/sampling.py; in the interpreter on CPU, compiled on a GPU) against the float64
twin (TorchOps.sample_tokens / sample_cuts) and the CPU's fused pass: the exact set of tokens each setting
keeps on 49k and 152k rows (peaked, flat, tied, masked), a grammar's mask, ties split by id, the rows that
take the argmax, and the same seeded tokens as the CPU kernels on the same logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from minibatch.engine.models.ops import CpuOps, TorchOps, TritonOps  # noqa: E402
from minibatch.kernels.gpu.sampling import PATHS, sample_rows  # noqa: E402

from .conftest import DEVICE, skip_if_gpu_unusable  # noqa: E402
from .test_sampling import SETTINGS, logits_of, settings_of  # noqa: E402

skip_if_gpu_unusable()


def triton_sample(x, settings, streams, masks=None):
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    tokens, cuts = sample_rows(to(x), to(settings), to(streams), to(masks))
    return tokens.cpu(), cuts.cpu()


@pytest.mark.parametrize("vocab", [49152, 151936])
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
def test_each_setting_keeps_and_draws_what_the_twin_does(vocab, kind):
    """What is kept (a prefix of the order: its length and its last token) and the token drawn, on every
    setting: the chat's defaults, Ollama's, each cut alone and together, greedy, extreme temperatures."""
    g = torch.Generator().manual_seed(vocab + 3 * len(kind))
    x = logits_of(kind, len(SETTINGS), vocab, g)
    settings = settings_of(SETTINGS)
    for step in range(2 if vocab < 100_000 else 1):  # (a second draw on the wide rows: minutes in the interpreter)
        streams = torch.stack([torch.arange(len(SETTINGS)) * 31 + vocab, torch.full((len(SETTINGS),), step)], dim=1)
        tokens, cuts = triton_sample(x, settings, streams)
        want = TorchOps().sample_cuts(x, settings, streams, None)
        for setting, a, b in zip(SETTINGS, cuts[:, :2].tolist(), want.tolist()):
            assert a == b, f"{kind}, {setting}: the kernel keeps {a[0]} tokens to {a[1]}, the twin {b[0]} to {b[1]}"
        assert tokens.tolist() == TorchOps().sample_tokens(x, settings, streams, None).tolist()
        # how each row was decided (both ways are held to the twin above)
        path = dict(zip(SETTINGS, (PATHS[p] for p in cuts[:, 2].tolist())))
        assert path[(0.0, 0.9, 0.1, 40)] == "argmax" and path[(1.0, 1.0, 0.0, -1)] == "every token"
        if kind == "peaked":  # a trained model's rows: the chat's defaults and Ollama's decided by candidates
            assert path[(0.7, 0.95, 0.0, -1)] == path[(0.8, 0.9, 0.0, 40)] == "candidates", path
        if kind == "ties":  # tie groups larger than the candidates hold: searched
            assert path[(0.7, 0.95, 0.0, -1)] == "search", path


def test_the_same_seeded_tokens_as_the_cpus_fused_pass():
    """A seeded request draws the same tokens on either device when the logits agree: the Triton sampler's
    tokens are the C++ kernels' for the same (key, position), over many positions and a grammar's mask."""
    from minibatch.kernels.cpu.extension import load_cpu_extension

    ext = load_cpu_extension()
    if ext is None:
        pytest.skip("the CPU kernels are not built here")
    g = torch.Generator().manual_seed(5)
    rows = SETTINGS
    x = logits_of("peaked", len(rows), 49152, g)
    masks = np.full((len(rows), 49152 // 32), -1, dtype=np.int32)
    masks[::3, 100:] = 0x33333333  # a grammar's mask on every third row
    masks = torch.from_numpy(masks)
    seeds = torch.tensor([1234, -7, 2**62 + 11] * (len(rows) // 3 + 1))[: len(rows)]
    for position in (0, 17, 2**33 + 5):
        streams = torch.stack([seeds, torch.full((len(rows),), position)], dim=1)
        tokens, _ = triton_sample(x, settings_of(rows), streams, masks)
        assert tokens.tolist() == CpuOps(ext).sample_tokens(x, settings_of(rows), streams, masks).tolist()


def test_a_grammars_mask_is_obeyed_and_a_single_token_is_the_only_draw():
    vocab = 49152
    g = torch.Generator().manual_seed(9)
    x = torch.randn(len(SETTINGS), vocab, generator=g) * 5
    masks = np.zeros((len(SETTINGS), (vocab + 31) // 32), dtype=np.int32)
    masks[:, 12345 // 32] = 1 << (12345 % 32)
    streams = torch.stack([torch.arange(len(SETTINGS)), torch.arange(len(SETTINGS))], dim=1)
    tokens, cuts = triton_sample(x, settings_of(SETTINGS), streams, torch.from_numpy(masks))
    assert tokens.tolist() == [12345] * len(SETTINGS)
    assert cuts[:, :2].tolist() == [[1, 12345]] * len(SETTINGS)
    masks[:] = 0x55555555  # the even tokens
    masks = torch.from_numpy(masks)
    for step in range(3):
        streams[:, 1] = step
        tokens, cuts = triton_sample(x, settings_of(SETTINGS), streams, masks)
        assert all(t % 2 == 0 for t in tokens.tolist())
        assert tokens.tolist() == TorchOps().sample_tokens(x, settings_of(SETTINGS), streams, masks).tolist()
        assert cuts[:, :2].tolist() == TorchOps().sample_cuts(x, settings_of(SETTINGS), streams, masks).tolist()


def test_a_tie_group_is_split_by_id_and_top_k_keeps_every_tie():
    """Four tokens of equal logit, the rest banned: top-p 0.5 keeps 3 and 9 (the mass before 17 is exactly half:
    dropped), top-k 2 keeps all four, min-p keeps all four."""
    x = torch.full((3, 64), float("-inf"))
    x[:, [40, 3, 17, 9]] = 5.0
    settings = settings_of([(1.0, 0.5, 0.0, -1), (1.0, 1.0, 0.0, 2), (0.5, 1.0, 0.9, -1)])
    _, cuts = triton_sample(x, settings, torch.zeros(3, 2, dtype=torch.long))
    assert cuts[:, :2].tolist() == [[2, 9], [4, 40], [4, 40]]


def test_rows_that_take_the_argmax():
    """Temperature 0, a row with a NaN (its first NaN, as torch.argmax), a row with no finite logit (token 0),
    -0.0 tied with +0.0 (the lower id first), and a row whose largest logits tie."""
    x = torch.randn(5, 3000, generator=torch.Generator().manual_seed(2))
    x[1, [700, 2000]] = float("nan")
    x[2] = float("-inf")
    x[3] = -1.0
    x[3, 50], x[3, 40] = 0.0, -0.0
    x[4, [9, 2999]] = 100.0
    settings = settings_of(
        [(0.0, 0.9, 0.0, 40), (0.8, 0.9, 0.0, 40), (0.8, 1.0, 0.0, -1), (0.0, 1.0, 0.0, -1)] + [(0.0, 1.0, 0.0, -1)]
    )
    tokens, cuts = triton_sample(x, settings, torch.zeros(5, 2, dtype=torch.long))
    assert tokens.tolist() == [int(x[0].argmax()), 700, 0, 40, 9]
    assert tokens.tolist() == TorchOps().sample_tokens(x, settings, torch.zeros(5, 2, dtype=torch.long), None).tolist()
    assert cuts[:, 0].tolist() == [1] * 5


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 100)
    with pytest.raises(ValueError, match="settings"):
        sample_rows(x, torch.zeros(3, 4, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.long), None)
    with pytest.raises(ValueError, match="masks"):
        sample_rows(
            x,
            settings_of([(1.0, 1.0, 0.0, -1)] * 2),
            torch.zeros(2, 2, dtype=torch.long),
            torch.zeros(2, 3, dtype=torch.int32),
        )


def test_bias_and_penalties_edit_the_logits_as_the_twin_does():
    """LogitEdits (bias, repetition, presence and frequency, DRY; a token in several phases; an overflowing
    penalty) applied by the Triton kernels equal TorchOps.edit_logits' result bit for bit."""
    from minibatch.engine.models.ops import LogitEdits

    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 3000, generator=g) * 4
    x[2, 7] = -3e38  # a repetition penalty of 2 overflows it: kept finite
    phases = {
        0: ([0, 0, 3], [5, 7, 9], [2.5, -100.0, 1.0]),
        1: ([0, 0, 1, 2, 2], [7, 11, 11, 7, 8], [1.1, 1.1, 1.3, 2.0, 2.0]),
        2: ([0, 1, 3], [7, 11, 9], [-0.6, -1.5, -0.2]),
        3: ([1, 3], [11, 2999], [-7.0, -3.25]),
    }
    rows = torch.tensor([r for p in phases.values() for r in p[0]])
    tokens = torch.tensor([t for p in phases.values() for t in p[1]])
    values = torch.tensor([v for p in phases.values() for v in p[2]], dtype=torch.float32)
    edits = LogitEdits(rows, tokens, values, tuple(len(p[0]) for p in phases.values()))
    want = x.clone()
    TorchOps.edit_logits(want, edits)
    got = x.clone().to(DEVICE)
    TritonOps.edit_logits(got, edits)
    assert torch.equal(got.cpu(), want)
    assert want[2, 7] == -torch.finfo(torch.float32).max and not torch.equal(want, x)
