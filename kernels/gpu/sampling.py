"""The sampling rule of kernels/cpu/csrc/sampling.cpp as one Triton program per row: a grammar's mask, temperature,
top-k, top-p, min-p and the Philox draw, with no sort of the vocabulary and nothing that needs the host (a row
no shortcut decides is searched on the device too). TorchOps.sample_tokens / sample_cuts are the twins.

How a row is decided without sorting. Each cut keeps a prefix of the order (higher logit, lower id among ties):
top-k the tokens at or above the k-th largest logit, top-p the tokens whose mass before them is below
top_p times the top-k set's mass, min-p the tokens with (logit - max) / T >= ln(min_p). A float's bits, read
as an integer with the negative ones flipped, order as the floats do, so each threshold is found by
searching keys: NT trial keys at once, narrowing the range NT-fold, until the largest key whose count
reaches k (whose mass reaches the target) is found. After the pass that finds the maximum, one pass collects
the tokens within 8 nats of it (min-p's bound when tighter; at most CAP) in id order, with the row's whole
mass; when they decide every cut (a trained model's rows nearly always) the search runs over them in
registers and the draw is made among them: two passes over the row in all. Otherwise a second round takes
the lowest bound (STEP nats apart) whose tokens still fit, and past that the search reads the whole row on
each step (a flat row, a tie group larger than CAP). Top-p's cut can fall inside a group of equal logits:
that group is walked in id order. The draw inverts the kept weights' distribution function in id order at
Philox's uniform for (key, position), as the CPU does, so a seeded request draws the same token on either
device when the logits agree.

Weights are exp((l - max) / T) in fp32, summed in fp64 (the twin: fp64 throughout); min-p's test is in fp64.
A row with a NaN, no finite logit, or temperature 0 takes the argmax (the first of ties; a NaN first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import interpreting

NT = 16  # trial keys per search pass: 4 bits of the key range each pass
CAP = 512  # candidates a row keeps to decide its cuts in registers
WARPS = 16  # compiled for sm_90, the program keeps its candidates in registers without spilling (CAP 1,024 at 8
# warps spilled 328 bytes a thread)
STEP = tl.constexpr(2.0)  # nats between the bounds a second round of candidates may take


@triton.jit
def _philox_uniform(key, counter):
    """Philox4x32-10 at counter (counter, 0, 0, 0) with the int64 key: 53 bits of its first two words in [0, 1)
    (engine/runner/philox.py and kernels/cpu/csrc/philox.h are its twins)."""
    k0 = (key & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((counter >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c2 = tl.zeros_like(c0)
    c3 = tl.zeros_like(c0)
    m0 = tl.full(c0.shape, 0xD2511F53, tl.uint32)
    m1 = tl.full(c0.shape, 0xCD9E8D57, tl.uint32)
    w0 = tl.full(c0.shape, 0x9E3779B9, tl.uint32)
    w1 = tl.full(c0.shape, 0xBB67AE85, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + w0
            k1 = k1 + w1
        hi0 = tl.umulhi(m0, c0)
        lo0 = m0 * c0
        hi1 = tl.umulhi(m1, c2)
        lo1 = m1 * c2
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    bits = ((c0.to(tl.uint64) << 32) | c1.to(tl.uint64)) >> 11
    return bits.to(tl.float64) * 1.1102230246251565e-16  # 2**-53


@triton.jit
def _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK: tl.constexpr):
    """A tile of the row as the rule sees it: fp32, banned tokens -inf, -0.0 as +0.0; and its order keys."""
    inside = offs < V
    x = tl.load(logits_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32)
    if HAS_MASK:
        word = tl.load(masks_ptr + offs // 32, mask=inside, other=0)
        x = tl.where(((word >> (offs % 32)) & 1) != 0, x, float("-inf"))
    x = x + 0.0
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    return x, key


@triton.jit
def _weights(x, m, t):
    return tl.where(x > float("-inf"), tl.exp((x - m) / t), 0.0)


@triton.jit
def _search(
    logits_ptr,
    masks_ptr,
    V,
    m,
    t,
    lo,
    hi,
    goal,
    MASS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    NT: tl.constexpr,
):
    """The largest key in [lo, hi] whose tokens at or above it number (MASS: weigh) at least `goal`, given
    that lo's do."""
    j = (tl.arange(0, NT) + 1).to(tl.int64)
    while lo < hi:
        trial = lo + ((hi - lo) * j + NT - 1) // NT  # ascending, each > lo, the last = hi
        if MASS:
            stat = tl.zeros([NT], tl.float64)
        else:
            stat = tl.zeros([NT], tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
            at = key[:, None] >= trial[None, :]
            if MASS:
                w = _weights(x, m, t).to(tl.float64)
                stat += tl.sum(tl.where(at, w[:, None], 0.0), 0)
            else:
                stat += tl.sum(at.to(tl.int64), 0)
        ok = stat >= goal  # true for a prefix of the trials
        lo = tl.max(tl.where(ok, trial, lo), 0)
        hi = tl.min(tl.where(ok, hi, trial - 1), 0)
    return lo


@triton.jit
def _key_of(x):
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _candidates(
    logits_ptr,
    masks_ptr,
    cand_ptr,
    V,
    m,
    t,
    lt_z,
    ln_min_p,
    low_key,
    finite,
    top_k,
    top_p,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NT: tl.constexpr,
):
    """One pass collecting, in id order, the tokens within -lt_z nats (at temperature) of the top, and the
    row's whole mass; then, when those candidates decide every cut, the cuts searched among them in registers.
    Returns (decided, k_key, p_key, p_id, count of candidates, the lowest bound a second round can take)."""
    margin = 1e-3 * (1.0 + tl.abs(m))  # the bounds a little low: a candidate set only grows
    lt_x = m + t * lt_z.to(tl.float32) - margin
    # how many tokens lie above each of NT lower bounds, STEP nats apart: where a second round could go
    lower = lt_z - STEP * (tl.arange(0, NT) + 1).to(tl.float64)
    lower_x = m + t * lower.to(tl.float32) - margin
    above = tl.zeros([NT], tl.int64)
    total = tl.zeros((), tl.float64)
    n = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
        total += tl.sum(_weights(x, m, t).to(tl.float64), 0)
        sel = (x >= lt_x) & (offs < V)
        at = n + tl.cumsum(sel.to(tl.int64), 0) - 1
        tl.store(cand_ptr + at, offs.to(tl.int32), mask=sel & (at < CAP))
        n += tl.sum(sel.to(tl.int64), 0)
        above += tl.sum(((x[:, None] >= lower_x[None, :]) & (offs < V)[:, None]).to(tl.int64), 0)
    next_z = tl.min(tl.where(above <= CAP, lower, lt_z), 0)  # the lowest bound whose tokens still fit
    decided = n <= CAP
    k_key = low_key
    p_key = low_key
    p_id = tl.full((), V, tl.int64)
    if decided:
        j = tl.arange(0, CAP)
        valid = j < n
        ids = tl.load(cand_ptr + j, mask=valid, other=0).to(tl.int64)  # in id order
        x, key = _load_row(logits_ptr, masks_ptr, ids, V, HAS_MASK)
        key = tl.where(valid, key, -(2**40))
        w = tl.where(valid, _weights(x, m, t).to(tl.float64), 0.0)
        c_low = tl.min(tl.where(valid, key, 2**40), 0)  # the last candidate's key in the order
        m_key = tl.max(key, 0)
        cut_k = (top_k > 0) & (top_k < finite)
        k_in = cut_k & (top_k <= n)
        if k_in:
            k_key = _search_in(key, w, c_low, m_key, top_k, False, NT)
        minp_in = (ln_min_p > float("-inf")) & (ln_min_p >= lt_z)
        if top_p < 1:
            wk = tl.where(key >= k_key, w, 0.0)
            target = top_p * tl.where(k_in, tl.sum(wk, 0), total)
            p_in = tl.sum(wk, 0) >= target  # the first token the cut drops is a candidate or the next token
            p_key = c_low
            if p_in:
                p_key = _search_in(key, wk, tl.maximum(c_low, k_key), m_key, target, True, NT)
                ahead = tl.sum(tl.where(key > p_key, wk, 0.0), 0)
                g = tl.where(key == p_key, wk, 0.0)  # the group in id order: a token stays while the mass
                run = ahead + tl.cumsum(g, 0) - g  # before it is below the target
                p_id = tl.max(tl.where((key == p_key) & (run < target), ids, -1), 0)
            decided = k_in | ((cut_k == 0) & (p_in | minp_in))
        else:
            p_key = k_key
            decided = k_in | minp_in
    return decided, k_key, p_key, p_id, n, next_z


@triton.jit
def _search_in(key, w, lo, hi, goal, MASS: tl.constexpr, NT: tl.constexpr):
    """_search over a tile in registers (the candidates): the largest key in [lo, hi] whose tokens at or above
    it number (MASS: weigh, by w) at least `goal`, given that lo's do."""
    j = (tl.arange(0, NT) + 1).to(tl.int64)
    while lo < hi:
        trial = lo + ((hi - lo) * j + NT - 1) // NT
        at = key[:, None] >= trial[None, :]
        if MASS:
            ok = tl.sum(tl.where(at, w[:, None], 0.0), 0) >= goal
        else:
            ok = tl.sum(at.to(tl.int64), 0) >= goal
        lo = tl.max(tl.where(ok, trial, lo), 0)
        hi = tl.min(tl.where(ok, hi, trial - 1), 0)
    return lo


@triton.jit
def _draw_candidates(
    logits_ptr, masks_ptr, cand_ptr, V, n, m, t, temp, ln_min_p, k_key, p_key, p_id, m_key, top, u,
    HAS_MASK: tl.constexpr, CAP: tl.constexpr,
):  # fmt: skip
    """The draw among the n candidates (in id order) the cuts keep; returns (token, how many are kept, the last
    of them in the order)."""
    j = tl.arange(0, CAP)
    valid = j < n
    ids = tl.load(cand_ptr + j, mask=valid, other=0).to(tl.int64)
    x, key = _load_row(logits_ptr, masks_ptr, ids, V, HAS_MASK)
    keep = valid & (key >= k_key) & ((key > p_key) | ((key == p_key) & (ids <= p_id)))
    keep = keep & ((x.to(tl.float64) - m.to(tl.float64)) / temp >= ln_min_p)
    w = tl.where(keep, _weights(x, m, t).to(tl.float64), 0.0)
    c = tl.cumsum(w, 0)
    goal = u * tl.sum(w, 0)
    hit = tl.min(tl.where(c > goal, j, CAP), 0)
    heavy = tl.max(tl.where(w > 0, j, -1), 0)  # the last with weight, where rounding leaves the goal past all
    at = tl.where(hit < CAP, hit, heavy)
    token = tl.where(at >= 0, tl.sum(tl.where(j == at, ids, 0), 0), top)
    count = tl.sum(keep.to(tl.int64), 0)
    low_kept = tl.min(tl.where(keep, key, m_key), 0)
    last = tl.max(tl.where(keep & (key == low_kept), ids, -1), 0)
    return token, count, last


@triton.jit
def _sample_kernel(
    tokens_ptr,  # int64 [rows]
    cuts_ptr,  # int64 [rows, 3]: how many tokens are kept, the last of them in the order, and the path taken
    logits_ptr,  # [rows, V]
    masks_ptr,  # int32 [rows, ceil(V / 32)] (HAS_MASK)
    settings_ptr,  # fp64 [rows, 4]: temperature, top_p, min_p, top_k
    streams_ptr,  # int64 [rows, 2]: Philox key and counter
    cand_ptr,  # int32 [rows, CAP]: scratch for each row's candidates
    V,
    stride_l,
    stride_m,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    NT: tl.constexpr,
    CAP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride_l
    masks_ptr += row * stride_m
    cand_ptr += row * CAP
    temp = tl.load(settings_ptr + row * 4)
    top_p = tl.load(settings_ptr + row * 4 + 1)
    min_p = tl.load(settings_ptr + row * 4 + 2)
    top_k = tl.load(settings_ptr + row * 4 + 3).to(tl.int64)
    lane = tl.arange(0, BLOCK)

    # the maximum, its first place, the first NaN, the lowest finite logit and how many are finite
    m = tl.full((), float("-inf"), tl.float32)
    top = tl.zeros((), tl.int64)
    first_nan = tl.full((), V, tl.int64)
    low = tl.full((), float("inf"), tl.float32)
    finite = tl.zeros((), tl.int64)
    for start in range(0, V, BLOCK):
        offs = start + lane
        x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
        nan = x != x
        first_nan = tl.minimum(first_nan, tl.min(tl.where(nan, offs, V), 0))
        xn = tl.where(nan, float("-inf"), x)
        tile_max = tl.max(xn, 0)
        at = tl.min(tl.where((xn == tile_max) & (offs < V), offs, V), 0)
        top = tl.where(tile_max > m, at, top)
        m = tl.maximum(m, tile_max)
        real = (xn > float("-inf")) & (offs < V)
        low = tl.minimum(low, tl.min(tl.where(real, xn, float("inf")), 0))
        finite += tl.sum(real.to(tl.int64), 0)
    top = tl.where(first_nan < V, first_nan, top)
    drawn = (first_nan == V) & (m > float("-inf")) & (temp > 0)

    token = top
    count = tl.full((), 1, tl.int64)
    last = top
    path = tl.zeros((), tl.int64)  # 0: the argmax; 1: decided by candidates; 2: every token; 3: by search
    if drawn:
        t = temp.to(tl.float32)
        m_key = _key_of(m)
        low_key = _key_of(low)
        ln_min_p = tl.where(min_p > 0, tl.log(tl.maximum(min_p, 2.2250738585072014e-308)), float("-inf"))
        m64 = m.to(tl.float64)
        cut_any = ((top_k > 0) & (top_k < finite)) | (top_p < 1) | (min_p > 0)
        # The candidates: within 8 nats of the top, or min-p's own bound when tighter; if they cannot decide,
        # once more down to the lowest bound (2 nats apart) whose tokens still fit in CAP;
        # the cuts searched among them in registers, and the draw made among them. A row they cannot decide (a flat
        # one, top-k past them) is searched over the whole row below; a row with no cut draws from every token.
        k_key = low_key
        p_key = low_key
        p_id = tl.full((), V, tl.int64)
        fast = tl.zeros((), tl.int1)
        n = tl.zeros((), tl.int64)
        lt_z = tl.maximum(tl.full((), -8.0, tl.float64), ln_min_p)
        next_z = lt_z
        if cut_any:
            fast, k_key, p_key, p_id, n, next_z = _candidates(
                logits_ptr, masks_ptr, cand_ptr, V, m, t, lt_z, ln_min_p, low_key, finite, top_k, top_p,
                HAS_MASK, BLOCK, CAP, NT,
            )  # fmt: skip
        if cut_any & (fast == 0) & (next_z < lt_z):  # the second round, lower
            fast, k_key, p_key, p_id, n, next_z = _candidates(
                logits_ptr, masks_ptr, cand_ptr, V, m, t, next_z, ln_min_p, low_key, finite, top_k, top_p,
                HAS_MASK, BLOCK, CAP, NT,
            )  # fmt: skip
        u = _philox_uniform(tl.load(streams_ptr + row * 2), tl.load(streams_ptr + row * 2 + 1))
        if fast:
            path = tl.full((), 1, tl.int64)
            token, count, last = _draw_candidates(
                logits_ptr, masks_ptr, cand_ptr, V, n, m, t, temp, ln_min_p, k_key, p_key, p_id, m_key, top, u,
                HAS_MASK, CAP,
            )  # fmt: skip
        else:
            if cut_any:
                path = tl.full((), 3, tl.int64)
                # top-k: the k-th largest logit's key (every finite token when k does not cut)
                k_key = low_key
                if (top_k > 0) & (top_k < finite):
                    k_key = _search(logits_ptr, masks_ptr, V, m, t, low_key, m_key, top_k, False, HAS_MASK, BLOCK, NT)
                # top-p: the key of the group its cut falls in, and the last id kept of that group
                p_key = k_key
                p_id = tl.full((), V, tl.int64)
                if top_p < 1:
                    mass_k = tl.zeros((), tl.float64)
                    for start in range(0, V, BLOCK):
                        offs = start + lane
                        x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
                        mass_k += tl.sum(tl.where(key >= k_key, _weights(x, m, t).to(tl.float64), 0.0), 0)
                    target = top_p * mass_k
                    p_key = _search(logits_ptr, masks_ptr, V, m, t, k_key, m_key, target, True, HAS_MASK, BLOCK, NT)
                    above = tl.zeros((), tl.float64)  # the mass ahead of the group
                    for start in range(0, V, BLOCK):
                        offs = start + lane
                        x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
                        above += tl.sum(tl.where(key > p_key, _weights(x, m, t).to(tl.float64), 0.0), 0)
                    before = above  # the group in id order: a token stays while the mass before it is below target
                    p_id = tl.full((), -1, tl.int64)
                    for start in range(0, V, BLOCK):
                        offs = start + lane
                        x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
                        w = tl.where(key == p_key, _weights(x, m, t).to(tl.float64), 0.0)
                        run = before + tl.cumsum(w, 0) - w
                        p_id = tl.maximum(p_id, tl.max(tl.where((key == p_key) & (run < target), offs, -1), 0))
                        before += tl.sum(w, 0)
            else:
                path = tl.full((), 2, tl.int64)
            # what is kept: its mass, how many, and the last of it in the order
            kept_mass = tl.zeros((), tl.float64)
            count = tl.zeros((), tl.int64)
            last_key = m_key
            last = top
            for start in range(0, V, BLOCK):
                offs = start + lane
                x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
                keep = (key >= k_key) & ((key > p_key) | ((key == p_key) & (offs <= p_id))) & (x > float("-inf"))
                keep = keep & ((x.to(tl.float64) - m64) / temp >= ln_min_p)
                kept_mass += tl.sum(tl.where(keep, _weights(x, m, t).to(tl.float64), 0.0), 0)
                count += tl.sum(keep.to(tl.int64), 0)
                tile_low = tl.min(tl.where(keep, key, m_key), 0)
                tile_last = tl.max(tl.where(keep & (key == tile_low), offs, -1), 0)
                later = (tile_low < last_key) | ((tile_low == last_key) & (tile_last > last))
                last = tl.where(later, tile_last, last)
                last_key = tl.minimum(last_key, tile_low)
            # the draw: the first token, in id order, whose running kept mass passes u * kept mass
            goal = u * kept_mass
            run = tl.zeros((), tl.float64)
            hit = tl.full((), V, tl.int64)
            heavy = top  # the last kept token with weight, where rounding leaves the goal past every sum
            for start in range(0, V, BLOCK):
                offs = start + lane
                x, key = _load_row(logits_ptr, masks_ptr, offs, V, HAS_MASK)
                keep = (key >= k_key) & ((key > p_key) | ((key == p_key) & (offs <= p_id))) & (x > float("-inf"))
                keep = keep & ((x.to(tl.float64) - m64) / temp >= ln_min_p)
                w = tl.where(keep, _weights(x, m, t).to(tl.float64), 0.0)
                c = run + tl.cumsum(w, 0)
                hit = tl.minimum(hit, tl.min(tl.where(c > goal, offs, V), 0))
                heavy = tl.maximum(heavy, tl.max(tl.where(w > 0, offs, -1), 0))
                run += tl.sum(w, 0)
            token = tl.where(hit < V, hit, heavy)
    tl.store(tokens_ptr + row, token)
    tl.store(cuts_ptr + row * 3, count)
    tl.store(cuts_ptr + row * 3 + 1, last)
    tl.store(cuts_ptr + row * 3 + 2, path)


PATHS = ("argmax", "candidates", "every token", "search")  # cuts[:, 2]


def sample_rows(
    logits: torch.Tensor,  # [rows, vocab]
    settings: torch.Tensor,  # fp64 [rows, 4]: temperature (0: greedy), top_p, min_p, top_k (<= 0: off)
    streams: torch.Tensor,  # int64 [rows, 2]: Philox key and counter
    masks: torch.Tensor | None,  # int32 [rows, ceil(vocab / 32)]: allowed-token bits, or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token (int64 [rows]) and what the rule kept (int64 [rows, 3]: how many tokens, the last of
    them in the order, and how the row was decided: PATHS), on the logits' device."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the logits' rows must be contiguous")
    device = logits.device
    settings = settings.to(device, torch.float64).contiguous()
    streams = streams.to(device, torch.int64).contiguous()
    if settings.shape != (rows, 4) or streams.shape != (rows, 2):
        raise ValueError(f"settings {tuple(settings.shape)} and streams {tuple(streams.shape)} for {rows} rows")
    if masks is not None:
        masks = masks.to(device, torch.int32)
        if masks.shape != (rows, (vocab + 31) // 32) or masks.stride(1) != 1:
            raise ValueError(f"masks {tuple(masks.shape)} for {rows} rows of {vocab}: one bit per token")
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    cuts = torch.empty(rows, 3, dtype=torch.int64, device=device)
    scratch = torch.empty(rows, CAP, dtype=torch.int32, device=device)
    if rows:
        _sample_kernel[(rows,)](
            tokens,
            cuts,
            logits,
            tokens if masks is None else masks,
            settings,
            streams,
            scratch,
            vocab,
            logits.stride(0),
            0 if masks is None else masks.stride(0),
            HAS_MASK=masks is not None,
            BLOCK=16384 if interpreting() else 1024,  # the interpreter's numpy likes long tiles
            NT=NT,
            CAP=CAP,
            num_warps=WARPS,
        )
    return tokens, cuts
