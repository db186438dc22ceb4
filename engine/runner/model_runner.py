"""Runs one scheduled step: builds the flat inputs, runs the forward over the paged cache, samples."""

from __future__ import annotations

from collections.abc import Callable

import torch

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.core.outputs import RunnerOutput
from minibatch.engine.core.request import Request
from minibatch.engine.core.scheduler_output import SchedulerOutput
from minibatch.engine.encoders.model import EncoderModel
from minibatch.engine.lora.adapter import LoraAdapter, LoraError
from minibatch.engine.lora.names import LoraUses
from minibatch.engine.models.llama import LlamaForCausalLM
from minibatch.engine.runner.kv_shift import KeyShifter
from minibatch.engine.runner.sampler import Sampler
from minibatch.engine.runner.verify import take_tokens
from minibatch.kernels.kv_types import PagedKV


class ModelRunner:
    """Owns the model and the KV cache tensors. The same code runs on CPU and GPU."""

    def __init__(
        self,
        model: LlamaForCausalLM | EncoderModel,
        kv_caches: list[PagedKV],  # per layer: K and V, each [num_blocks, block_size, num_kv_heads, row]; an
        #                            encoder's: none (it attends within the step's inputs, caching nothing)
        block_size: int,
        token_texts: Callable[[int], list[str]] | None = None,  # the tokenizer's, for DRY's breakers
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = next(model.parameters()).device
        self.sampler = Sampler(model.ops, token_texts=token_texts)
        self.shifter = KeyShifter(model, kv_caches)  # rows moved by shifted reuse, before the forward
        self.graphs = None  # DecodeGraphs on CUDA: pure-decode steps replay a captured forward
        # mean pooling's running sums (cls, an encoder's rank: the first position's state), per request mid-prompt
        self.pooling_sums: dict[str, tuple[torch.Tensor | float, int]] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.shifter.apply(out.kv_moves)
        chunks, starts, tables = [], [], []
        adapters: list[LoraUses] = []  # each sequence's LoRA adapters (none: the base)
        sampling: list[tuple[Request, list[int], list[int]]] = []  # (request, its draft, its sequences' indexes)
        pooled: list[tuple[Request, int, int, int]] = []  # embedding requests: (request, sequence, start, tokens)
        images: list[tuple[int, torch.Tensor]] = []  # (the flat batch's row of the first, an image's rows)
        whole: list[tuple[int, int, int, int]] = []  # whole images' rows: (first row, rows, span start, span end)
        flat = 0  # rows of the chunks so far
        for req, n, draft in zip(out.requests, out.num_new_tokens, out.drafts):
            start = req.num_computed_tokens
            if draft:
                # A verify row: its last token and each draft token as a one-token sequence over the same
                # blocks (position p attends to 0..p, the K/V of this forward's earlier tokens included), so
                # the decode kernel and the decode graphs cover it and each position attends as a decode would.
                first = len(chunks)
                for j, token in enumerate([req.token_at(start), *draft]):
                    chunks.append([token])
                    flat += 1
                    starts.append(start + j)
                    tables.append(req.block_ids)
                    adapters.append(req.loras)
                sampling.append((req, draft, list(range(first, len(chunks)))))
                continue
            chunks.append(req.tokens(start, start + n))
            for span in req.images:  # its image positions in this chunk take the image's embeddings
                lo, hi = max(start, span.offset), min(start + n, span.end)
                if lo < hi:
                    images.append((flat + lo - start, span.embeds[lo - span.offset : hi - span.offset]))
                    if span.whole:  # its rows attend to all its positions (the chunk holds the rest of it)
                        whole.append((flat + lo - start, hi - lo, span.offset, span.end))
            flat += n
            starts.append(start)
            tables.append(req.block_ids)
            adapters.append(req.loras)
            if req.pooling is not None:
                pooled.append((req, len(chunks) - 1, start, n))
            elif start + n == req.num_tokens:
                sampling.append((req, [], [len(chunks) - 1]))
        for req in out.padding:
            # A finished static-batch member's row is computed as a padded row
            # would be: its last token again, over its own blocks; output dropped.
            last = req.num_tokens - 1
            chunks.append([req.token_at(last)])
            starts.append(min(last, len(req.block_ids) * self.block_size - 1))
            tables.append(req.block_ids)
            adapters.append(req.loras)  # (its last K/V written again: by its own adapters)
        if not chunks:
            return RunnerOutput()
        batch = build_flat_batch(chunks, starts, tables, self.block_size, self.device)
        batch.attn.abandon = out.abandon
        if whole:  # each row's [first, stop) positions of its image, (0, 0) for the others
            spans = torch.zeros(sum(len(c) for c in chunks), 2, dtype=torch.int32)
            for row, n, a, b in whole:
                spans[row : row + n] = torch.tensor([a, b], dtype=torch.int32)
            batch.attn.image_spans = spans.to(self.device)
        decoder = self.model if isinstance(self.model, LlamaForCausalLM) else None
        loras = decoder.loras if decoder is not None else None
        if loras is not None:
            loras.begin(adapters, [len(c) for c in chunks])
        if images and decoder is not None:
            index = torch.cat([torch.arange(row, row + len(e)) for row, e in images]).to(self.device)
            decoder.image_rows = (index, torch.cat([e for _, e in images]).to(self.device))
        try:
            # (rows under adapters or of images: the decode graphs hold neither)
            special = (loras is not None and loras.slots is not None) or bool(images)
            return self._forward(batch, chunks, sampling, pooled, special)
        finally:
            if loras is not None:
                loras.end()
            if decoder is not None:
                decoder.image_rows = None

    def _forward(self, batch, chunks, sampling, pooled, special: bool) -> RunnerOutput:
        """The forward of the step's flat batch and its sampling (`special`: rows under LoRA adapters or of
        images, which the decode graphs do not hold)."""
        rows = [i for _, _, seqs in sampling for i in seqs]
        logits = None
        if self.graphs is not None and not pooled and not special:
            # None unless a pure decode step that a graph fits (verify rows are decode sequences too);
            # static mode's padding rows (finished members still computed) replay as well, their logits dropped.
            logits = self.graphs.run(batch)
            if logits is not None and len(rows) != len(chunks):
                if not rows:
                    return RunnerOutput()
                logits = logits[rows]
        embeddings: dict[str, list[float]] = {}
        if logits is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
            embeddings = self._pool(hidden, chunks, pooled) if pooled else {}
            if not rows:
                return RunnerOutput(embeddings=embeddings)
            if len(rows) == len(chunks) == hidden.shape[0]:
                # one token per sequence, every one sampled (decode and verify rows): no gather, whose
                # parallel region would leave OpenMP's threads spinning beside the kernels' pool
                picked = hidden
            else:
                picked = hidden[batch.logits_indices[rows]]
            logits = self.model.compute_logits(picked)
        reqs = [r for r, _, _ in sampling]
        tokens, logprobs = take_tokens(logits, reqs, [d for _, d, _ in sampling], self.sampler)
        result = RunnerOutput({r.request_id: t for r, t in zip(reqs, tokens)}, embeddings=embeddings)
        result.logprobs = {r.request_id: lp for r, lp in zip(reqs, logprobs) if lp is not None}
        return result

    def _pool(self, hidden: torch.Tensor, chunks: list[list[int]], pooled) -> dict[str, list[float]]:
        """Each embedding request's chunk pooled into its running state; the vectors of those whose prompt
        ended here (float32, as the hidden states are; mean pooling sums in float64)."""
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()
        done = {}
        for req, seq, start, n in pooled:
            rows = hidden[ends[seq] - n : ends[seq]]
            if req.pooling == "mean":
                total, count = (0.0, 0) if start == 0 else self.pooling_sums.get(req.request_id, (0.0, 0))
                total, count = total + rows.sum(dim=0, dtype=torch.float64), count + n
                self.pooling_sums[req.request_id] = (total, count)
                vector = total / count
            elif req.pooling == "cls" or (req.pooling == "rank" and self.model.rank_from_first):
                if start == 0:
                    self.pooling_sums[req.request_id] = (rows[0], 1)
                vector = self.pooling_sums[req.request_id][0]
            else:  # last (and a decoder reranker's rank)
                vector = rows[-1]
            if req.pooling == "rank":  # a reranker's score of the pair: its head over the first or last token
                vector = self.model.classify(vector[None])[0]
            if start + n == req.num_prompt_tokens:
                done[req.request_id] = vector.float().cpu().tolist()
                self.pooling_sums.pop(req.request_id, None)
        return done

    def add_lora(self, adapter: LoraAdapter) -> None:
        """Serve `adapter`: its rows get its updates in every step (a decoder's only)."""
        if not isinstance(self.model, LlamaForCausalLM):
            raise LoraError(f"adapter {adapter.name!r}: LoRA adapters run over decoders, not encoders")
        self.model.attach_loras(self.device).add(adapter)

    def remove_lora(self, name: str) -> None:
        if isinstance(self.model, LlamaForCausalLM) and self.model.loras is not None:
            self.model.loras.remove(name)

    def lora_bytes(self) -> int:
        loras = self.model.loras if isinstance(self.model, LlamaForCausalLM) else None
        return loras.nbytes if loras is not None else 0

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
        self.pooling_sums.pop(request_id, None)
