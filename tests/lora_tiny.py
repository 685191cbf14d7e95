"""Shared pieces of the LoRA / forecast tests: the tiny lora artifact's recipe, adapters and feeds."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from passes.lora_inputs import site_of
from toolchain.compile.pass_runner import ort_run
from toolchain.ir.graphset import GraphEntry
from toolchain.runtime.adapters import Adapter, write_rows, write_slots

M = 2  # forecast slots of the tiny artifact; its tree width (M+1)^2 = 9
GRAPHS = ("  decode: {width: 1, context: 64}\n  prefill: {width: 8, context: 64}\n"
          "  ctg: {width: 4, context: 64, role: tree}\n  tree: {width: 9, context: 64}\n")
PASSES = ("passes:\n  - mha_to_sha\n  - lora_inputs: {targets: [q_proj, v_proj, down_proj], max_rank: 4, slots: 3}\n"
          f"  - forecast_inputs: {{m: {M}}}\n")

MAX_RANK, SLOTS = 4, 2


def run_graph(model: ir.Model, feeds: dict) -> dict:
    entry = GraphEntry(name="g", model=model, family="g", role="custom", width=4, context=32)
    names = {v.name for v in model.graph.inputs}
    return ort_run(entry, {k: v for k, v in feeds.items() if k in names})


def projections(model: ir.Model) -> dict[str, tuple[int, int]]:
    out = {}
    for node in model.graph:
        s = site_of(node)
        if s and s[3] is None:
            w = node.inputs[1].const_value.numpy()
            out[s[0]] = w.shape
    return out


def random_adapter(model: ir.Model, targets: list[str], rank: int, seed: int) -> Adapter:
    rng = np.random.default_rng(seed)
    weights = {}
    for proj, (cin, cout) in projections(model).items():
        if proj.rsplit(".", 1)[1] in targets:
            weights[proj] = (rng.standard_normal((cin, rank)).astype(np.float32) * 0.2,
                             rng.standard_normal((rank, cout)).astype(np.float32) * 0.2)
    return Adapter(f"rand{seed}", rank, weights)


def merged(model: ir.Model, adapter: Adapter) -> ir.Model:
    """The base graph with W + A @ B: what a merged (peft merge_and_unload) model computes."""
    m = model.clone()
    for node in m.graph:
        s = site_of(node)
        if s and s[0] in adapter.weights:
            a, b = adapter.weights[s[0]]
            w = node.inputs[1].const_value.numpy()
            node.inputs[1].const_value = ir.tensor((w + a @ b).astype(np.float32), name=node.inputs[1].name)
    return m


def lora_feeds(model: ir.Model, base_feeds: dict, adapters: list, rows) -> dict:
    arrays = {v.name: np.zeros([int(d) for d in v.shape], np.float32)
              for v in model.graph.inputs if v.name.startswith("lora_")}
    write_slots(arrays, adapters, MAX_RANK)
    write_rows(arrays, rows, MAX_RANK)
    return {**base_feeds, **arrays}


def peft_adapter(src, out, targets=("q_proj", "v_proj"), r=4, seed=0, **kw):
    """A PEFT LoRA on the model in `src` with random (non-zero) B, saved like a trained one."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager").eval()
    cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **kw)
    model = get_peft_model(base, cfg).eval()
    model.save_pretrained(out)
    return model
