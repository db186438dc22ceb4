"""The adapters a model serves and which rows of the current step each one changes.

The base projection runs once over every row of the step; then each adapter present adds its low-rank update
to its own rows only (a segmented x·A·B, as Punica's SGMV: rows grouped by adapter, one pair of small matmuls
per group). The update is computed in float64 and rounded once, so that a row's result does not depend on
which other rows share its group's matmul (the same tokens alone as in any batch)."""

from __future__ import annotations

import torch

from minibatch.engine.lora.adapter import LoraAdapter


class LoraSet:
    """Adapters by name (on the model's device), and the current step's rows of each (`begin` .. `end`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.adapters: dict[str, LoraAdapter] = {}
        self.groups: list[tuple[LoraAdapter, torch.Tensor | slice]] = []  # this step's: (adapter, its rows)

    def add(self, adapter: LoraAdapter) -> None:
        self.adapters[adapter.name] = adapter.to(self.device, torch.float64)  # (see add_update)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def begin(self, names: list[str | None], lengths: list[int]) -> None:
        """The step's sequences in order: each one's adapter (None: the base) and its rows."""
        self.groups = []
        if not any(names):
            return
        by_name: dict[str, list[int]] = {}
        start = 0
        for name, n in zip(names, lengths, strict=True):
            if name is not None:
                by_name.setdefault(name, []).extend(range(start, start + n))
            start += n
        for name, rows in by_name.items():
            whole = len(rows) == start  # every row of the step: no gather
            self.groups.append((self.adapters[name], slice(None) if whole else torch.tensor(rows, device=self.device)))

    def end(self) -> None:
        self.groups = []

    def add_update(self, layer: int, stack: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection of `x`) with each adapter's update added to its rows."""
        for adapter, rows in self.groups:
            ab = adapter.weights.get((layer, stack))
            if ab is None:
                continue
            a, b = ab
            delta = (x[rows].double() @ a.T) @ b.T
            if isinstance(rows, slice):
                y = y + delta.to(y.dtype)
            else:
                y = y.index_add(0, rows, delta.to(y.dtype))
        return y


class LayerLora:
    """One layer's view of the model's LoraSet (what its attention and MLP hold)."""

    __slots__ = ("loras", "layer")

    def __init__(self, loras: LoraSet, layer: int) -> None:
        self.loras, self.layer = loras, layer

    def __call__(self, stack: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loras.add_update(self.layer, stack, x, y) if self.loras.groups else y
