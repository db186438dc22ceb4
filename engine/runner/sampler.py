"""Batched next-token sampling: logit bias, grammar masks, penalties, temperature, top-k, top-p, min-p, seeds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from minibatch.engine.core.request import Request
from minibatch.engine.models.ops import TorchOps


class Sampler:
    """Picks one token per row of logits. Greedy rows take the argmax.

    A seeded request draws from its own generator, advanced once per token, so
    it gets the same tokens whatever else shares the batch. Sampling uses the
    exponential race (argmax of p / E with E ~ Exp(1)), which needs one noise
    draw per row and no cumulative sums.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        argmax: Callable[[torch.Tensor], torch.Tensor] = TorchOps.argmax_rows,  # the model's ops' (CpuOps: a kernel)
    ) -> None:
        self.device = torch.device(device)
        self.argmax = argmax
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
            return self.argmax(logits).tolist()
        greedy = torch.tensor([r.params.greedy for r in reqs], device=logits.device)
        result = self.argmax(logits)
        if not bool(greedy.all()):
            idx = (~greedy).nonzero().squeeze(1)
            sampled = self._sample(logits[idx], [reqs[i] for i in idx.tolist()])
            result[idx] = sampled
        return result.tolist()

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
        # Shifted so each row's top is 0 before dividing: a small temperature cannot overflow it to inf.
        logits = (logits - logits.max(dim=-1, keepdim=True).values) / temps[:, None]
        top_k = [r.params.top_k for r in reqs]
        if any(k > 0 for k in top_k):
            ks = torch.tensor([k if k > 0 else logits.shape[1] for k in top_k], device=logits.device)
            kth = logits.sort(dim=-1, descending=True).values.gather(
                1, (ks - 1).clamp(max=logits.shape[1] - 1)[:, None]
            )
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=logits.device)
        if bool((top_p < 1).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=logits.device)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        noise = torch.empty_like(probs)
        for i, r in enumerate(reqs):
            noise[i].exponential_(generator=self._generator(r))
        return self.argmax(probs / noise)

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
