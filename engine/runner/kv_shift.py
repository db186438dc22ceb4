"""Rows of the paged cache copied to new positions (shifted reuse, engine/core/kv_reuse.py): V as it is, K turned
by the rotary angle of the shift.

A cached key is its head's projection turned by the angle of its position, p * f for each frequency f (times
LongRoPE's attention factor, a scale that commutes with turning). Turning it again by d * f gives the key at
p + d: the two rotations compose into one, exactly in real arithmetic. The second turn is done in float64 from
the row as the cache holds it, then stored back in the cache's type: in f32 the moved key differs from one
computed at p + d by the rounding of that one step (a few units in the last place), in f16/bf16 by one more
rounding to the type, in a block type (q8_0 .. iq4_nl) by one more quantization of its 32 values (a type that
keeps K Hadamard-turned is turned back before the rotary turn and again after).
Each layer turns with its own rotary (Gemma's sliding layers have a base of their own). The PyTorch ops run on
any device; there is one call per step that admits a request with reuse, a few thousand rows.
"""

from __future__ import annotations

import torch

from minibatch.engine.models.llama import LlamaForCausalLM, rope_inv_freq
from minibatch.kernels.kv_types import PagedKV, from_cache_ref, hadamard_ref, rotation, store_ref, type_of


class KeyShifter:
    def __init__(self, model: LlamaForCausalLM, caches: list[PagedKV]) -> None:
        self.model, self.caches = model, caches

    def _inv_freqs(self, device) -> list[torch.Tensor]:
        """Each layer's frequencies, in float64, as its rotary tables were built."""
        cfg, out, seen = self.model.config, [], {}
        for layer in self.model.model.layers:
            rotary = layer.self_attn.rotary
            key = id(rotary), rotary.long
            if key not in seen:
                seen[key] = rope_inv_freq(rotary.rope, cfg.head_dim, rotary.long).to(device).double()
            out.append(seen[key])
        return out

    @torch.inference_mode()
    def apply(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy each (source slot, slot, shift) row of every layer's cache."""
        if not moves:
            return
        device = self.caches[0].k.device
        table = torch.tensor(moves, dtype=torch.int64, device=device)
        src, dst, shift = table[:, 0], table[:, 1], table[:, 2].double()
        turns = {}
        head_dim = self.model.config.head_dim
        for kv, inv_freq in zip(self.caches, self._inv_freqs(device)):
            if id(inv_freq) not in turns:
                angle = shift[:, None] * inv_freq[None, :]  # [rows, head_dim / 2]
                turns[id(inv_freq)] = angle.cos()[:, None, :], angle.sin()[:, None, :]
            cos, sin = turns[id(inv_freq)]
            keys = kv.k.view(-1, *kv.k.shape[2:])  # [slots, kv_heads, row]
            k_type = type_of(kv.k, head_dim)
            rot = rotation(k_type, head_dim, "k")  # a type that keeps K Hadamard-turned: turned back first
            x = hadamard_ref(from_cache_ref(keys[src], head_dim), rot).double()
            x1, x2 = x.chunk(2, dim=-1)
            turned = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            keys[dst] = store_ref(turned.float(), k_type, "k")
            values = kv.v.view(-1, *kv.v.shape[2:])
            values[dst] = values[src]
