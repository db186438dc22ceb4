"""The samplers the fused pass does not hold -- top-nσ, typical-p, XTC and Mirostat 2.0 -- as one chain over
each row's likely tokens, in float64, for the rows that ask for one of them (a row without stays in the fused
pass: they cost nothing when off). This is the twin of the CPU kernel (kernels/cpu/csrc/sampling_chain.cpp, which
the sampler runs where it is built): the tests hold the two to the same tokens.

The chain draws among the row's tokens within TAIL nats of the most likely one at the row's temperature (a
logit at least the top's minus 20 x temperature: a token less likely than e^-20 = 2e-9 times the top one is
never drawn; the fused pass has no such floor), its cuts taking them in the order of their logits (higher
first, the lower id first among ties), a row at a time (a row's candidates are few: per-op overhead, not
arithmetic, is what a step of torch calls would cost). Each step works on the distribution
at the row's temperature (as the fused pass's top-p and min-p do), renormalised over what the steps before
it kept:

1. the grammar's mask (a token it forbids is never kept);
2. top-nσ: the tokens whose logit is at least the top's minus n standard deviations of the row's finite logits
   (a cut in logit space: the temperature does not move it);
3. top-k, ties with the k-th kept (the fused pass's rule);
4. typical-p: the tokens ordered by how far their surprise (-ln p, taken as ln(total) - z) is from the
   distribution's entropy, the nearest first (the order of the logits among equals), kept while the mass before
   them is below typical_p;
5. top-p, then min-p (the fused pass's rules);
6. XTC: with probability xtc_probability (a second Philox uniform at the row's position), when two tokens or
   more have a probability of at least xtc_threshold, every one of them but the least likely is dropped;
7. the draw: the kept weights' distribution function, in token-id order (as the fused pass's), inverted at the
   row's uniform.

With mirostat = 2, steps 2-6 are Mirostat 2.0's truncation instead: the tokens whose surprise (-log2 p) is at
most the request's mu (2 tau at first) are kept, the most likely always; after the draw mu moves by eta x
(tau - the drawn token's surprise in the kept distribution). llama.cpp orders its chain penalties, DRY,
top-nσ, top-k, typical, top-p, min-p, XTC, temperature: the same order, except that its temperature comes
last, where ours (and vLLM's) comes first.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.runner.philox import uniform_pairs

TAIL = 20.0  # nats below the top at the row's temperature: the chain's candidates
NARROW = 8.0  # nats below the top: the candidates top-p is tried on first (_narrowed)


class ChainSettings(NamedTuple):
    """A row's settings as the kernel (kernels/cpu/csrc/sampling_chain.cpp) and this twin read them, in this order,
    followed by the row's Mirostat mu."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    top_n_sigma: float
    typical_p: float
    xtc_probability: float
    xtc_threshold: float
    mirostat: int
    mirostat_tau: float
    mirostat_eta: float

    @classmethod
    def of(cls, p: SamplingParams) -> ChainSettings:
        return cls(
            p.temperature,
            p.top_k,
            p.top_p,
            p.min_p,
            p.top_n_sigma,
            p.typical_p,
            p.xtc_probability,
            p.xtc_threshold,
            p.mirostat,
            p.mirostat_tau,
            p.mirostat_eta,
        )


def pack(params: list[SamplingParams], mu: list[float | None]) -> torch.Tensor:
    """fp64 [rows, 12]: each row's ChainSettings and its Mirostat mu (NaN before its first draw, or without)."""
    rows = [[*ChainSettings.of(p), math.nan if m is None else m] for p, m in zip(params, mu)]
    return torch.tensor(rows, dtype=torch.float64).reshape(len(rows), len(ChainSettings._fields) + 1)


def sample_chain(
    logits: torch.Tensor,  # [rows, vocab]
    settings: torch.Tensor,  # fp64 [rows, 12]: pack()'s
    streams: torch.Tensor,  # int64 [rows, 2]: Philox key and counter
    masks: torch.Tensor | None,  # int32 [rows, ceil(vocab / 32)]: the grammar's allowed tokens, or None
) -> torch.Tensor:
    """fp64 [rows, 2]: each row's token and its Mirostat mu after the draw (NaN without Mirostat). The twin of
    the kernel's sample_chain, in NumPy."""
    x = logits.detach().float().cpu().numpy().astype(np.float64)
    if masks is not None:
        bits = np.unpackbits(masks.cpu().numpy().view(np.uint8), axis=1, bitorder="little")[:, : x.shape[1]]
        x[bits == 0] = -np.inf
    keys = streams.cpu().numpy()
    u, coin = uniform_pairs(keys[:, 0], keys[:, 1])
    s = settings.cpu().numpy()
    out = np.empty((len(s), 2), dtype=np.float64)
    n = len(ChainSettings._fields)
    for i in range(len(s)):
        v = [float(f) for f in s[i, :n]]
        p = ChainSettings(*v[:1], int(v[1]), *v[2:8], int(v[8]), *v[9:])
        mu = None if math.isnan(s[i, n]) else float(s[i, n])
        token, new_mu = _row(x[i], p, float(u[i]), float(coin[i]), mu)
        out[i] = token, math.nan if new_mu is None else new_mu
    return torch.from_numpy(out)


def _row(x: np.ndarray, p: ChainSettings, u: float, coin: float, mu: float | None) -> tuple[int, float | None]:
    top = int(np.argmax(x))
    m = float(x[top])
    if not math.isfinite(m):
        return top, mu
    t = p.temperature
    cand = np.flatnonzero(x >= m - TAIL * t)  # ascending ids: the stable sort keeps them so among ties
    sigma = float(x[np.isfinite(x)].std()) if p.top_n_sigma > 0 else 0.0
    total = None  # top-p's mass (of what top-nσ and top-k keep), where the candidates were narrowed for it
    if p.mirostat != 2 and p.top_p < 1 and p.typical_p >= 1:
        cand, total = _narrowed(x, cand, m, p, sigma)
    order = np.argsort(-x[cand], kind="stable")
    ids = cand[order]
    xs = x[ids]
    zc = (xs - m) / t
    w = np.exp(zc)
    if p.mirostat == 2:
        return _mirostat(ids, w, p, u, mu)
    keep = np.ones(len(w), dtype=bool)
    if p.top_n_sigma > 0:
        keep &= xs >= m - p.top_n_sigma * sigma
    if 0 < p.top_k < len(ids):
        keep &= zc >= zc[p.top_k - 1]
    if p.typical_p < 1:
        # -ln p = ln(total) - zc (w = e^zc): a token's distance from the entropy is |c0 - zc|, c0 = ln(total) -
        # entropy, so it falls, then rises, along the order (the kernel walks it outwards instead of sorting)
        log_mass = math.log(float((w * keep).sum()))
        prob = _normalised(w, keep)
        surprise = log_mass - zc
        entropy = float(np.sum(prob[keep] * surprise[keep]))
        by_distance = np.argsort(np.where(keep, np.abs((log_mass - entropy) - zc), np.inf), kind="stable")
        ps = prob[by_distance]
        before = np.cumsum(ps) - ps
        inside = np.zeros(len(w), dtype=bool)
        inside[by_distance] = before < p.typical_p
        keep &= inside
    if p.top_p < 1:
        wk = w * keep
        keep &= (np.cumsum(wk) - wk) < p.top_p * (wk.sum() if total is None else total)
    if p.min_p > 0:
        keep &= zc >= math.log(p.min_p)
    if p.xtc_probability > 0 and p.xtc_threshold <= 0.5 and coin < p.xtc_probability:
        over = keep & (_normalised(w, keep) >= p.xtc_threshold)
        if over.sum() >= 2:
            least = int(np.flatnonzero(over)[-1])  # the last over the threshold in the order: the least likely
            keep &= ~over
            keep[least] = True
    return _draw_by_id(ids, w * keep, u), None


def _narrowed(
    x: np.ndarray, cand: np.ndarray, m: float, p: ChainSettings, sigma: float
) -> tuple[np.ndarray, float | None]:
    """The candidates left to sort for top-p, and top-p's mass: where the tokens within NARROW nats of the top
    hold top_p of the mass that top-nσ and top-k keep, every token below them is past top-p's cut (the mass
    before it is already top_p), so only those are sorted; else all of them, and no mass is given."""
    xc = x[cand]
    w = np.exp((xc - m) / p.temperature)
    kept = np.ones(len(cand), dtype=bool)
    if p.top_n_sigma > 0:
        kept &= xc >= m - p.top_n_sigma * sigma
    if 0 < p.top_k < len(cand):
        kept &= xc >= np.partition(xc, len(xc) - p.top_k)[len(xc) - p.top_k]  # the k-th largest, ties kept
    near = kept & (xc >= m - NARROW * p.temperature)
    total = float(w[kept].sum())
    if float(w[near].sum()) < p.top_p * total:
        return cand, None
    return cand[near], total


def _mirostat(ids: np.ndarray, w: np.ndarray, p: ChainSettings, u: float, mu: float | None) -> tuple[int, float]:
    mu = 2.0 * p.mirostat_tau if mu is None else mu
    surprise = -np.log2(w / w.sum())
    keep = surprise <= mu
    keep[0] = True
    kept = w * keep
    token = _draw_by_id(ids, kept, u)
    observed = -math.log2(float(kept[ids == token][0] / kept.sum()))
    return token, mu - p.mirostat_eta * (observed - p.mirostat_tau)


def _draw_by_id(ids: np.ndarray, weights: np.ndarray, u: float) -> int:
    """The token the weights' distribution function, taken in token-id order (as the fused pass's draw), gives
    at u: the order of the draw moves no probability, and in id order the kernel orders nothing to draw."""
    by_id = np.argsort(ids, kind="stable")
    return int(ids[by_id][_draw(weights[by_id], u)])


def _normalised(w: np.ndarray, keep: np.ndarray) -> np.ndarray:
    wk = w * keep
    return wk / wk.sum()


def _draw(weights: np.ndarray, u: float) -> int:
    """The index where the weights' running sum first passes u x their total (the last weighted one where
    rounding leaves the target past every sum)."""
    c = np.cumsum(weights)
    at = int(np.searchsorted(c, u * c[-1], side="right"))
    if at >= len(c):
        at = int(np.flatnonzero(weights > 0)[-1])
    return at
