"""Chats with an image, on minibatchd and then on llama.cpp's llama-server `--mmproj`, with the same files and
threads, one server at a time: time to first token with one image; tokens/s with one image chat and with
--clients at once (each its own image); and a text-only chat's time to first token alone and beside those
image chats' encoding.

The model is a random vision model of --shape (scripts/dev/make_vision_model.py: `gemma3-896`, Gemma 3's own
SigLIP tower at 896 px over Gemma-3-1B's text shape; `smolvlm-256m`, SmolVLM-256M's, whose processor cuts a
picture into 512-px tiles and the whole, over SmolLM2-135M's text shape) unless --text and --mmproj give GGUF
files; llama.cpp's `convert_hf_to_gguf.py` (--convert) makes the text GGUF (--outtype) and the mmproj (F16)
from the folder, and both servers load those. Without them, minibatchd serves the folder itself and
llama-server is not run. Every image is a different random picture (no server answers one from a cache), sent
as a base64 data: URL to `/v1/chat/completions`, streamed, sampled with llama-server's defaults and --tokens
tokens long (ignoring EOS).

  .venv/bin/python scripts/features/bench_vision.py --convert PATH/convert_hf_to_gguf.py --llama-server PATH
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadgen import session  # noqa: E402
from peers import Launch, Running, llamacpp  # noqa: E402
from peers import minibatch as ours  # noqa: E402
from peers.compare import wait_ready  # noqa: E402

DEV = Path(__file__).resolve().parents[1] / "dev"
sys.path.insert(0, str(DEV))
from make_vision_model import SHAPES, SMOL_SHAPES  # noqa: E402

SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}  # llama-server's defaults
QUESTION = "Describe this picture in detail."


def picture(seed: int, side: int) -> str:
    """A random picture as a PNG data: URL."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def files(args, cache: Path) -> tuple[Path, Path | None, Path | None]:
    """(the folder, the text GGUF, the mmproj GGUF): made once under `cache` unless given."""
    if args.text is not None:
        return args.text.parent, args.text, args.mmproj
    folder = cache / f"{args.shape}-vision"
    if not (folder / "config.json").is_file():
        cmd = [sys.executable, str(DEV / "make_vision_model.py"), "--shape", args.shape, "--out", str(folder)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    if args.convert is None:
        return folder, None, None
    text = cache / f"{args.shape}-text-{args.outtype}.gguf"
    mmproj = cache / f"{args.shape}-mmproj-f16.gguf"
    env = {**os.environ, "PYTHONPATH": str(Path(args.convert).parent / "gguf-py")}
    text_folder = _llama_view(folder) if args.shape in SMOL_SHAPES else folder
    for out, source, extra in ((text, text_folder, ["--outtype", args.outtype]), (mmproj, folder, ["--mmproj"])):
        if not out.is_file():
            cmd = [sys.executable, str(args.convert), str(source), "--outfile", str(out), *extra]
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return folder, text, mmproj


def _llama_view(folder: Path) -> Path:
    """A SmolVLM folder's text model as a Llama folder beside it (its text config, the same files): the
    converter takes Idefics3's folders for the tower only, and reads `model.text_model.*` as a Llama's."""
    view = folder.with_name(folder.name + "-text")
    view.mkdir(exist_ok=True)
    cfg = json.loads((folder / "config.json").read_text())
    (view / "config.json").write_text(json.dumps({**cfg["text_config"], "architectures": ["LlamaForCausalLM"]}))
    for f in folder.iterdir():
        if f.name != "config.json" and not (view / f.name).exists():
            (view / f.name).symlink_to(f)
    return view


async def _greedy(s, image: str, tokens: int, name: str, shape: str) -> list[int]:
    """The greedy tokens of one picture through llama-server's /completion with multimodal_data."""
    async with s.get("/props") as r:  # (the newest llama-server's marker is its own, drawn at its start)
        marker = (await r.json())["media_marker"]
    if shape in SMOL_SHAPES:  # (both servers lay out SmolVLM's tiles around the marker themselves)
        prompt = f"<|im_start|>User:{marker}{QUESTION}<end_of_utterance>\nAssistant:"
    else:
        if name == "llama.cpp":
            marker = f"\n\n{marker}\n\n"
        prompt = f"<start_of_turn>user\n{marker}{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    body = {"prompt": {"prompt_string": prompt, "multimodal_data": [image.split(",", 1)[1]]}, "n_predict": tokens}
    body |= {"temperature": 0.0, "ignore_eos": True, "return_tokens": True}
    async with s.post("/completion", json=body) as r:
        answer = await r.json()
        if r.status != 200:
            raise RuntimeError(f"/completion: {r.status} {answer}")
    return answer.get("tokens") or []


def tower_side(folder: Path, mmproj: Path | None) -> int:
    """The side, in pixels, the tower sees a picture at: the mmproj's, else the folder's config's."""
    if mmproj is not None:
        import gguf

        return int(gguf.GGUFReader(str(mmproj)).fields["clip.vision.image_size"].contents())
    return json.loads((folder / "config.json").read_text())["vision_config"]["image_size"]


async def _chat(s, image: str | None, tokens: int, seed: int, extra: dict) -> tuple[float, int, float]:
    """(seconds to the first token, tokens generated, seconds in all) of one streamed chat."""
    content: list[dict] = [{"type": "text", "text": QUESTION}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": tokens, "stream": True}
    body |= {**SAMPLED, "seed": seed, "ignore_eos": True, **extra}
    t0 = time.perf_counter()
    first, n = None, 0
    async with s.post("/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"/v1/chat/completions: {r.status} {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                n += 1
    end = time.perf_counter()
    return (first or end) - t0, n, end - t0


async def side(name: str, launch: Launch, target: dict, work: Path, args, side_px: int) -> dict:
    running = Running(launch, work / f"{name}.log")
    seed = iter(range(1000, 10**6))
    # (llama-server: its slots' prompt cache off, as the pictures differ anyway; minibatchd has no such field)
    extra = {"cache_prompt": False} if name == "llama.cpp" else {}

    def chat(s, image, tokens, k):
        return _chat(s, image, tokens, k, extra)

    try:
        await wait_ready(running, target, timeout=900)
        async with session(**target) as s:
            await chat(s, picture(next(seed), side_px), 2, 0)  # warm-up: one image through, seen once
            text_alone = statistics.median([(await chat(s, None, 4, k))[0] for k in range(3)])
            ttft = [(await chat(s, picture(next(seed), side_px), 1, k))[0] for k in range(args.repeats)]
            first, n, total = await chat(s, picture(next(seed), side_px), args.tokens, 1)
            one = {"tokens_s": round(n / total, 2), "ttft_s": round(first, 2), "seconds": round(total, 1)}
            images = [picture(next(seed), side_px) for _ in range(args.clients)]
            jobs = [asyncio.ensure_future(chat(s, im, args.tokens, k)) for k, im in enumerate(images)]

            async def text_later() -> float:  # the image chats are in; a text chat comes while they are encoded
                await asyncio.sleep(1.0)
                return (await chat(s, None, 4, 99))[0]

            *done, text_beside = await asyncio.gather(*jobs, text_later())
            wall = max(d[2] for d in done)  # (all started together: the last one's end)
            # greedy answers to the same pictures on one prompt layout (llama-server's: its marker with the blank
            # lines the model's processor puts around an image written out; ours puts them in itself)
            answers = [
                await _greedy(s, picture(500 + k, side_px), args.tokens, name, args.shape) for k in range(args.agree)
            ]
        many = {
            "tokens_s": round(sum(d[1] for d in done) / wall, 2),
            "ttft_s_median": round(statistics.median(d[0] for d in done), 2),
            "seconds": round(wall, 1),
        }
        return {
            "ttft_one_image_s": round(statistics.median(ttft), 2),
            "ttft_runs_s": [round(t, 2) for t in ttft],
            "one_chat": one,
            f"{args.clients}_chats": many,
            "text_ttft_alone_s": round(text_alone, 3),
            "text_ttft_beside_images_s": round(text_beside, 3),
            "greedy_answers": answers,
        }
    finally:
        running.stop()


def launches(args, folder: Path, text: Path | None, mmproj: Path | None, work: Path) -> list[tuple]:
    sock = str(work / "mb.sock")
    model = str(text or folder)
    mine = ours.launch(sock, "auto", args.clients, args.threads, model)
    mine.argv += ["--speculative", "off", "--max-image-pixels", str(64 * 2**20)]
    if mmproj is not None:
        mine.argv += ["--mmproj", str(mmproj)]
    out = [("minibatch", mine, {"socket": sock})]
    if args.exe is not None and text is not None and mmproj is not None:
        # each slot's context: a SmolVLM picture alone is up to 17 views of 64 positions and their tags
        ctx = 2048 if args.shape in SMOL_SHAPES else 1024
        argv = llamacpp.command(args.exe, text, args.port, args.clients, args.threads, ctx)
        argv += ["--mmproj", str(mmproj), "--no-mmproj-offload", "--jinja"]
        url = f"http://127.0.0.1:{args.port}"
        out.append(("llama.cpp", Launch(name="llama.cpp", argv=argv, url=url), {"url": url}))
    return out


async def main_async(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="mb-vision-", dir="/tmp"))
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    folder, text, mmproj = files(args, cache)
    side_px = args.image_px or tower_side(folder, mmproj)
    report: dict = {
        "model": (text or folder).name,
        "mmproj": mmproj.name if mmproj else None,
        "tower": {**SHAPES, **SMOL_SHAPES}[args.shape][1] if args.text is None else None,
        "image_px": side_px,
        "clients": args.clients,
        "tokens": args.tokens,
        "threads": args.threads,
    }
    for name, launch, target in launches(args, folder, text, mmproj, work):
        report[name] = await side(name, launch, target, work, args, side_px)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))  # (each side as it ends: a later failure keeps it)
    if "llama.cpp" in report:
        report["llama.cpp"]["version"] = llamacpp.server_version(args.exe)
        m, p = report["minibatch"], report["llama.cpp"]
        report["ttft_over_llama_cpp"] = round(m["ttft_one_image_s"] / p["ttft_one_image_s"], 2)
        key = f"{args.clients}_chats"
        report["chats_tokens_s_over_llama_cpp"] = round(m[key]["tokens_s"] / p[key]["tokens_s"], 2)
        same = [_common(a, b) for a, b in zip(m.pop("greedy_answers"), p.pop("greedy_answers"))]
        report["greedy_tokens_agreeing"] = same  # of --tokens, each picture: the answers' common start
    else:
        report["minibatch"].pop("greedy_answers")
    shutil.rmtree(work, ignore_errors=True)
    return report


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gemma3-896", choices=sorted([*SHAPES, *SMOL_SHAPES]))
    ap.add_argument("--text", type=Path, default=None, help="the text model's GGUF (with --mmproj)")
    ap.add_argument("--mmproj", type=Path, default=None, help="the tower's mmproj GGUF (with --text)")
    ap.add_argument("--convert", type=Path, default=None, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--outtype", default="q8_0", help="the text GGUF's type (the converter's --outtype)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/minibatch/bench-models"))
    ap.add_argument("--image-px", type=int, default=None, help="the pictures' side (default: the tower's)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="tokens a chat generates")
    ap.add_argument("--repeats", type=int, default=2, help="single-image first tokens timed")
    ap.add_argument("--agree", type=int, default=3, help="pictures whose greedy answers the two servers compare")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (else $LLAMA_SERVER or PATH)")
    ap.add_argument("--port", type=int, default=18962)
    ap.add_argument("--json", type=Path, default=Path("results/bench_vision.json"))
    args = ap.parse_args()
    if (args.text is None) != (args.mmproj is None):
        raise SystemExit("bench_vision: --text and --mmproj go together")
    found = args.llama_server or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    args.exe = llamacpp.find_server(args.llama_server) if found else None
    report = asyncio.run(main_async(args))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    key = f"{args.clients}_chats"
    print(
        f"| server | TTFT, one image (s) | one chat tok/s | {args.clients} chats tok/s | text TTFT alone / beside (s) |"
    )
    print("|---|---:|---:|---:|---|")
    for name in ("minibatch", "llama.cpp"):
        if name in report:
            r = report[name]
            print(
                f"| {name} | {r['ttft_one_image_s']} | {r['one_chat']['tokens_s']} | {r[key]['tokens_s']} | "
                f"{r['text_ttft_alone_s']} / {r['text_ttft_beside_images_s']} |"
            )
    if "greedy_tokens_agreeing" in report:
        print(f"greedy answers' tokens in common, of {args.tokens}: {report['greedy_tokens_agreeing']}")
    if "ttft_over_llama_cpp" in report:
        print(f"TTFT / llama.cpp's: {report['ttft_over_llama_cpp']}x; {args.clients} chats' tokens/s: "
              f"{report['chats_tokens_s_over_llama_cpp']}x")  # fmt: skip


if __name__ == "__main__":
    main()
