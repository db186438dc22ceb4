"""Runs one scheduled step: builds the flat inputs, runs the forward over the paged cache, samples."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.core.outputs import RunnerOutput
from minibatch.engine.core.request import Request
from minibatch.engine.core.scheduler_output import SchedulerOutput
from minibatch.engine.models.llama import LlamaForCausalLM
from minibatch.engine.runner.sampler import Sampler
from minibatch.engine.runner.verify import take_tokens


class ModelRunner:
    """Owns the model and the KV cache tensors. The same code runs on CPU and GPU."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_size: int,
        token_texts: Callable[[int], list[str]] | None = None,  # the tokenizer's, for DRY's breakers
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = next(model.parameters()).device
        self.sampler = Sampler(model.ops, token_texts=token_texts)
        self.graphs = None  # DecodeGraphs on CUDA: pure-decode steps replay a captured forward

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        chunks, starts, tables = [], [], []
        sampling: list[tuple[Request, list[int], list[int]]] = []  # (request, its draft, its sequences' indexes)
        for req, n, draft in zip(out.requests, out.num_new_tokens, out.drafts):
            start = req.num_computed_tokens
            if draft:
                # A verify row: its last token and each draft token as a one-token sequence over the same
                # blocks (position p attends to 0..p, the K/V of this forward's earlier tokens included), so
                # the decode kernel and the decode graphs cover it and each position attends as a decode would.
                first = len(chunks)
                for j, token in enumerate([req.token_at(start), *draft]):
                    chunks.append([token])
                    starts.append(start + j)
                    tables.append(req.block_ids)
                sampling.append((req, draft, list(range(first, len(chunks)))))
                continue
            chunks.append(req.tokens(start, start + n))
            starts.append(start)
            tables.append(req.block_ids)
            if start + n == req.num_tokens:
                sampling.append((req, [], [len(chunks) - 1]))
        for req in out.padding:
            # A finished static-batch member's row is computed as a padded row
            # would be: its last token again, over its own blocks; output dropped.
            last = req.num_tokens - 1
            chunks.append([req.token_at(last)])
            starts.append(min(last, len(req.block_ids) * self.block_size - 1))
            tables.append(req.block_ids)
        if not chunks:
            return RunnerOutput()
        batch = build_flat_batch(chunks, starts, tables, self.block_size, self.device)
        rows = [i for _, _, seqs in sampling for i in seqs]
        logits = None
        if self.graphs is not None:
            # None unless a pure decode step that a graph fits (verify rows are decode sequences too);
            # static mode's padding rows (finished members still computed) replay as well, their logits dropped.
            logits = self.graphs.run(batch)
            if logits is not None and len(rows) != len(chunks):
                if not rows:
                    return RunnerOutput()
                logits = logits[rows]
        if logits is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
            if not rows:
                return RunnerOutput()
            if len(rows) == len(chunks) == hidden.shape[0]:
                # one token per sequence, every one sampled (decode and verify rows): no gather, whose
                # parallel region would leave OpenMP's threads spinning beside the kernels' pool
                picked = hidden
            else:
                picked = hidden[batch.logits_indices[rows]]
            logits = self.model.compute_logits(picked)
        reqs = [r for r, _, _ in sampling]
        tokens, logprobs = take_tokens(logits, reqs, [d for _, d, _ in sampling], self.sampler)
        result = RunnerOutput({r.request_id: t for r, t in zip(reqs, tokens)})
        result.logprobs = {r.request_id: lp for r, lp in zip(reqs, logprobs) if lp is not None}
        return result

    def device_lost(self) -> bool:
        """After a failed step: whether the device is unusable (a CUDA error is sticky: every later call fails too)."""
        if self.device.type != "cuda":
            return False
        try:
            torch.cuda.synchronize(self.device)
            torch.zeros(1, device=self.device).add_(1).item()
        except Exception:  # noqa: BLE001 - any failure here means the context is gone
            return True
        return False

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
