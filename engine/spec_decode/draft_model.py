"""A smaller model of the same vocabulary proposes the draft tokens: its greedy continuation, k tokens.

The draft model keeps its own KV blocks (its own pool and block manager, no prefix cache) and a shadow
request per target request, whose output list *is* the target's (one list), so the draft always sees
the tokens the target took. Proposing for a batch of rows is one batched forward per draft position:
the first catches the draft's cache up on the tokens it has not seen (the whole prompt at first, then
the tokens accepted at the last verify and the target's own next one) and drafts the first token; each
further pass drafts one more token per row still drafting. Only verified tokens count as computed in
the draft's cache: the positions of its own guesses are recomputed by the next catch-up, so a rejection
needs no rollback here. A draft is a point mass (the draft's argmax), which the verify rule
(runner/verify.py) accepts exactly: answers do not depend on the draft.
"""

from __future__ import annotations

import torch

from minibatch.engine.attention.metadata import build_flat_batch
from minibatch.engine.core.block_manager import BlockManager
from minibatch.engine.core.request import Request
from minibatch.engine.models.llama import LlamaForCausalLM
from minibatch.engine.spec_decode.draft_length import Draft
from minibatch.kernels.kv_types import PagedKV


class DraftModelProposer:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[PagedKV],
        num_blocks: int,
        block_size: int,
        vocab_size: int,  # the target's: a draft row padded past it proposes nothing there
    ) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self._shadows: dict[str, Request] = {}

    def _shadow(self, req: Request) -> Request:
        sh = self._shadows.get(req.request_id)
        if sh is None:
            sh = self._shadows[req.request_id] = Request(req.request_id, req.prompt_token_ids, req.params)
        sh.output_token_ids = req.output_token_ids  # the same list: the draft sees every token taken
        return sh

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> list[Draft]:
        drafts: list[list[int]] = [[] for _ in reqs]
        rows = []  # (index, shadow, k)
        for i, (req, k) in enumerate(zip(reqs, ks)):
            sh = self._shadow(req)
            # its unseen tokens and the positions of k - 1 guesses (the k-th is never fed back)
            if self.blocks.allocate(sh, sh.num_tokens + k - 1 - sh.num_computed_tokens):
                rows.append((i, sh, k))
        if not rows:
            return [Draft(d, "model") for d in drafts]
        fed = [sh.tokens(sh.num_computed_tokens, sh.num_tokens) for _, sh, _ in rows]
        starts = [sh.num_computed_tokens for _, sh, _ in rows]
        for depth in range(max(k for _, _, k in rows)):
            tokens = self._next(fed, starts, [sh.block_ids for _, sh, _ in rows])
            if depth == 0:
                for _, sh, _ in rows:
                    sh.num_computed_tokens = sh.num_tokens  # the verified tokens are in its cache now
            still, still_fed, still_starts = [], [], []
            for (i, sh, k), token, chunk, start in zip(rows, tokens, fed, starts):
                if token >= self.vocab_size:
                    continue
                drafts[i].append(token)
                if len(drafts[i]) < k:
                    still.append((i, sh, k))
                    still_fed.append([token])
                    still_starts.append(start + len(chunk))
            rows, fed, starts = still, still_fed, still_starts
            if not rows:
                break
        for req in reqs:  # the guesses' positions are recomputed next time: their blocks go back
            self.blocks.trim(self._shadows[req.request_id])
        return [Draft(d, "model") for d in drafts]

    def _next(self, chunks: list[list[int]], starts: list[int], tables: list[list[int]]) -> list[int]:
        batch = build_flat_batch(chunks, starts, tables, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.attn)
        return self.model.ops.argmax_rows(self.model.compute_logits(hidden[batch.logits_indices])).tolist()

    def forget(self, request_id: str) -> None:
        sh = self._shadows.pop(request_id, None)
        if sh is not None:
            self.blocks.free(sh)
