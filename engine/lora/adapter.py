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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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
    weights_bytes: int = -1  # (-1: its weights' own count)

    @property
    def nbytes(self) -> int:
        """Bytes its weights take (fp32)."""
        if self.weights_bytes >= 0:
            return self.weights_bytes
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def without_weights(self) -> LoraAdapter:
        """Its facts alone (what a model keeps once the weights are stacked with the others')."""
        return LoraAdapter(self.name, self.rank, self.targets, {}, self.digest, self.nbytes)


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
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise fail(f"a weight our decoder has no place for: {key}")
        parts.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor.float()
    alpha = float(conf.get("lora_alpha", conf.get("r", 8)))
    rslora = bool(conf.get("use_rslora"))
    return _stacked(name, cfg, parts, lambda r: alpha / math.sqrt(r) if rslora else alpha / r, max_rank)


def load_gguf(path: str | Path, name: str, cfg: ModelConfig, max_rank: int = 0) -> LoraAdapter:
    """The LoRA adapter in the GGUF file `path` (what llama.cpp's convert_lora_to_gguf.py writes:
    `blk.N.attn_q.weight.lora_a` and `.lora_b`, `adapter.lora.alpha`; scaled by alpha / rank as llama.cpp
    does), checked against `cfg`. Q's and K's B rows are put back in Hugging Face's order where the converter
    permuted them (the `llama` architecture), as the base's are. Raises LoraError naming `name`."""
    import gguf

    from minibatch.engine.gguf.tensors import LAYER_NAMES, PERMUTED_ARCHS, unpermute_rows

    def fail(why: str) -> LoraError:
        return LoraError(f"adapter {name!r}: {why}")

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise fail(f"not a LoRA adapter (a file, but not GGUF: {type(exc).__name__})") from None

    def meta(key: str):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if meta("general.type") != "adapter" or meta("adapter.type") != "lora":
        raise fail(f"not a LoRA adapter (a GGUF of general.type {meta('general.type')!r})")
    arch = str(meta("general.architecture"))
    base = {"mistral": "llama", "gemma3_text": "gemma3"}.get(cfg.model_type, cfg.model_type)
    if arch != base:
        raise fail(f"an adapter of a {arch} model; the base is {cfg.model_type}")
    by_gguf = {k: v.rsplit(".", 1)[1] for k, v in LAYER_NAMES.items() if v.endswith("_proj")}  # attn_q: q_proj
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        bits = t.name.split(".")
        if len(bits) != 5 or bits[0] != "blk" or bits[3] != "weight" or bits[4] not in ("lora_a", "lora_b"):
            raise fail(f"a weight our decoder has no place for: {t.name}")
        module = by_gguf.get(bits[2])
        if module is None:
            raise fail(f"it changes {bits[2]}, which LoRA does not run on here ({', '.join(MODULES)})")
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        matrix = torch.from_numpy(values.reshape(tuple(int(d) for d in reversed(t.shape))).copy())
        if bits[4] == "lora_b" and arch in PERMUTED_ARCHS and module in ("q_proj", "k_proj"):
            heads = cfg.num_heads if module == "q_proj" else cfg.num_kv_heads
            if matrix.shape[0] == heads * cfg.head_dim:  # (else the shape check below names it)
                matrix = matrix[torch.from_numpy(unpermute_rows(matrix.shape[0], heads))]
        parts.setdefault((int(bits[1]), module), {})["A" if bits[4] == "lora_a" else "B"] = matrix
    alpha = meta("adapter.lora.alpha")
    return _stacked(name, cfg, parts, lambda r: float(alpha) / r if alpha else 1.0, max_rank)


def load_adapter(path: str | Path, name: str, cfg: ModelConfig, max_rank: int = 0) -> LoraAdapter:
    """A LoRA adapter from a PEFT folder or a llama.cpp GGUF file (load_peft, load_gguf)."""
    if Path(path).is_file():
        return load_gguf(path, name, cfg, max_rank)
    return load_peft(path, name, cfg, max_rank)


def _stacked(
    name: str,
    cfg: ModelConfig,
    parts: dict[tuple[int, str], dict[str, torch.Tensor]],
    scaling: Callable[[int], float],
    max_rank: int,
) -> LoraAdapter:
    """The adapter from its A and B matrices by (layer, Hugging Face module) in Hugging Face's row order and
    its scaling by rank, checked against `cfg`'s shapes."""

    def fail(why: str) -> LoraError:
        return LoraError(f"adapter {name!r}: {why}")

    if not parts:
        raise fail("it holds no LoRA weights")
    sizes = _out_sizes(cfg)
    for layer, module in parts:
        if module not in sizes:
            raise fail(f"it changes {module}, which this base has not (LoRA runs on {', '.join(MODULES)})")
        if layer >= cfg.num_layers:
            raise fail(f"it changes layer {layer}; the base has {cfg.num_layers} layers")
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
                scaled = b * scaling(r)
                if max(a.abs().max().item(), scaled.abs().max().item()) >= 65504 or not (
                    torch.isfinite(a).all() and torch.isfinite(scaled).all()
                ):
                    raise fail(f"layer {layer} {module} has values past float16's range, which adapters are kept in")
                rank = max(rank, r)
                a_rows.append(a)
                b_blocks.append((module, scaled))
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
