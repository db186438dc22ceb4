"""The kernels' own thread pool (csrc/thread_pool.h): the same results however its loops are shared out.

A loop of a few rows runs on the pool; these drive it the ways a process can: several Python threads
calling kernels at once (one runs on the pool, the others serially), torch's thread count changed
between calls (the pool follows it), and a forked child (it has none of the parent's workers).
"""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from minibatch.kernels.cpu.extension import load_cpu_extension
from minibatch.kernels.cpu.quant import quant_linear, quant_linear_q8, quantize_activations
from minibatch.kernels.quant_types import QUANT_TYPES

from .quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(load_cpu_extension() is None, reason="the C++ extension cannot be built here")

Q4_1 = QUANT_TYPES["Q4_1"]


def operands(rows: int = 4):
    torch.manual_seed(rows)
    return torch.randn(rows, 576), random_blocks(Q4_1, 1536, 576, seed=rows)


def serial(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def test_pool_results_equal_one_thread_for_both_paths_and_every_row_count_it_serves():
    for rows in (1, 3, 8, 16):
        x, w = operands(rows)

        def exact(x=x, w=w):
            return quant_linear(x, w, Q4_1)

        def integer(x=x, w=w):
            return quant_linear_q8(quantize_activations(x), w, Q4_1)

        assert torch.equal(exact(), serial(exact)) and torch.equal(integer(), serial(integer))


def test_threads_calling_kernels_at_once_get_their_own_answers():
    inputs = [operands(rows) for rows in (1, 2, 4, 8)]
    expected = [serial(lambda x=x, w=w: quant_linear(x, w, Q4_1)) for x, w in inputs]
    got: dict[int, list[bool]] = {i: [] for i in range(len(inputs))}

    def work(i: int) -> None:
        x, w = inputs[i]
        for _ in range(200):
            got[i].append(torch.equal(quant_linear(x, w, Q4_1), expected[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert all(len(v) == 200 and all(v) for v in got.values())


def _child(queue) -> None:
    x, w = operands(4)
    queue.put(quant_linear(x, w, Q4_1).tolist())


def test_a_forked_child_runs_the_pool_loops_without_the_parents_workers():
    x, w = operands(4)
    expected = quant_linear(x, w, Q4_1)  # the parent's workers exist now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(queue,))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0 and torch.equal(torch.tensor(result), expected)
