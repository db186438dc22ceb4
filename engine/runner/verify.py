"""Which tokens each row takes from its logits: the sampled one, or for a verify row the accepted draft
and then the model's own next token.

A verify row has logits at 1 + k positions: after its last token and after each draft token. Position
j is sampled exactly as a decode step would sample it, with the request's state as it would be then —
the draft tokens before j appended to its output (penalties count them), its grammar advanced over them,
its draw Philox's at that position's counter — and the draft token there is accepted when the
sample equals it. For a point-mass draft (an n-gram proposer's) that is the speculative-sampling rule
(accept with probability min(1, p/q) = p(d); on rejection draw from the residual, which is p without
d renormalised): a sample from p that equals d is accepted, one that differs is already a draw from
that residual. So every token taken is distributed as without speculation, greedy rows take the same
tokens, and a seeded request draws exactly the uniforms it would one token at a time.

Rows whose sampling does not depend on the tokens before (no penalties, no grammar) are sampled at every
position in one call of the fused sampler, and the walk only compares; the others walk position by
position, and positions after the first rejection are never sampled.

After the walk the request's state is restored (output truncated, grammar rolled back): the engine
appends the taken tokens itself, one at a time, with its stop checks.
"""

from __future__ import annotations

import torch

from minibatch.engine.core.outputs import TokenLogprob
from minibatch.engine.core.request import Request
from minibatch.engine.runner.sampler import Sampler


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], reqs: list[Request]) -> list[TokenLogprob]:
    """Per row: the chosen token's log-probability and its k most likely alternatives, from one topk."""
    k = max(r.params.logprobs for r in reqs)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None]).squeeze(1).tolist()
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [
        (chosen[j], list(zip(top_ids[j][: r.params.logprobs], top_vals[j][: r.params.logprobs])))
        for j, r in enumerate(reqs)
    ]


def _plain(r: Request) -> bool:
    """Greedy with nothing that depends on earlier tokens: every position's token is its argmax."""
    p = r.params
    return p.greedy and not p.logit_bias and not p.needs_penalties and not p.needs_dry and p.grammar is None


def _stateful(r: Request) -> bool:
    """Its sampling at a position depends on the tokens taken before it."""
    p = r.params
    return p.needs_penalties or p.needs_dry or p.mirostat != 0 or p.grammar is not None


def take_tokens(
    logits: torch.Tensor,  # [sum of (1 + len(draft)) over rows, vocab]: each row's positions in order
    reqs: list[Request],
    drafts: list[list[int]],
    sampler: Sampler,
) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """Per row: the tokens it takes, and their log-probabilities when the request asked for them."""
    offsets, at = [], 0
    for d in drafts:
        offsets.append(at)
        at += 1 + len(d)
    if all(_plain(r) for r in reqs):
        return _take_argmax(sampler.ops.argmax_rows(logits).tolist(), logits, reqs, drafts, offsets)
    if at > len(reqs) and not any(_stateful(r) for r in reqs):
        # every position of every row in one pass: each at its own counter, as it would be one at a time
        rows = [r for r, d in zip(reqs, drafts) for _ in range(1 + len(d))]
        positions = [len(r.output_token_ids) + j for r, d in zip(reqs, drafts) for j in range(1 + len(d))]
        raw = logits if any(r.params.logprobs is not None for r in reqs) else None
        if raw is not None:
            raw = raw.clone()  # the sampler biases its rows in place; log-probabilities are of the model's
        return _take_argmax(sampler(logits, rows, positions), raw, reqs, drafts, offsets)
    taken: list[list[int]] = [[] for _ in reqs]
    lps: list[list[TokenLogprob] | None] = [[] if r.params.logprobs is not None else None for r in reqs]
    base = [len(r.output_token_ids) for r in reqs]
    alive, j = list(range(len(reqs))), 0
    try:
        while alive:
            if at == len(reqs):  # no drafts: the rows in order, as they are
                rows = logits
            else:
                rows = logits[torch.tensor([offsets[i] + j for i in alive], device=logits.device)]
            sub = [reqs[i] for i in alive]
            want = [n for n, r in enumerate(sub) if r.params.logprobs is not None]
            # log-softmax of the model's logits, before penalties and temperature (the sampler changes them in place)
            logprobs = torch.log_softmax(rows[want].float(), dim=-1) if want else None
            tokens = sampler(rows, sub)
            if want:
                for n, lp in zip(want, token_logprobs(logprobs, [tokens[n] for n in want], [sub[n] for n in want])):
                    lps[alive[n]].append(lp)
            still = []
            for i, token in zip(alive, tokens):
                taken[i].append(token)
                draft, r = drafts[i], reqs[i]
                if j < len(draft) and token == draft[j]:
                    r.output_token_ids.append(token)  # the next position samples as if it had been taken
                    grammar = r.params.grammar
                    if grammar is not None and (not grammar.accept(token) or grammar.is_done()):
                        continue
                    still.append(i)
            alive, j = still, j + 1
    finally:
        for r, n in zip(reqs, base):
            extra = len(r.output_token_ids) - n
            if extra:
                del r.output_token_ids[n:]
                if r.params.grammar is not None:
                    r.params.grammar.rollback(extra)
    return taken, lps


def _take_argmax(best, logits, reqs, drafts, offsets) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """Walk each row's positions with the token already chosen at each (`best`, flat over positions): a draft
    token is accepted while it equals the choice; log-probabilities from `logits` (the model's) if asked."""
    taken = []
    for draft, at in zip(drafts, offsets):
        tokens = [best[at]]
        for j, d in enumerate(draft):
            if tokens[-1] != d:
                break
            tokens.append(best[at + j + 1])
        taken.append(tokens)
    lps: list[list[TokenLogprob] | None] = [None] * len(reqs)
    want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    if want:
        index = [offsets[i] + j for i in want for j in range(len(taken[i]))]
        logprobs = torch.log_softmax(logits[torch.tensor(index, device=logits.device)].float(), dim=-1)
        rows_reqs = [reqs[i] for i in want for _ in taken[i]]
        flat = token_logprobs(logprobs, [t for i in want for t in taken[i]], rows_reqs)
        at = 0
        for i in want:
            lps[i] = flat[at : at + len(taken[i])]
            at += len(taken[i])
    return taken, lps
