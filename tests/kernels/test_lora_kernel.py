"""The LoRA update kernel (lora.cpp) on every build against its PyTorch twin (TorchOps.lora_update): rows of
several adapters, of none, of two at once, ranks padded and absent; each row's result the same bit for bit
alone as in any batch; bad shapes refused."""

from __future__ import annotations

import pytest
import torch

from minibatch.engine.models.ops import CpuOps, TorchOps

IN, OUT, R = 96, 1100, 8  # OUT past two of the kernel's 512-output chunks, and not a multiple of 8


def adapters(seed: int = 0):
    """Three adapters: rank 8, rank 3 (zeros past it) and one that leaves this projection alone (rank 0)."""
    g = torch.Generator().manual_seed(seed)
    a, bt = torch.randn(3, R, IN, generator=g) / IN**0.5, torch.randn(3, R, OUT, generator=g) * 0.05
    ranks = torch.tensor([8, 3, 0], dtype=torch.int32)
    for s, r in enumerate(ranks.tolist()):
        a[s, r:], bt[s, r:] = 0, 0
    return a.half().contiguous(), bt.half().contiguous(), ranks  # (kept in fp16: lora/rows.py)


def batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)
    kinds = [[0, -1], [1, -1], [-1, -1], [0, 1], [2, -1], [1, 0]]  # (two at once: both orders)
    slots = torch.tensor([kinds[i % len(kinds)] for i in range(n)], dtype=torch.int32)
    scales = torch.tensor([[1.0 + 0.25 * (i % 3), -0.5] for i in range(n)], dtype=torch.float32)
    return x, y, slots, scales


@pytest.mark.parametrize("n", [1, 6, 40])  # one row; a decode step; a prefill chunk (torch's threads)
def test_the_kernel_matches_its_twin_on_every_build(any_build, n):
    a, bt, ranks = adapters()
    x, y, slots, scales = batch(n)
    got = CpuOps(any_build).lora_update(y.clone(), x, a, bt, ranks, slots, scales)
    want = TorchOps().lora_update(y, x, a, bt, ranks, slots, scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    untouched = ((slots == -1) | (slots == 2)).all(dim=1)  # no adapter, or one of rank 0 here
    assert untouched.any() == (n > 2) and torch.equal(got[untouched], y[untouched])
    assert not torch.allclose(got[~untouched], y[~untouched])  # (the others did change)


def test_a_row_gets_the_same_bits_alone_as_in_any_batch(any_build):
    a, bt, ranks = adapters(3)
    x, y, slots, scales = batch(40, seed=4)
    ops = CpuOps(any_build)
    together = ops.lora_update(y.clone(), x, a, bt, ranks, slots, scales)
    for i in (0, 3, 17, 39):
        alone = ops.lora_update(y[i : i + 1].clone(), x[i : i + 1], a, bt, ranks, slots[i : i + 1], scales[i : i + 1])
        assert torch.equal(alone[0], together[i]), i
    some = torch.tensor([5, 1, 30, 2])  # the same rows beside others, in another order
    mixed = ops.lora_update(y[some].clone(), x[some], a, bt, ranks, slots[some], scales[some])
    assert torch.equal(mixed, together[some])


def test_bad_shapes_are_refused(any_build):
    a, bt, ranks = adapters()
    x, y, slots, scales = batch(4)
    update = any_build.lora_update
    with pytest.raises(RuntimeError, match="slots must be -1 or an adapter's index"):
        update(y.clone(), x, a, bt, ranks, torch.full_like(slots, 3), scales)
    with pytest.raises(RuntimeError, match="bt must be contiguous fp16"):
        update(y.clone(), x, a, bt[:, :, :10].contiguous(), ranks, slots, scales)
    with pytest.raises(RuntimeError, match="ranks must be in"):
        update(y.clone(), x, a, bt, torch.tensor([9, 0, 0], dtype=torch.int32), slots, scales)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        update(y.clone(), x[:3], a, bt, ranks, slots, scales)


def test_the_triton_kernel_matches_its_twin_and_keeps_rows_apart():
    """In the interpreter here (fp32 rows, fp16 adapters; compiled for sm_80/sm_90 by test_gpu_compile.py)."""
    from minibatch.kernels.gpu.lora import lora_update

    a, bt, ranks = adapters(5)
    x, y, slots, scales = batch(9, seed=6)
    got = lora_update(y.clone(), x, a, bt, ranks, slots, scales)
    torch.testing.assert_close(got, TorchOps().lora_update(y, x, a, bt, ranks, slots, scales), rtol=1e-5, atol=1e-5)
    untouched = ((slots == -1) | (slots == 2)).all(dim=1)
    assert torch.equal(got[untouched], y[untouched])
    some = torch.tensor([4, 0, 7])
    assert torch.equal(lora_update(y[some].clone(), x[some], a, bt, ranks, slots[some], scales[some]), got[some])
