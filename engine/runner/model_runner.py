"""Runs one scheduled step: builds the flat inputs, runs the forward over the paged cache, samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.core.request import Request
from minibatch.engine.core.scheduler_output import SchedulerOutput
from minibatch.engine.models.llama import LlamaForCausalLM
from minibatch.engine.runner.sampler import Sampler


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> next token, for requests that reached their last token
    # request id -> (the sampled token's log-probability, [(token, log-probability)] of the k most likely), if asked
    logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], reqs: list[Request]) -> dict:
    """Per request: the chosen token's log-probability and its k most likely alternatives, from one topk."""
    k = max(r.params.logprobs for r in reqs)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None]).squeeze(1).tolist()
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return {
        r.request_id: (chosen[j], list(zip(top_ids[j][: r.params.logprobs], top_vals[j][: r.params.logprobs])))
        for j, r in enumerate(reqs)
    }


class ModelRunner:
    """Owns the model and the KV cache tensors. The same code runs on CPU and GPU."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_size: int,
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = next(model.parameters()).device
        self.sampler = Sampler(self.device)
        self.graphs = None  # DecodeGraphs on CUDA: pure-decode steps replay a captured forward

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        chunks, starts, tables, samplers = [], [], [], []
        for req, n in zip(out.requests, out.num_new_tokens):
            start = req.num_computed_tokens
            chunks.append(req.tokens(start, start + n))
            starts.append(start)
            tables.append(req.block_ids)
            samplers.append(start + n == req.num_tokens)
        for req in out.padding:
            # A finished static-batch member's row is computed as a padded row
            # would be: its last token again, over its own blocks; output dropped.
            last = req.num_tokens - 1
            chunks.append([req.token_at(last)])
            starts.append(min(last, len(req.block_ids) * self.block_size - 1))
            tables.append(req.block_ids)
            samplers.append(False)
        if not chunks:
            return RunnerOutput({})
        batch = build_flat_batch(chunks, starts, tables, self.block_size, self.device)
        rows = [i for i, s in enumerate(samplers) if s]
        logits = None
        if self.graphs is not None:
            # None unless a pure decode step that a graph fits; static mode's padding rows
            # (finished members still computed) replay too, their logits dropped.
            logits = self.graphs.run(batch)
            if logits is not None and len(rows) != len(chunks):
                if not rows:
                    return RunnerOutput({})
                logits = logits[rows]
        if logits is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
            if not rows:
                return RunnerOutput({})
            logits = self.model.compute_logits(hidden[batch.logits_indices[rows]])
        reqs: list[Request] = [out.requests[i] for i in rows]
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        # log-softmax of the model's logits, before penalties and temperature (the sampler may change them in place)
        logprobs = torch.log_softmax(logits[want].float(), dim=-1) if want else None
        tokens = self.sampler(logits, reqs)
        result = RunnerOutput({r.request_id: t for r, t in zip(reqs, tokens)})
        if want:
            result.logprobs = token_logprobs(logprobs, [tokens[i] for i in want], [reqs[i] for i in want])
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
