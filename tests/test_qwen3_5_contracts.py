"""Qwen3.5's names where they leave homegym: LoRA on the Gated DeltaNet projections, and the
tensor names SGLang 0.5.18 loads (read from its wheel's source, as tests/sglang_source.py
does for the HTTP contract)."""

import ast
import re
import typing

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.modeling.hybrid import use_homegym_gdn
from train_batches import make_config

GDN_TARGETS = ["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
               "gate_proj", "up_proj", "down_proj"]


def test_lora_on_gated_deltanet_projections_merges_to_the_same_model(tiny_qwen3_5_path):
    """LoRA on the GDN projections (in_proj_qkv, in_proj_z, out_proj) as well as attention
    and MLP: homegym's GDN runs through peft's layers, and the merged weights (what engines
    receive) give the adapted model's logits."""
    from trainer.training.backends.lora import apply_lora, merged_tensors

    lora = make_config(train={"lora": {"rank": 4, "alpha": 8, "target_modules": GDN_TARGETS}}).train.lora
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32)
    use_homegym_gdn(model)
    layers = apply_lora(model, lora)
    gdn = {n.rsplit(".", 1)[-1] for n in layers if ".linear_attn." in n}
    assert gdn == {"in_proj_qkv", "in_proj_z", "out_proj"}
    assert {n.split(".")[2] for n in layers if ".linear_attn." in n} == {"0", "1", "2"}
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 250, 11]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = dict(merged_tensors(((n, t.clone()) for n, t in model.state_dict().items()),
                                     layers))
    plain = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32)
    plain.load_state_dict(merged, strict=False)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path, dtype=torch.float32)(
            input_ids=ids).logits
        got = plain(input_ids=ids).logits
    assert (adapted - base).abs().max() > 1e-3  # the adapters do change the model
    assert (got - adapted).abs().max() <= 1e-5


# ---------------------------------------------------------------- SGLang's load_weights

SGLANG = "0.5.18"
QWEN3_5 = "sglang/srt/models/qwen3_5.py"
QWEN2_MOE = "sglang/srt/models/qwen2_moe.py"


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes its __init__ assigns (``self.X = ...``)."""
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name) and t.value.id == "self"}


class _Param:
    def __init__(self, name, loads):
        self.name, self.loads = name, loads
        self.weight_loader = lambda param, tensor, shard=None: loads.append((name, shard))


def _run_load_weights(source: str, names: list[str], tie: bool) -> tuple[list, list]:
    """Run SGLang's own ``Qwen3_5ForConditionalGeneration.load_weights`` on ``names``;
    every parameter it asks for exists (``dict`` in its globals records the lookups).
    Returns (loads as (SGLang parameter, shard id), warnings)."""
    tree = ast.parse(source)
    fn = next(n for n in _class(tree, "Qwen3_5ForConditionalGeneration").body
              if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    loads, warnings = [], []

    class AnyParams(dict):
        def __contains__(self, key):
            return True

        def __missing__(self, key):
            return _Param(key, loads)

    class Logger:
        def warning(self, msg, *args):
            warnings.append(msg % args if args else msg)

    class Identity:
        @staticmethod
        def apply(weights):
            return weights

    namespace = {
        "Iterable": typing.Iterable, "Tuple": typing.Tuple, "Set": typing.Set, "torch": torch,
        "dict": AnyParams,
        "QWEN3_5_KV_SCALE_MAPPER": Identity(), "logger": Logger(), "_is_cpu": False,
        "_is_amx_available": False,
        "get_layer_id": lambda n: int(m.group(1)) if (m := re.search(r"layers\.(\d+)\.", n)) else None,
        "default_weight_loader": lambda param, tensor: loads.append((param.name, None)),
    }
    exec(compile(ast.Module([fn], []), QWEN3_5, "exec"), namespace)

    class Pipeline:
        is_last_rank = True

    class Self:
        config = type("Config", (), {"tie_word_embeddings": tie})()
        pp_group = Pipeline()

        def named_parameters(self, remove_duplicate=True):
            return []

    namespace["load_weights"](Self(), [(n, torch.zeros(1)) for n in names])
    return loads, warnings


def test_exported_names_are_what_sglang_loads(tiny_qwen3_5_path, sglang_wheels):
    """Every tensor of homegym's Qwen3.5 export goes, through SGLang 0.5.18's own
    load_weights, to a parameter its modules declare: GDN projections into the fused
    in_proj_qkvz / in_proj_ba shards, attention into qkv_proj, A_log / dt_bias / conv1d /
    the gated norm as they are; the MTP layer is skipped (the draft model loads it) and the
    vision tower goes to ``visual``."""
    from trainer.driver.hf_export import base_tensor_files

    try:
        source = sglang_wheels.source_text(SGLANG, QWEN3_5)
        moe = sglang_wheels.source_text(SGLANG, QWEN2_MOE)
    except sglang_wheels.SglangSourceUnavailable as err:
        pytest.skip(f"no SGLang {SGLANG} wheel: {err}")
    names = sorted(base_tensor_files(tiny_qwen3_5_path))  # what an export holds
    loads, warnings = _run_load_weights(source, names, tie=True)
    assert not warnings, warnings
    tree, moe_tree = ast.parse(source), ast.parse(moe)
    owners = [  # SGLang parameter path -> the class whose __init__ declares it
        (r"^model\.layers\.\d+\.linear_attn\.(\w+)", _attributes(_class(tree, "Qwen3_5GatedDeltaNet"))),
        (r"^model\.layers\.\d+\.mlp\.(\w+)", _attributes(_class(moe_tree, "Qwen2MoeMLP"))),
        (r"^model\.layers\.\d+\.(\w+)\.", _attributes(_class(tree, "Qwen3_5AttentionDecoderLayer"))
         | _attributes(_class(tree, "Qwen3_5LinearDecoderLayer"))),
        (r"^model\.(\w+)\.", _attributes(_class(tree, "Qwen3_5ForCausalLM"))),
        (r"^(lm_head)\.", {"lm_head"}),
        (r"^(visual)\.", {"visual"}),
    ]
    loaded = {}
    for param, shard in loads:
        loaded.setdefault(param, []).append(shard)
        for pattern, declared in owners:
            if m := re.match(pattern, param):
                assert m.group(1) in declared, param
                break
        else:
            pytest.fail(f"SGLang loads {param!r}: no module of its Qwen3.5 declares it")
    text = [n for n in names if n.startswith("model.language_model.")]
    assert len(loads) == len(text) + sum(n.startswith("model.visual.") for n in names) + 1  # + tied lm_head
    gdn = "model.layers.0.linear_attn."
    assert set(loaded[gdn + "in_proj_qkvz.weight"]) == {(0, 1, 2), 3}  # qkv, then z
    assert sorted(loaded[gdn + "in_proj_ba.weight"]) == [0, 1]
    assert sorted(loaded["model.layers.3.qkv_proj.weight"]) == ["k", "q", "v"]
    assert {gdn + s for s in ("A_log", "dt_bias", "conv1d.weight", "norm.weight")} <= set(loaded)
    assert not [p for p in loaded if p.startswith("mtp") or ".mtp." in p]


def test_a_push_casts_to_the_engines_dtype_but_keeps_a_log_fp32(tiny_qwen3_5_path):
    """What send_weights puts on the wire for a bf16 engine: every tensor of the model in
    bf16 except each Gated DeltaNet's A_log, which stays fp32 as SGLang holds it (a backend
    yields it fp32; a cast of the whole bucket would round it through bf16)."""
    from trainer.weight_sync.push import cast_bucket

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_5_path)
    bucket = cast_bucket(list(model.state_dict().items()), torch.bfloat16)
    kept = {n for n, t in bucket if t.dtype == torch.float32}
    assert kept and kept == {n for n, _ in bucket if n.endswith(".A_log")}
    assert all(t.dtype == torch.bfloat16 for n, t in bucket if n not in kept)
    state = model.state_dict()
    assert all(torch.equal(t, state[n]) for n, t in bucket if n in kept)
