"""The script tests' model cache: empty at the start of each module, as a new user's is."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def fresh_cache():
    d = tempfile.mkdtemp(prefix="mb-cache-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def env(fresh_cache) -> dict:
    return {**os.environ, "MINIBATCH_CACHE_DIR": str(fresh_cache)}
