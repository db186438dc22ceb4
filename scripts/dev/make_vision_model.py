"""A random-weight vision model as a Hugging Face folder: Gemma 3 (transformers' Gemma3ForConditionalGeneration:
a SigLIP tower, Gemma 3's projector, a Gemma 3 text model), with the built-in model's tokenizer grown by Gemma
3's three image tokens (special, as in Gemma 3's own) and a chat template that writes `<start_of_image>` for an
image part, as Gemma 3's does; or SmolVLM (transformers' Idefics3ForConditionalGeneration: a SigLIP tower, the
pixel-shuffle connector, a Llama text model), with the built-in tokenizer grown by SmolVLM's image tokens
(`<fake_token_around_image>`, `<image>`, `<global-img>`, `<row_r_col_c>`, `<end_of_utterance>`) and SmolVLM's
chat template; its `smolvlm-256m` shape is SmolVLM-256M's (SmolLM2-135M's text shape). llama.cpp's
`convert_hf_to_gguf.py` converts the folder (the text model, and with `--mmproj` the tower; the files are
written under the hub checkpoints' tensor names, which it takes), so both servers of a benchmark can load the
same files.

  .venv/bin/python scripts/dev/make_vision_model.py --shape gemma3-896 --out ~/.cache/minibatch/bench-models/g3v
  .venv/bin/python scripts/dev/make_vision_model.py --shape smolvlm-256m --out ~/.cache/minibatch/bench-models/svlm
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_TEXT_COMMON = dict(
    rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4, hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=8192,
)  # fmt: skip
# Gemma 3 shapes (text config, vision config, image tokens): Gemma 3's own tower (SigLIP so400m at 896 px, 256
# tokens an image) over Gemma-3-1B's text shape; and a tiny one for the tests
SHAPES = {
    "gemma3-896": (
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            sliding_window_pattern=6,
        ),  # fmt: skip
        dict(
            hidden_size=1152,
            intermediate_size=4304,
            num_hidden_layers=27,
            num_attention_heads=16,
            image_size=896,
            patch_size=14,
        ),  # fmt: skip
        256,
    ),
    "tiny": (
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            sliding_window_pattern=2,
        ),  # fmt: skip
        dict(
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=64,
            patch_size=8,
        ),
        16,
    ),
}


def save_gemma3_vision(path: Path, tokenizer_dir: Path, shape: str = "tiny", seed: int = 5) -> Path:
    """The folder at `path`: random weights of `shape` (norms and projection given a trained model's spread,
    the projection rounded to F16, as an mmproj file keeps it) and `tokenizer_dir`'s tokenizer with the image
    tokens added."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    text_shape, vision_shape, tokens = SHAPES[shape]
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOI, EOI, IMAGE)])
    boi, eoi, image = (tok.token_to_id(t) for t in (BOI, EOI, IMAGE))
    torch.manual_seed(seed)
    cfg = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(vocab_size=image + 1, **_TEXT_COMMON, **text_shape),
        vision_config=dict(model_type="siglip_vision_model", vision_use_head=False, **vision_shape),
        mm_tokens_per_image=tokens,
        image_token_index=image,
        boi_token_index=boi,
        eoi_token_index=eoi,
    )
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "vision_tower" not in name:
                p.normal_(0.0, 0.3)
        proj = model.model.multi_modal_projector.mm_input_projection_weight
        proj.normal_(0, 0.3 if shape == "tiny" else 0.03)
        proj.copy_(proj.half().float())
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config.pop("add_bos_token", None)  # (llama.cpp's converter refuses it)
    config["extra_special_tokens"] = {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE}
    config["chat_template"] = TEMPLATE  # (where the converter reads it too)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    side = vision_shape["image_size"]
    prep = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": side, "width": side}}
    (path / "preprocessor_config.json").write_text(json.dumps(prep))
    if (tokenizer_dir / "generation_config.json").exists():
        shutil.copy(tokenizer_dir / "generation_config.json", path / "generation_config.json")
    return path


SMOL_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOL_TOKENS = (
    "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)  # fmt: skip
# SmolVLM shapes (text config, vision config, scale factor, the processor's longest edge): SmolVLM-256M's own
# (SigLIP base at 512 px in 16-px patches, 64 tokens a view, images resized to 2048 px a side at most and cut
# into 512-px tiles) over SmolLM2-135M's text shape; and a tiny one for the tests (4 tokens a view, up to 4 x 4
# tiles of 32 px)
SMOL_SHAPES = {
    "smolvlm-256m": (
        dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, rope_theta=100000.0),
        dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
             image_size=512, patch_size=16),
        4,
        2048,
    ),
    "smolvlm-tiny": (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, rope_theta=100000.0),
        dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             image_size=32, patch_size=8),
        2,
        128,
    ),
}  # fmt: skip


def save_smolvlm(path: Path, tokenizer_dir: Path, shape: str = "smolvlm-tiny", seed: int = 5) -> Path:
    """The folder at `path`: random weights of `shape` (the connector given a trained model's spread) and
    `tokenizer_dir`'s tokenizer with SmolVLM's image tokens added."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    text_shape, vision_shape, scale, longest = SMOL_SHAPES[shape]
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SMOL_TOKENS])
    image = tok.token_to_id("<image>")
    torch.manual_seed(seed)
    text = dict(
        model_type="llama", vocab_size=tok.get_vocab_size(), rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2, **text_shape,
    )  # fmt: skip
    cfg = transformers.Idefics3Config(
        text_config=text,
        vision_config=dict(model_type="idefics3_vision", **vision_shape),
        scale_factor=scale,
        image_token_id=image,
        tie_word_embeddings=False,
    )
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.model.connector.modality_projection.proj.weight.normal_(0, 0.3 if shape == "smolvlm-tiny" else 0.03)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)
    config.pop("add_bos_token", None)  # (llama.cpp's converter refuses it)
    config["chat_template"] = SMOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(SMOL_TEMPLATE)
    side = vision_shape["image_size"]
    prep = {
        "image_processor_type": "Idefics3ImageProcessor", "do_image_splitting": True, "resample": 1,
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "size": {"longest_edge": longest}, "max_image_size": {"longest_edge": side},
    }  # fmt: skip
    (path / "preprocessor_config.json").write_text(json.dumps(prep))
    tokens = (side // vision_shape["patch_size"]) ** 2 // scale**2
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": tokens}))
    if (tokenizer_dir / "generation_config.json").exists():
        shutil.copy(tokenizer_dir / "generation_config.json", path / "generation_config.json")
    return path


def hub_names(path: Path) -> None:
    """The folder's tensors under the names the hub's Gemma 3 checkpoints have (transformers 5 saves others, which
    llama.cpp's converter refuses for the tower); transformers and minibatch read both."""
    from safetensors.torch import load_file, save_file

    for f in sorted(path.glob("*.safetensors")):
        renamed = {}
        for name, t in load_file(f).items():
            name = name.removeprefix("model.")
            for part, hub in (("vision_tower.", "vision_model."), ("language_model.", "model.")):
                if name.startswith(part) and not name.startswith(part + hub):
                    name = part + hub + name.removeprefix(part)
            renamed[name] = t
        save_file(renamed, f, metadata={"format": "pt"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted([*SHAPES, *SMOL_SHAPES]), default="gemma3-896")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args()
    from minibatch.engine.store.cache import resolve_model

    started = time.perf_counter()
    if args.shape in SMOL_SHAPES:
        save_smolvlm(args.out, resolve_model("smollm2-135m-instruct"), args.shape, args.seed)
    else:
        save_gemma3_vision(args.out, resolve_model("smollm2-135m-instruct"), args.shape, args.seed)
        hub_names(args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"make_vision_model: {args.out} ({size / 1e6:.0f} MB) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
