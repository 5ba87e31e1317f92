"""``VLLM_DSV4_MTP_DRAFT_PRECISION=stored`` on vLLM's REAL in-tree AMD MTP class, for vLLM 0.32, 0.33 and 0.34.

The same harness as tests/test_in_tree_mtp_real.py (its worker, one subprocess per release, real ``EngineArgs``
with MTP on), on AMD Quark checkpoints whose MTP layer is declared in ``layer_quant_config`` (FP8 128x128 attention,
``e_proj`` / ``h_proj`` and shared expert, MXFP4 W4A4 routed experts) by (a) exact native names and (b) ``re:``
patterns (AMD's export). vLLM's ``QuarkConfig`` never matches ``re:`` keys and, before 0.33, not the draft's
names either: both fall back to the global MXFP4 scheme without the plugin's keying. Checked:

* every MTP module's quant method / Quark scheme is the one the checkpoint stores it in (read here from the
  stored dtypes, not from the plugin), none the global scheme, none unquantized where the checkpoint quantizes;
* every quantized parameter of every rank (TP 1 and 2) holds the stored bytes: FP8 weights and their E8M0 block
  scales, packed MXFP4 experts and their E8M0 scales, bit-exact;
* a checkpoint whose Quark config excludes the MTP layer while its tensors are quantized, and a non-Quark one,
  are refused with a message naming the field and the tensor.

The dimensions are multiples of 128 where vLLM's FP8 block linears require it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_in_tree_mtp_real import VERSIONS, run_worker

from vllm_dsv4_mtp.config import DeepseekV4Spec, weight_slots

pytestmark = pytest.mark.engine

STORED = {"VLLM_DSV4_MTP_DRAFT_PRECISION": "stored"}
#: FP8 block partitions divisible by 128 at TP 1 and 2 (q / o LoRA ranks, the shared expert's width)
STORED_DIMS = dict(q_lora_rank=128, o_lora_rank=128, moe_intermediate_size=256)


def exact_keyed(ckpt: Path) -> Path:
    """Rewrite the checkpoint's ``re:`` MTP keys as the exact native module names they match."""
    f = ckpt / "config.json"
    cfg = json.loads(f.read_text())
    qc = cfg["quantization_config"]
    modules = sorted({s.module for s in weight_slots(DeepseekV4Spec.from_dir(ckpt)).values() if s.is_mtp})
    layers = {}
    for key, value in qc["layer_quant_config"].items():
        if key.startswith("re:mtp"):
            layers.update({m: value for m in modules if re.match(key[3:], m)})
        else:
            layers[key] = value
    assert not any(k.startswith("re:mtp") for k in layers) and "mtp.0.ffn.experts.7.w2" in layers
    qc["layer_quant_config"] = layers
    f.write_text(json.dumps(cfg))
    return ckpt


@pytest.fixture(scope="session")
def stored_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from vllm_dsv4_mtp.testing.published_layouts import build_published
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    root = tmp_path_factory.mktemp("stored")
    out = {k: build_published(root / k, "amd", seed=5, config=tiny_config(**STORED_DIMS)) for k in ("re", "exact")}
    exact_keyed(out["exact"])
    out["original"] = build_published(root / "original", "amd-mtp-original", seed=5)
    out["official"] = build_published(root / "official", "official", seed=5)
    return out


@pytest.fixture(scope="module", params=VERSIONS)
def stored(request, stored_checkpoints, tmp_path_factory):
    version = request.param
    out = tmp_path_factory.mktemp(f"stored-{version}")
    cases = [
        dict(name=f"{k}-tp{tp}", ckpt=str(stored_checkpoints[k]), tp=tp, load=True, env=STORED)
        for k in ("re", "exact")
        for tp in (1, 2)
    ]
    cases += [dict(name=k, ckpt=str(stored_checkpoints[k]), tp=1, env=STORED) for k in ("original", "official")]
    run_worker(version, out, cases)
    results = {
        (c["name"], r): json.loads((out / f"{c['name']}-rank{r}.json").read_text())
        for c in cases
        for r in range(c["tp"])
    }
    return version, out, results


#: the draft's quant prefix (under ``model.layers.{L}.``) -> the native MTP modules stored for it
DRAFT_TO_NATIVE = {
    "e_proj": ["e_proj"],
    "h_proj": ["h_proj"],
    "attn.fused_wqa_wkv": ["attn.wq_a", "attn.wkv"],
    "attn.wq_b": ["attn.wq_b"],
    "attn.wo_a": ["attn.wo_a"],
    "attn.wo_b": ["attn.wo_b"],
    "ffn.shared_experts.gate_up_proj": ["ffn.shared_experts.w1", "ffn.shared_experts.w3"],
    "ffn.shared_experts.down_proj": ["ffn.shared_experts.w2"],
    "ffn.experts": ["ffn.experts.0.w1"],
    "ffn.gate": ["ffn.gate"],
}
#: what vLLM builds for a module stored in each safetensors dtype (linear, MoE)
BUILT_FOR = {
    "F8_E4M3": ("QuarkW8A8Fp8PerBlock", None),
    "U8": (None, "QuarkOCP_MX_MoEMethod"),
    "BF16": ("UnquantizedLinearMethod", "UnquantizedFusedMoEMethod"),
}


def _ok(results, name, world):
    for r in range(world):
        res = results[(name, r)]
        assert res["error"] is None, f"{name} rank {r}: {res['error']}\n{res.get('traceback', '')}"
    return [results[(name, r)] for r in range(world)]


@pytest.mark.parametrize("keys", ["re", "exact"])
def test_every_mtp_module_gets_the_checkpoints_scheme(stored, stored_checkpoints, keys):
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    version, out, results = stored
    ckpt = stored_checkpoints[keys]
    spec = DeepseekV4Spec.from_dir(ckpt)
    dtypes = {n: i.dtype for n, i in CheckpointReader(ckpt).tensors.items()}
    layer = f"model.layers.{spec.num_hidden_layers}."
    for tp in (1, 2):
        for res in _ok(results, f"{keys}-tp{tp}", tp):
            want = {}
            for draft, native in DRAFT_TO_NATIVE.items():
                stored_as = {dtypes[f"mtp.0.{n}.weight"] for n in native}
                assert len(stored_as) == 1, (draft, stored_as)
                linear, moe = BUILT_FOR[stored_as.pop()]
                want[layer + draft] = moe if draft == "ffn.experts" else linear
            assert res["schemes"] == want, (version, keys, tp, res["schemes"])
            assert sum("stored precision" in m for m in res["logs"]) == 1, res["logs"]


def _split(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    k = t.shape[dim] // world
    return t.narrow(dim, rank * k, k)


def expected_stored(ckpt: Path, spec: DeepseekV4Spec, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Each quantized draft parameter's bytes on ``rank``, from the checkpoint's names by the module layout:
    column-parallel rows / row-parallel columns split evenly (weights and their scales alike), replicated whole."""
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    reader = CheckpointReader(ckpt)
    p, m = f"model.layers.{spec.num_hidden_layers}.", "mtp.0."
    want = {}
    for suffix, param_suffix in ((".weight", ".weight"), (".weight_scale", ".weight_scale")):

        def t(name, suffix=suffix):
            return reader.get(m + name + suffix).view(torch.uint8)

        def rows(name):
            return _split(t(name), 0, rank, world)

        def cols(name):
            return _split(t(name), 1, rank, world)

        blk = p + "mtp_block."
        want[p + "e_proj" + param_suffix] = t("e_proj")
        want[p + "h_proj" + param_suffix] = t("h_proj")
        want[blk + "attn.fused_wqa_wkv" + param_suffix] = torch.cat([t("attn.wq_a"), t("attn.wkv")])
        want[blk + "attn.wq_b" + param_suffix] = rows("attn.wq_b")
        want[blk + "attn.wo_a" + param_suffix] = rows("attn.wo_a")
        want[blk + "attn.wo_b" + param_suffix] = cols("attn.wo_b")
        want[blk + "ffn.shared_experts.gate_up_proj" + param_suffix] = torch.cat(
            [rows("ffn.shared_experts.w1"), rows("ffn.shared_experts.w3")]
        )
        want[blk + "ffn.shared_experts.down_proj" + param_suffix] = cols("ffn.shared_experts.w2")
        routed = blk + "ffn.experts.routed_experts."
        leaf = param_suffix.replace(".weight", "weight")
        want[f"{routed}w13_{leaf}"] = torch.stack(
            [
                torch.cat([rows(f"ffn.experts.{e}.w1"), rows(f"ffn.experts.{e}.w3")])
                for e in range(spec.n_routed_experts)
            ]
        )
        want[f"{routed}w2_{leaf}"] = torch.stack([cols(f"ffn.experts.{e}.w2") for e in range(spec.n_routed_experts)])
    return want


@pytest.mark.parametrize("keys", ["re", "exact"])
def test_quantized_parameters_hold_the_stored_bytes(stored, stored_checkpoints, keys):
    version, out, results = stored
    ckpt = stored_checkpoints[keys]
    spec = DeepseekV4Spec.from_dir(ckpt)
    for tp in (1, 2):
        _ok(results, f"{keys}-tp{tp}", tp)
        for r in range(tp):
            got = torch.load(out / f"{keys}-tp{tp}-rank{r}.pt")
            want = expected_stored(ckpt, spec, r, tp)
            quantized = {
                n for n, g in got.items() if g.dtype in (torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu)
            }
            assert quantized == set(want), (version, keys, tp, quantized ^ set(want))
            for name, w in want.items():
                g = got[name].view(torch.uint8)
                assert g.shape == w.shape and torch.equal(g, w), (version, keys, tp, r, name)


def test_stored_refusals_name_the_field_and_the_tensor(stored):
    version, out, results = stored
    original = results[("original", 0)]["error"]
    assert original.startswith("MtpPrecisionError: ") and "quantization_config.exclude covers every MTP module" in (
        original
    ), original
    assert re.search(r"mtp\.0\.\S+ is stored (F8_E4M3|I8|F8_E8M0)", original), original
    official = results[("official", 0)]["error"]
    # vLLM renames the release's "fp8" for DeepSeek-V4 in the config the draft sees
    assert re.search(r"quantization_config\.quant_method is '(deepseek_v4_)?fp8'", official), official
    assert official.endswith("use VLLM_DSV4_MTP_DRAFT_PRECISION=bf16"), official
