"""A LoRA adapter read from a Hugging Face PEFT folder (`adapter_config.json` beside
`adapter_model.safetensors`) and checked against the base model it is to run over.

PEFT adds `scaling * B(A(x))` to each projection it targets (scaling `alpha / r`, rsLoRA's `alpha / sqrt(r)`).
Our decoder runs q/k/v and gate/up as one stacked matrix each (models/llama.py), so an adapter is kept the
same way: per layer and stacked projection, the A matrices of its targeted parts one above the other
([ranks, in]) and their B matrices as one block-diagonal matrix ([out, ranks]) with the scaling folded in. A
part the adapter leaves out has no rows in A and zero columns in B."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from minibatch.engine.models.config import ModelConfig, ModelSettingError

# our stacked projections and the Hugging Face modules they stack, in the order of their output rows
STACKS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULES = tuple(m for parts in STACKS.values() for m in parts)
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraError(ModelSettingError):
    """An adapter that cannot run over this base model; the message names the adapter and the reason, never its
    path (the daemon shows it to the request that loaded the model)."""


@dataclass(slots=True, frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the largest rank of its modules
    targets: tuple[str, ...]  # the Hugging Face modules it changes (q_proj, ..., down_proj)
    # (layer, stack) -> (A [ranks, in], B [out, ranks] with the scaling folded in), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: bytes  # of its weights and scaling: what the prefix caches key its blocks by

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def to(self, device: torch.device, dtype: torch.dtype = torch.float32) -> LoraAdapter:
        moved = {k: (a.to(device, dtype), b.to(device, dtype)) for k, (a, b) in self.weights.items()}
        return LoraAdapter(self.name, self.rank, self.targets, moved, self.digest)


def _out_sizes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each Hugging Face module's (in, out) in this base."""
    q, kv, h, i = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def load_peft(path: str | Path, name: str, cfg: ModelConfig, max_rank: int = 0) -> LoraAdapter:
    """The PEFT adapter in folder `path`, checked against `cfg` (the base's shapes); `max_rank` > 0: the
    largest rank allowed. Raises LoraError naming `name` and what is wrong."""
    from safetensors.torch import load_file

    folder = Path(path)

    def fail(why: str) -> LoraError:
        return LoraError(f"adapter {name!r}: {why}")

    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise fail("not a LoRA adapter (a PEFT folder has adapter_config.json and adapter_model.safetensors)")
    try:
        conf = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise fail(f"adapter_config.json is not JSON ({exc})") from None
    if str(conf.get("peft_type", "LORA")).upper() != "LORA":
        raise fail(f"a {conf.get('peft_type')} adapter, not LoRA")
    for key, why in (
        ("use_dora", "DoRA's magnitude vectors"),
        ("modules_to_save", "whole modules saved beside it (its own embeddings or head)"),
        ("rank_pattern", "ranks per module"),
        ("alpha_pattern", "alphas per module"),
    ):
        if conf.get(key):
            raise fail(f"{why} ({key}) are not supported")
    if conf.get("bias", "none") != "none":
        raise fail(f"trained biases (bias: {conf['bias']!r}) are not supported")
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise fail(f"adapter_model.safetensors cannot be read ({type(exc).__name__})") from None
    sizes = _out_sizes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise fail(f"a weight our decoder has no place for: {key}")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in sizes:
            raise fail(f"it changes {module}, which this base has not (LoRA runs on {', '.join(MODULES)})")
        if layer >= cfg.num_layers:
            raise fail(f"it changes layer {layer}; the base has {cfg.num_layers} layers")
        parts.setdefault((layer, module), {})[ab] = tensor.float()
    if not parts:
        raise fail("it holds no LoRA weights")
    alpha = float(conf.get("lora_alpha", conf.get("r", 8)))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    digest = hashlib.blake2b(digest_size=16, person=b"minibatch-lora")
    for layer in range(cfg.num_layers):
        for stack, modules in STACKS.items():
            present = [m for m in modules if (layer, m) in parts]
            if not present:
                continue
            a_rows, b_blocks = [], []
            for module in present:
                ab = parts[(layer, module)]
                if set(ab) != {"A", "B"}:
                    raise fail(f"layer {layer} {module} has lora_{next(iter(ab))} without its pair")
                a, b = ab["A"], ab["B"]
                n_in, n_out = sizes[module]
                r = a.shape[0]
                if a.shape != (r, n_in) or b.shape != (n_out, r):
                    raise fail(
                        f"layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit this base "
                        f"({n_in} in, {n_out} out): an adapter of another model"
                    )
                if max_rank and r > max_rank:
                    raise fail(f"rank {r} is past --max-lora-rank {max_rank}")
                rank = max(rank, r)
                scaling = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
                a_rows.append(a)
                b_blocks.append((module, b * scaling))
            a_cat = torch.cat(a_rows)
            outs = [sizes[m][1] for m in modules]
            b_cat = torch.zeros(sum(outs), a_cat.shape[0])
            col = 0
            for module, b in b_blocks:
                row = sum(outs[: modules.index(module)])
                b_cat[row : row + b.shape[0], col : col + b.shape[1]] = b
                col += b.shape[1]
            weights[(layer, stack)] = (a_cat.contiguous(), b_cat)
            for t in (a_cat, b_cat):
                digest.update(t.numpy().tobytes())
            digest.update(f"{layer}{stack}{present}".encode())
    targets = tuple(m for m in MODULES if any(k[1] == m for k in parts))
    return LoraAdapter(name, rank, targets, weights, digest.digest())
