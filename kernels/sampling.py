"""The sampling rule of kernels/csrc/sampling.cpp as one Triton program per row: a grammar's mask, temperature,
top-k, top-p, min-p and the Philox draw, with no sort of the vocabulary and no trip to the host, so the whole
step (forward and sampling) fits in one CUDA graph. TorchOps.sample_tokens / sample_cuts are the twins.

How a row is decided without sorting. Each cut keeps a prefix of the order (higher logit, lower id among ties):
top-k the tokens at or above the k-th largest logit, top-p the tokens whose mass before them is below
top_p times the top-k set's mass, min-p the tokens with (logit - max) / T >= ln(min_p). The two value
thresholds are found by searching the logits' values, not by sorting them: a float's bits, read as an integer
with the negative ones flipped, order as the floats do, and each pass over the row counts (top-k) or weighs
(top-p) the tokens at or above NT trial keys at once, narrowing the key range NT-fold, until the largest key
whose count reaches k (whose mass reaches the target) is found. Top-p's cut can fall inside a group of equal
logits: one more pass walks that group in id order. The draw inverts the kept weights' distribution function
in id order at Philox's uniform for (key, position), as the CPU does, so a seeded request draws the same
token on either device when the logits agree.

Weights are exp((l - max) / T) in fp32, summed in fp64 (the twin: fp64 throughout); min-p's test is in fp64.
A row with a NaN, no finite logit, or temperature 0 takes the argmax (the first of ties; a NaN first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_support import interpreting

NT = 16  # trial keys per search pass: 4 bits of the key range each pass


@triton.jit
def _philox_uniform(key, counter):
    """Philox4x32-10 at counter (counter, 0, 0, 0) with the int64 key: 53 bits of its first two words in [0, 1)
    (engine/runner/philox.py and kernels/csrc/philox.h are its twins)."""
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
def _sample_kernel(
    tokens_ptr,  # int64 [rows]
    cuts_ptr,  # int64 [rows, 2]: how many tokens are kept, and the last of them in the order
    logits_ptr,  # [rows, V]
    masks_ptr,  # int32 [rows, ceil(V / 32)] (HAS_MASK)
    settings_ptr,  # fp64 [rows, 4]: temperature, top_p, min_p, top_k
    streams_ptr,  # int64 [rows, 2]: Philox key and counter
    V,
    stride_l,
    stride_m,
    HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
    NT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride_l
    masks_ptr += row * stride_m
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
    if drawn:
        t = temp.to(tl.float32)
        m_key = _load_row(logits_ptr, masks_ptr, top + tl.zeros([1], tl.int64), V, HAS_MASK)[1]
        m_key = tl.max(m_key, 0)
        low_bits = low.to(tl.int32, bitcast=True)
        low_key = tl.where(low_bits < 0, low_bits ^ 0x7FFFFFFF, low_bits).to(tl.int64)
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
        ln_min_p = tl.where(min_p > 0, tl.log(tl.maximum(min_p, 2.2250738585072014e-308)), float("-inf"))
        m64 = m.to(tl.float64)
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
        u = _philox_uniform(tl.load(streams_ptr + row * 2), tl.load(streams_ptr + row * 2 + 1))
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
    tl.store(cuts_ptr + row * 2, count)
    tl.store(cuts_ptr + row * 2 + 1, last)


def sample_rows(
    logits: torch.Tensor,  # [rows, vocab]
    settings: torch.Tensor,  # fp64 [rows, 4]: temperature (0: greedy), top_p, min_p, top_k (<= 0: off)
    streams: torch.Tensor,  # int64 [rows, 2]: Philox key and counter
    masks: torch.Tensor | None,  # int32 [rows, ceil(vocab / 32)]: allowed-token bits, or None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token (int64 [rows]) and what the rule kept (int64 [rows, 2]: how many tokens, and the last
    of them in the order), on the logits' device."""
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
    cuts = torch.empty(rows, 2, dtype=torch.int64, device=device)
    if rows:
        _sample_kernel[(rows,)](
            tokens,
            cuts,
            logits,
            tokens if masks is None else masks,
            settings,
            streams,
            vocab,
            logits.stride(0),
            0 if masks is None else masks.stride(0),
            HAS_MASK=masks is not None,
            BLOCK=16384 if interpreting() else 1024,  # the interpreter's numpy likes long tiles
            NT=NT,
        )
    return tokens, cuts
