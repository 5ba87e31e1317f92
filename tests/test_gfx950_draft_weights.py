"""The gfx950 draft's checkpoint-to-parameter map, against vLLM's in-tree MTP parameters at TP 1, 4 and 8.

vLLM's in-tree AMD MTP class cannot be built on CPU; its parameters can, from the vLLM layer classes it is made
of (``vllm_dsv4_mtp.testing.in_tree_mtp``), in real tensor-parallel groups (gloo, one forked process per rank:
``tests/in_tree_tp_worker.py``). For Pro and Flash dimensions (meta tensors) every native ``mtp.0.*`` tensor
must map to one of those parameters with a shape its vLLM loader can split into that parameter, and every
parameter must receive a tensor. At TP 2 on a tiny checkpoint in the official layout (FP8 linears, FP4
experts) the plugin's loader then fills the parameters through vLLM's own weight loaders: each rank must hold
exactly its slice of the exactly decoded weights, the attention sink included.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import procs

from vllm_dsv4_mtp.config import DeepseekV4Spec, weight_slots
from vllm_dsv4_mtp.gfx950.plan import in_tree_param_map
from vllm_dsv4_mtp.serve.profiles import FLASH_CONFIG, PRO_CONFIG

WORKER = Path(__file__).with_name("in_tree_tp_worker.py")


def _run_worker(world: int, out: Path, mode: str, dirs: list[Path]) -> None:
    p = procs.run([sys.executable, str(WORKER), str(world), str(out), mode, *map(str, dirs)], timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("in-tree-configs")
    dirs = {}
    for name, cfg in (("pro", PRO_CONFIG), ("flash", FLASH_CONFIG)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(dict(cfg)))
        dirs[name] = root / name
    return dirs


def _local_shape(name: str, native: tuple[int, ...], owner: str, shard, tp: int) -> tuple[int, ...]:
    """The part of a native tensor a rank's parameter holds, by vLLM's layer class (and the in-tree source's
    ``disable_tp=True`` for ``fused_wqa_wkv``)."""
    if owner == "ColumnParallelLinear" or (owner == "MergedColumnParallelLinear" and "fused_wqa_wkv" not in name):
        return (native[0] // tp, native[1])
    if owner == "RowParallelLinear":
        return (native[0], native[1] // tp)
    if owner == "RoutedExperts":
        return (native[0] // tp, native[1]) if shard in ("w1", "w3") else (native[0], native[1] // tp)
    if name.endswith("attn_sink"):
        return (native[0] // tp,)
    return native


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_every_mtp_tensor_has_its_in_tree_parameter(config_dirs, tmp_path, tp):
    _run_worker(tp, tmp_path, "shapes", list(config_dirs.values()))
    shapes = json.loads((tmp_path / "shapes.json").read_text())
    for name, cfg in (("pro", PRO_CONFIG), ("flash", FLASH_CONFIG)):
        spec = DeepseekV4Spec.from_dict(dict(cfg))
        params = shapes[str(config_dirs[name])]
        param_for = in_tree_param_map(spec, fused_shared_expert=False)
        received: dict[str, list[tuple[int, ...]]] = {}
        for slot in weight_slots(spec).values():
            if not slot.is_mtp:
                continue
            ref = param_for(slot.name)
            assert ref.param in params, (name, tp, slot.name, ref.param)
            shape, owner = params[ref.param]
            local = _local_shape(ref.param, slot.shape, owner, ref.shard, tp)
            received.setdefault(ref.param, []).append(local)
            if ref.kind == "plain" or ref.kind == "sink":
                assert tuple(shape) == local, (name, tp, slot.name, shape, local)
        for param, parts in received.items():
            shape = tuple(params[param][0])
            if "routed_experts" in param:  # E experts x (w1 + w3 | w2)
                rows = sum(p[0] for p in parts) // spec.n_routed_experts
                assert shape == (spec.n_routed_experts, rows, parts[0][1]), (name, tp, param)
            elif len(parts) > 1:  # stacked: the shards' rows one after the other
                assert shape == (sum(p[0] for p in parts), parts[0][1]), (name, tp, param, parts)
        assert set(received) == set(params), (name, tp, sorted(set(params) - set(received)))
        assert sum(math.prod(s) for s, _ in params.values()) > 0


@pytest.fixture(scope="module")
def official_tiny(tmp_path_factory):
    from vllm_dsv4_mtp.testing.published_layouts import build_published

    return build_published(tmp_path_factory.mktemp("tp2") / "official", "official", seed=3)


def test_tp2_ranks_hold_their_slices_of_the_decoded_weights(official_tiny, tmp_path):
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.formats.dequant import Dequantizer

    _run_worker(2, tmp_path, "load", [official_tiny])
    reader = CheckpointReader(official_tiny)
    dq = Dequantizer(torch.bfloat16, "test")
    native = {d.name: d.tensor for n in reader.tensors if n.startswith("mtp.")
              for d in dq.feed(n, reader.get(n))}
    dq.finish()
    spec = DeepseekV4Spec.from_dir(official_tiny)
    heads, inter = spec.num_attention_heads // 2, spec.moe_intermediate_size // 2
    p = "model.layers.4."
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}-official.pt")
        assert torch.equal(got[p + "e_proj.weight"], native["mtp.0.e_proj.weight"])
        assert torch.equal(got[p + "mtp_block.attn.fused_wqa_wkv.weight"],
                           torch.cat([native["mtp.0.attn.wq_a.weight"], native["mtp.0.attn.wkv.weight"]]))
        rows = spec.num_attention_heads * spec.head_dim // 2
        assert torch.equal(got[p + "mtp_block.attn.wq_b.weight"],
                           native["mtp.0.attn.wq_b.weight"][r * rows:(r + 1) * rows])
        cols = spec.o_groups * spec.o_lora_rank // 2
        assert torch.equal(got[p + "mtp_block.attn.wo_b.weight"],
                           native["mtp.0.attn.wo_b.weight"][:, r * cols:(r + 1) * cols])
        assert torch.equal(got[p + "mtp_block.attn.attn_sink"],
                           native["mtp.0.attn.attn_sink"][r * heads:(r + 1) * heads].float())
        w13 = got[p + "mtp_block.ffn.experts.routed_experts.w13_weight"]
        w2 = got[p + "mtp_block.ffn.experts.routed_experts.w2_weight"]
        for e in (0, spec.n_routed_experts - 1):
            sl = slice(r * inter, (r + 1) * inter)
            assert torch.equal(w13[e], torch.cat([native[f"mtp.0.ffn.experts.{e}.w1.weight"][sl],
                                                  native[f"mtp.0.ffn.experts.{e}.w3.weight"][sl]]))
            assert torch.equal(w2[e], native[f"mtp.0.ffn.experts.{e}.w2.weight"][:, sl])
        assert torch.equal(got[p + "mtp_block.ffn.gate.e_score_correction_bias"], native["mtp.0.ffn.gate.bias"])
