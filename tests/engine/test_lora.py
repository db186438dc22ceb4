"""LoRA adapters over one base model: our greedy tokens under a PEFT adapter equal `transformers` + `peft`'s,
alone and in a step that mixes other adapters and the base; the prefix cache never gives one adapter's blocks
to another; a bad adapter is refused naming it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from minibatch.engine.core.admission import RequestRejected
from minibatch.engine.core.sampling_params import SamplingParams
from minibatch.engine.factory import EngineConfig, build_engine
from minibatch.engine.lora.adapter import LoraError, load_adapter, load_peft
from minibatch.engine.lora.names import lora_uses
from minibatch.kernels.cpu import extension as cpu_ext
from tests.conftest import make_lora, write_gguf_lora
from tests.engine.test_batch_invariance import use_build

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (target modules, rank, alpha, rsLoRA, seed)
ADAPTERS = {
    "both": (ATTENTION + MLP, 8, 16, False, 1),
    "attn": (["q_proj", "v_proj", "o_proj"], 4, 8, False, 2),
    "mlp": (MLP, 16, 4, True, 3),
}
PROMPTS = [[1, 520, 3041, 77, 12, 907, 44, 8, 19002, 600, 31, 5], [1, 9, 4000, 4001, 4002, 10, 11, 700]]
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_chat_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {n: make_lora(tiny_chat_model_dir, root / n, *spec) for n, spec in ADAPTERS.items()}


def _reference(base_dir, adapter_dir, prompt) -> list[int]:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = base if adapter_dir is None else peft.PeftModel.from_pretrained(base, adapter_dir)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def references(tiny_chat_model_dir, adapters):
    out = {}
    for name in (None, *ADAPTERS):
        for p, prompt in enumerate(PROMPTS):
            out[(name, p)] = _reference(tiny_chat_model_dir, None if name is None else adapters[name], prompt)
    return out


def uses(name: str | None, scale: float = 1.0):
    return () if name is None else lora_uses([(name, scale)])


def _engine(model_dir, adapters, **kw):
    cfg = dict(dtype="float32", weights="native-exact", max_num_seqs=16, num_kv_blocks=200, max_wait_ms=0)
    eng = build_engine(EngineConfig(model=str(model_dir), **{**cfg, **kw}))
    for name, path in adapters.items():
        eng.add_lora(load_peft(path, name, eng.runner.model.config))
    return eng


def _run(eng, asks: list[tuple[str, str | None, int]]) -> dict[str, list[int]]:
    """Every (request id, adapter, prompt index) submitted at once, run to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    reqs = [eng.add_request(rid, PROMPTS[p], params, loras=uses(name)) for rid, name, p in asks]
    while eng.has_work():
        eng.step()
    assert eng.scheduler.blocks.num_used_blocks == 0
    return {r.request_id: list(r.output_token_ids) for r in reqs}


def test_the_adapters_change_the_answer(references):
    """(else parity below would hold for an adapter that is never applied)"""
    for name in ADAPTERS:
        assert references[(name, 0)] != references[(None, 0)], name


@pytest.fixture(params=["this-cpu:ngram", "avx2:off", "portable:off", "twins:off"])
def kernels(request):
    """The kernels the engine runs on (this CPU's build, AVX2's, the portable one, or the PyTorch twins alone),
    and whether it speculates (ngram: verify rows under adapters too)."""
    build, _, speculative = request.param.partition(":")
    if build == "twins":
        mp = pytest.MonkeyPatch()
        mp.setenv("MINIBATCH_CPU_KERNELS", "0")
        mp.setattr(cpu_ext, "_ext", None)
        mp.setattr(cpu_ext, "_tried", False)
        assert cpu_ext.load_cpu_extension() is None
        yield speculative
        mp.undo()
    else:
        yield from (speculative for _ in use_build(build))


def test_each_adapter_alone_and_mixed_in_one_batch_equals_peft(tiny_chat_model_dir, adapters, references, kernels):
    eng = _engine(tiny_chat_model_dir, adapters, speculative=kernels, enable_prefix_caching=False)
    for name in (None, *ADAPTERS):  # alone
        got = _run(eng, [("a", name, 0)])["a"]
        assert got == references[(name, 0)], name
    # every adapter and the base in one batch, both prompts each: prefill and decode rows of four kinds per step
    asks = [(f"{name}-{p}", name, p) for name in (None, *ADAPTERS) for p in range(len(PROMPTS))]
    got = _run(eng, asks)
    for rid, name, p in asks:
        assert got[rid] == references[(name, p)], rid


def test_the_prefix_cache_never_mixes_adapters(tiny_chat_model_dir, adapters, references):
    eng = _engine(tiny_chat_model_dir, adapters, speculative="off")
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prompt = PROMPTS[0] * 3  # two full blocks of 16 and more

    def once(rid: str, name: str | None):
        r = eng.add_request(rid, prompt, params, loras=uses(name))
        while eng.has_work():
            eng.step()
        return r

    first = once("base", None)
    assert once("both", "both").num_cached_tokens == 0  # the base's blocks are not the adapter's
    assert once("attn", "attn").num_cached_tokens == 0  # nor another adapter's
    again = once("both-again", "both")
    assert again.num_cached_tokens >= 32  # its own are
    assert once("base-again", None).num_cached_tokens >= 32
    assert first.output_token_ids != again.output_token_ids


def test_an_unknown_adapter_is_refused_naming_it(tiny_chat_model_dir, adapters):
    eng = _engine(tiny_chat_model_dir, {})
    with pytest.raises(RequestRejected, match="no LoRA adapter named 'nope'") as err:
        eng.add_request("x", PROMPTS[0], SamplingParams(max_tokens=2), loras=uses("nope"))
    assert err.value.status == 404 and err.value.field == "model"
    assert not eng.has_work()


def test_an_adapter_let_go_and_read_again_leaves_the_others_as_they_were(tiny_chat_model_dir, adapters, references):
    """What --max-loras does between steps: an adapter removed (refused while a request runs under it) takes its
    memory with it, the others' rows keep their answers, and read again (into another slot) it answers as before."""
    eng = _engine(tiny_chat_model_dir, adapters)
    names = list(ADAPTERS)
    first, rest = names[0], names[1:]
    full = eng.runner.lora_bytes()
    eng.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=2), loras=uses(first))
    with pytest.raises(RuntimeError, match="in use"):
        eng.remove_lora(first)
    while eng.has_work():
        eng.step()
    eng.remove_lora(first)
    assert 0 < eng.runner.lora_bytes() < full and first not in eng.loras
    with pytest.raises(RequestRejected, match=f"no LoRA adapter named {first!r}"):
        eng.add_request("gone", PROMPTS[0], SamplingParams(max_tokens=2), loras=uses(first))
    got = _run(eng, [(n, n, 1) for n in rest])
    assert all(got[n] == references[(n, 1)] for n in rest), got
    eng.add_lora(load_peft(adapters[first], first, eng.runner.model.config))  # now in the last slot
    got = _run(eng, [(n, n, 0) for n in names] + [("base", None, 0)])
    assert all(got[n] == references[(n, 0)] for n in names) and got["base"] == references[(None, 0)], got


def test_bad_adapters_are_refused_at_load_with_the_reason(tiny_chat_model_dir, adapters, tmp_path):
    cfg = build_engine(
        EngineConfig(model=str(tiny_chat_model_dir), dtype="float32", weights="native-exact", num_kv_blocks=16)
    ).runner.model.config
    with pytest.raises(LoraError, match="adapter 'x': not a LoRA adapter"):
        load_peft(tiny_chat_model_dir, "x", cfg)  # a model folder
    with pytest.raises(LoraError, match="rank 16 is past --max-lora-rank 8"):
        load_peft(adapters["mlp"], "big", cfg, max_rank=8)
    # an adapter of another model: the shapes name the module and the layer
    wide = tmp_path / "wide"
    shutil.copytree(adapters["attn"], wide)
    weights = load_file(wide / "adapter_model.safetensors")
    key = next(k for k in weights if "q_proj.lora_A" in k)
    weights[key] = torch.zeros(weights[key].shape[0], 96)
    save_file(weights, wide / "adapter_model.safetensors")
    with pytest.raises(LoraError, match=r"adapter 'wide': layer \d q_proj: A \(4, 96\).*an adapter of another model"):
        load_peft(wide, "wide", cfg)
    dora = tmp_path / "dora"
    shutil.copytree(adapters["attn"], dora)
    conf = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(LoraError, match="adapter 'dora': DoRA"):
        load_peft(dora, "dora", cfg)


def _reference_mixed(base_dir, adapters: dict, scales: dict[str, float], prompt) -> list[int]:
    """peft with these adapters active at once, each B times its scale: what llama-server's `lora` list asks."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    names = list(scales)
    model = peft.PeftModel.from_pretrained(base, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            for name, scale in scales.items():
                if f"lora_B.{name}." in pname:
                    p.mul_(scale)
    model.base_model.set_adapter(names)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_scales_and_several_adapters_on_one_row_equal_peft(tiny_chat_model_dir, adapters, references):
    half = _reference_mixed(tiny_chat_model_dir, adapters, {"both": 0.5}, PROMPTS[0])
    pair = _reference_mixed(tiny_chat_model_dir, adapters, {"attn": 0.7, "mlp": 1.3}, PROMPTS[0])
    assert half != references[("both", 0)] and half != references[(None, 0)]
    eng = _engine(tiny_chat_model_dir, adapters, speculative="off")
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    asks = {
        "half": lora_uses([("both", 0.5)]),
        "pair": lora_uses([("mlp", 1.3), ("attn", 0.7)]),
        "one": lora_uses([("both", 1.0)]),
        "zero": lora_uses([("both", 0.0)]),  # scale 0: the base model, and its cache namespace
    }
    reqs = {k: eng.add_request(k, PROMPTS[0], params, loras=v) for k, v in asks.items()}
    while eng.has_work():
        eng.step()
    got = {k: list(r.output_token_ids) for k, r in reqs.items()}
    assert got == {"half": half, "pair": pair, "one": references[("both", 0)], "zero": references[(None, 0)]}
    # the timeline names each row's adapters (the chat's panel marks them)
    first = eng.timeline.since(0)[0]
    assert dict(first.adapters) == {"half": "both", "pair": "attn+mlp", "one": "both"}
    assert first.as_dict()["adapters"] == {"half": "both", "one": "both", "pair": "attn+mlp"}
    with pytest.raises(ValueError, match="must be a finite number"):
        lora_uses([("both", float("nan"))])


def test_a_gguf_adapter_as_llama_cpp_writes_it_runs_as_its_peft_folder(
    tiny_chat_model_dir, adapters, references, tmp_path
):
    """llama.cpp's layout: its names, f32, Q's and K's B rows permuted (undone at load, as the base's are)."""
    files = {n: write_gguf_lora(adapters[n], tmp_path / f"{n}.gguf", "llama", 4, 2) for n in ("both", "attn")}
    eng = _engine(tiny_chat_model_dir, {})
    for name, path in files.items():
        eng.add_lora(load_adapter(path, name, eng.runner.model.config))
    got = _run(eng, [(n, n, 0) for n in files])
    assert got == {n: references[(n, 0)] for n in files}
    qwen = write_gguf_lora(adapters["attn"], tmp_path / "qwen.gguf", "qwen2", 4, 2)
    with pytest.raises(LoraError, match="adapter 'q': an adapter of a qwen2 model; the base is llama"):
        load_adapter(qwen, "q", eng.runner.model.config)
    with pytest.raises(LoraError, match="adapter 'm': not a LoRA adapter"):
        load_adapter(next(tiny_chat_model_dir.glob("*.safetensors")), "m", eng.runner.model.config)
