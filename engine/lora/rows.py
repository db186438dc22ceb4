"""The adapters a model serves and which rows of the current step each one changes.

The base projection runs once over every row of the step; then each adapter present adds its low-rank
update to its own rows only, times each row's scale: a segmented x·A·B, as Punica's SGMV (rows grouped by
adapter, one pair of small matmuls per group); a row under several adapters, llama-server's way, gets the
sum. The update is computed in float64 and rounded once, so that a row's result does not depend on which
other rows share its group's matmul (the same tokens alone as in any batch)."""

from __future__ import annotations

import torch

from minibatch.engine.lora.adapter import LoraAdapter
from minibatch.engine.lora.names import LoraUses


class LoraSet:
    """Adapters by name (on the model's device), and the current step's rows of each (`begin` .. `end`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.adapters: dict[str, LoraAdapter] = {}
        # this step's: (adapter, its rows, their scale: one for all, or one per row [rows, 1])
        self.groups: list[tuple[LoraAdapter, torch.Tensor | slice, float | torch.Tensor]] = []

    def add(self, adapter: LoraAdapter) -> None:
        self.adapters[adapter.name] = adapter.to(self.device, torch.float64)  # (see add_update)

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def begin(self, uses: list[LoraUses], lengths: list[int]) -> None:
        """The step's sequences in order: the adapters each runs under with their scales (none: the base),
        and its rows."""
        self.groups = []
        if not any(uses):
            return
        rows: dict[str, list[int]] = {}
        scales: dict[str, list[float]] = {}
        start = 0
        for seq, n in zip(uses, lengths, strict=True):
            for name, scale in seq:
                rows.setdefault(name, []).extend(range(start, start + n))
                scales.setdefault(name, []).extend([scale] * n)
            start += n
        for name in sorted(rows):  # one order whatever the batch: a row's updates are summed in it
            r, s = rows[name], scales[name]
            where = slice(None) if len(r) == start else torch.tensor(r, device=self.device)  # every row: no gather
            scale = s[0] if len(set(s)) == 1 else torch.tensor(s, dtype=torch.float64, device=self.device)[:, None]
            self.groups.append((self.adapters[name], where, scale))

    def end(self) -> None:
        self.groups = []

    def add_update(self, layer: int, stack: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection of `x`) with each adapter's update added to its rows: one adapter's rounded
        and added, several summed first (in the groups' one order) and added once."""
        deltas = []
        for adapter, rows, scale in self.groups:
            ab = adapter.weights.get((layer, stack))
            if ab is not None:
                a, b = ab
                deltas.append((rows, ((x[rows].double() @ a.T) @ b.T) * scale))
        if not deltas:
            return y
        if len(deltas) == 1:
            rows, delta = deltas[0]
        else:
            rows, delta = slice(None), torch.zeros(y.shape, dtype=torch.float64, device=y.device)
            for where, d in deltas:
                delta = delta + d if isinstance(where, slice) else delta.index_add(0, where, d)
        if isinstance(rows, slice):
            return y + delta.to(y.dtype)
        return y.index_add(0, rows, delta.to(y.dtype))


class LayerLora:
    """One layer's view of the model's LoraSet (what its attention and MLP hold)."""

    __slots__ = ("loras", "layer")

    def __init__(self, loras: LoraSet, layer: int) -> None:
        self.loras, self.layer = loras, layer

    def __call__(self, stack: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loras.add_update(self.layer, stack, x, y) if self.loras.groups else y
