"""Batched next-token sampling: logit bias, grammar masks, penalties, temperature, top-k, top-p, min-p, seeds."""

from __future__ import annotations

import math

import numpy as np
import torch

from minibatch.engine.core.request import Request
from minibatch.engine.models.ops import TorchOps


class Sampler:
    """Picks one token per row of logits. Greedy rows take the argmax.

    A seeded request draws from its own generator, advanced once per token, so
    it gets the same tokens whatever else shares the batch. A sampled row
    inverts its distribution function at one uniform draw (`ops.sample_rows`):
    top-k, top-p and min-p first mask the logits they cut to -inf, and the
    draw applies the temperature.
    """

    def __init__(self, device: torch.device | str = "cpu", ops: TorchOps | None = None) -> None:
        self.device = torch.device(device)
        self.ops = ops or TorchOps()  # the model's (CpuOps: kernels on the CPU's pool)
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.seed()

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:  # logits: [n, vocab]
        logits = logits.float()
        biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            apply_logit_bias(logits, biased, [reqs[i] for i in biased])
        penalised = [i for i, r in enumerate(reqs) if r.params.needs_penalties]
        for i in penalised:
            apply_penalties(logits[i], reqs[i])
        if penalised:  # an extreme penalty overflows: keep every logit finite, so the softmax stays a distribution
            big = torch.finfo(logits.dtype).max
            logits.clamp_(-big, big)
        # The grammar's masks go last: whatever came before, a token it forbids is never picked.
        guided = [i for i, r in enumerate(reqs) if r.params.grammar is not None]
        if guided:
            apply_grammar_masks(logits, guided, [reqs[i] for i in guided])
        if all(r.params.greedy for r in reqs):
            return self.ops.argmax_rows(logits).tolist()
        return self._sample(logits, reqs).tolist()

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Every row in one pass over the logits (a greedy row as temperature 0: its argmax, drawing nothing);
        only rows that top-k, top-p or min-p cut are gathered first."""
        cut = [
            i
            for i, r in enumerate(reqs)
            if not r.params.greedy and (r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0)
        ]
        if cut:
            idx = torch.tensor(cut, device=logits.device)
            logits = logits.clone()
            logits[idx] = self._cut(logits[idx], [reqs[i] for i in cut])
        inv_temps = torch.tensor(
            [math.inf if r.params.greedy else 1.0 / r.params.temperature for r in reqs],
            dtype=torch.float32,
            device=logits.device,
        )
        zero = torch.zeros(1, device=self.device)
        u = torch.cat(
            [zero if r.params.greedy else torch.rand(1, generator=self._generator(r), device=self.device) for r in reqs]
        )
        return self.ops.sample_rows(logits, inv_temps, u)

    @staticmethod
    def _cut(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The rows' logits with what top-k, top-p and min-p cut set to -inf (probabilities at each row's
        temperature; the top token always stays)."""
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        # Shifted so each row's top is 0 before dividing: a small temperature cannot overflow it to inf.
        scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temps[:, None]
        drop = torch.zeros_like(scaled, dtype=torch.bool)
        top_k = [r.params.top_k for r in reqs]
        if any(k > 0 for k in top_k):
            ks = torch.tensor([k if k > 0 else scaled.shape[1] for k in top_k], device=logits.device)
            at = (ks - 1).clamp(max=scaled.shape[1] - 1)[:, None]
            kth = scaled.sort(dim=-1, descending=True).values.gather(1, at)
            drop |= scaled < kth
        probs = scaled.masked_fill(drop, float("-inf")).softmax(dim=-1)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=logits.device)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
            drop |= torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=logits.device)
        if bool((min_p > 0).any()):
            drop |= probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        return logits.masked_fill(drop, float("-inf"))

    def _generator(self, r: Request) -> torch.Generator:
        if r.params.seed is None:
            return self.default_generator
        g = self.generators.get(r.request_id)
        if g is None:
            g = self.generators[r.request_id] = torch.Generator(device=self.device)
            g.manual_seed(r.params.seed)
        return g


def apply_logit_bias(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Add each request's logit_bias to its own row, in place (grammar masks come after: a ban stays a ban)."""
    index_rows, index_cols, values = [], [], []
    for row, r in zip(rows, reqs):
        for token, bias in r.params.logit_bias.items():
            index_rows.append(row)
            index_cols.append(token)
            values.append(bias)
    device = logits.device
    logits.index_put_(
        (torch.tensor(index_rows, device=device), torch.tensor(index_cols, device=device)),
        torch.tensor(values, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Set to -inf, in place, every token the request's grammar does not allow next (only these rows)."""
    vocab = logits.shape[1]
    words = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.int32)
    for j, r in enumerate(reqs):
        r.params.grammar.fill_mask(words[j])
    bits = torch.from_numpy(words).to(logits.device).unsqueeze(-1) >> torch.arange(
        32, dtype=torch.int32, device=logits.device
    )
    allowed = (bits & 1).bool().reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_penalties(row: torch.Tensor, r: Request) -> None:  # row: [vocab], changed in place
    p = r.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long, device=row.device
        )
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if r.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(r.output_token_ids, device=row.device).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
