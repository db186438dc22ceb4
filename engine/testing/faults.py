"""Fault injection for the reliability tests, switched on through the daemon's environment.

`MINIBATCH_FAULT_AT_STEP=N` makes step N's forward raise once; `N:fatal` also makes the device count as
lost from then on (as a dead CUDA context is), so the engine stops and the daemon exits. Unset, the
runner is returned as it is.
"""

from __future__ import annotations

import os

FAULT_ENV = "MINIBATCH_FAULT_AT_STEP"


class FaultyRunner:
    """A model runner whose forward raises at one step; every other attribute is the runner's own."""

    def __init__(self, runner, step: int, fatal: bool) -> None:
        self.inner, self.fault_step, self.fatal, self.steps = runner, step, fatal, 0

    def execute(self, out):
        self.steps += 1
        if self.steps == self.fault_step:
            raise RuntimeError(f"injected forward fault at step {self.steps}")
        return self.inner.execute(out)

    def device_lost(self) -> bool:
        return (self.fatal and self.steps >= self.fault_step) or self.inner.device_lost()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def wrap_from_env(runner):
    """The runner with the fault the environment asks for, or the runner itself."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return runner
    step, _, kind = spec.partition(":")
    return FaultyRunner(runner, int(step), kind == "fatal")
