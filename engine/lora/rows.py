"""The adapters a model serves and which rows of the current step each one changes.

The base projection runs once over every row of the step; then each row gets its adapters' low-rank updates,
times its scales: x·A·B per row for the adapters it names, as Punica's BGMV (several adapters on one row,
llama-server's way, summed). The ops compute it (the C++ kernel on the CPU, lora.cpp; its PyTorch twin
elsewhere), each row on its own in one fixed order, so a request gets the same tokens alone as in any batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minibatch.engine.lora.adapter import LoraAdapter
from minibatch.engine.lora.names import LoraUses
from minibatch.engine.models.ops import TorchOps

# What the stacked adapters are kept in: fp16, as llama.cpp's converter writes them: half of fp32's bytes, and
# the adapters' weights are most of what a step under them reads beyond the base's (lora/adapter.py refuses
# values past its range)
WEIGHTS = torch.float16


class LoraSet:
    """The served adapters, stacked per projection as the kernels take them, and the current step's rows of
    each (`begin` .. `end`). Adapter k's A and B^T sit at index k of each projection's [S, R, in] and
    [S, R, out] (zeros past its rank, R the largest), its rank there in `ranks` (0: it leaves it alone)."""

    def __init__(self, device: torch.device, ops: TorchOps) -> None:
        self.device, self.ops = device, ops
        self.names: list[str] = []  # the adapters by slot
        self.adapters: dict[str, LoraAdapter] = {}  # by name, their weights let go once stacked
        self.stacked: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.slots: torch.Tensor | None = None  # this step's: each row's adapters' slots [n, K] int32, -1 none
        self.scales: torch.Tensor | None = None  # and their scales [n, K] fp32

    def add(self, adapter: LoraAdapter) -> None:
        """Serve `adapter` in the next free slot (replacing one of the same name)."""
        if adapter.name in self.adapters:
            self.remove(adapter.name)
        slot = len(self.names)
        keys = set(self.stacked) | set(adapter.weights)
        for key in keys:
            old = self.stacked.get(key)
            ab = adapter.weights.get(key)
            if old is None:
                n_in, n_out = (ab[0].shape[1], ab[1].shape[0])
                old = (torch.zeros(slot, 0, n_in, dtype=WEIGHTS), torch.zeros(slot, 0, n_out, dtype=WEIGHTS))
                old += (torch.zeros(slot, dtype=torch.int32),)
                old = tuple(t.to(self.device) for t in old)
            a, bt, ranks = old
            rank = 0 if ab is None else ab[0].shape[0]
            width = max(a.shape[1], rank)
            a = F.pad(a, (0, 0, 0, width - a.shape[1]))
            bt = F.pad(bt, (0, 0, 0, width - bt.shape[1]))
            new_a = torch.zeros(1, width, a.shape[2], dtype=WEIGHTS, device=self.device)
            new_bt = torch.zeros(1, width, bt.shape[2], dtype=WEIGHTS, device=self.device)
            if ab is not None:
                new_a[0, :rank] = ab[0].to(self.device, WEIGHTS)
                new_bt[0, :rank] = ab[1].to(self.device, WEIGHTS).T
            rank_t = torch.tensor([rank], dtype=torch.int32, device=self.device)
            self.stacked[key] = (
                torch.cat([a, new_a]).contiguous(),
                torch.cat([bt, new_bt]).contiguous(),
                torch.cat([ranks, rank_t]).contiguous(),
            )
        self.names.append(adapter.name)
        self.adapters[adapter.name] = adapter.without_weights()

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            return
        keep = [i for i, n in enumerate(self.names) if n != name]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.stacked = {k: tuple(t.index_select(0, index).contiguous() for t in v) for k, v in self.stacked.items()}
        self.names = [self.names[i] for i in keep]
        del self.adapters[name]

    @property
    def nbytes(self) -> int:
        """What the stacked adapters take (the padding past each one's rank included)."""
        return sum(t.nbytes for v in self.stacked.values() for t in v)

    def begin(self, uses: list[LoraUses], lengths: list[int]) -> None:
        """The step's sequences in order: the adapters each runs under with their scales (none: the base),
        and its rows."""
        self.end()
        if not any(uses):
            return
        width = max(len(u) for u in uses)
        slot = {name: i for i, name in enumerate(self.names)}
        slots: list[int] = []
        scales: list[float] = []
        for seq, n in zip(uses, lengths, strict=True):
            row_slots = [slot[name] for name, _ in seq] + [-1] * (width - len(seq))
            row_scales = [scale for _, scale in seq] + [0.0] * (width - len(seq))
            slots += row_slots * n
            scales += row_scales * n
        self.slots = torch.tensor(slots, dtype=torch.int32).view(-1, width).to(self.device)
        self.scales = torch.tensor(scales, dtype=torch.float32).view(-1, width).to(self.device)

    def end(self) -> None:
        self.slots = self.scales = None

    def add_update(self, layer: int, stack: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the base projection of `x`) with each row's adapters' updates added (the ops' lora_update)."""
        stacked = self.stacked.get((layer, stack))
        if stacked is None or self.slots is None:
            return y
        return self.ops.lora_update(y, x, *stacked, self.slots, self.scales)


class LayerLora:
    """One layer's view of the model's LoraSet (what its attention and MLP hold)."""

    __slots__ = ("loras", "layer")

    def __init__(self, loras: LoraSet, layer: int) -> None:
        self.loras, self.layer = loras, layer

    def __call__(self, stack: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loras.add_update(self.layer, stack, x, y) if self.loras.slots is not None else y
