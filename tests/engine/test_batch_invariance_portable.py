"""test_batch_invariance.py's matrix on the kernels built for x86-64's baseline (the plain C++ loops), in a module
of its own so that it runs beside the other builds' on another worker. It runs one batch of the matrix, 16
requests in waves in chunks of 17 tokens, with speculation: the plain loops take minutes for 64, and the kernels'
own tests check every row count to 64 on this build (tests/kernels/test_batch_invariance.py). The prefix cache,
static mode and preemption run on the other builds: they reach these kernels only through the chunked prefill
over cached blocks that the chunks of 17 run here too."""

from __future__ import annotations

import pytest

from .test_batch_invariance import BATCHES, alone, chats, use_build  # noqa: F401 (the matrix's fixtures)
from .test_batch_invariance import test_continuous_batches_and_chunks as _batches

pytestmark = pytest.mark.model

# the chunks that cross steps in waves with speculation (what the plain loops compute differently most often:
# partial prefill chunks, verify rows); the other batch sizes run on the other builds and in the kernels' tests
SMALL = {name: case for name, case in BATCHES.items() if name == "16-requests-chunk-17"}


@pytest.fixture(scope="module")
def cpu_build():
    yield from use_build("portable")


@pytest.mark.parametrize("others,chunk,waves,speculative,rows", SMALL.values(), ids=SMALL.keys())
def test_continuous_batches_and_chunks(cpu_build, chats, alone, others, chunk, waves, speculative, rows):  # noqa: F811
    _batches(cpu_build, chats, alone, others, chunk, waves, speculative, rows)
