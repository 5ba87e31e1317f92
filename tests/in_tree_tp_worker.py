"""One tensor-parallel rank for tests/test_gfx950_draft_weights.py (run as a script, one process per rank).

Builds vLLM's in-tree MTP parameter tree (``vllm_dsv4_mtp.testing.in_tree_mtp``) from the BF16 draft config
of each checkpoint directory given, at the world size given, and writes what the test asks for as JSON:

* ``shapes``: ``{param: [shape], owner class}`` on the meta device (Pro / Flash dimensions);
* ``load``: for a real tiny checkpoint, loads its ``mtp.*`` tensors with the plugin's loader (vLLM's own weight
  loaders do the tensor-parallel split) and saves this rank's parameters.

argv: world out_dir mode dir [dir ...]. vLLM is imported once, then the ranks are forked (a fresh import per
rank would cost ~15 s of CPU each).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rank_main(rank: int, world: int, rendezvous: str, out: str, mode: str, dirs: list[str]) -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsv4_mtp.gfx950.plan import bf16_draft_config, in_tree_param_map
    from vllm_dsv4_mtp.testing.in_tree_mtp import InTreeMtpParameters

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}")
        initialize_model_parallel(world, 1)
    result = {}
    for d in dirs:
        vc = bf16_draft_config(EngineArgs(model=d, skip_tokenizer_init=True, max_model_len=4096,
                                          dtype="bfloat16").create_engine_config())
        with set_current_vllm_config(vc):
            if mode == "shapes":
                with torch.device("meta"):
                    m = InTreeMtpParameters(vc)
                owners = {n: type(mod).__name__ for n, mod in m.named_modules()}
                result[d] = {n: [list(p.shape), owners[n.rsplit(".", 1)[0]] if "." in n else ""]
                             for n, p in m.named_parameters()}
            else:
                from vllm_dsv4_mtp.config import spec_from_hf_config
                from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
                from vllm_dsv4_mtp.weights.loader import DRAFT, CheckpointLoader

                torch.set_default_dtype(torch.bfloat16)
                m = InTreeMtpParameters(vc)
                spec = spec_from_hf_config(vc.model_config.hf_config)
                reader = CheckpointReader(d)
                CheckpointLoader(m, spec, scope=DRAFT, dtype=torch.bfloat16, source=d,
                                 param_for=in_tree_param_map(spec, fused_shared_expert=False)).load(
                    (n, reader.get(n)) for n in reader.tensors)
                torch.save({n: p.detach().clone() for n, p in m.named_parameters()},
                           Path(out) / f"rank{rank}-{Path(d).name}.pt")
    if rank == 0 and mode == "shapes":
        (Path(out) / "shapes.json").write_text(json.dumps(result))


def main() -> None:
    import multiprocessing as mp
    import tempfile

    import vllm.engine.arg_utils  # noqa: F401  (imported once, before forking)
    import vllm_dsv4_mtp.testing.in_tree_mtp  # noqa: F401

    world, out, mode, *dirs = sys.argv[1:]
    # a file rendezvous, not a loopback port found free and released: another process (a concurrent engine) can
    # take such a port before rank 0 binds it
    rendezvous = tempfile.mkdtemp(dir=out) + "/rendezvous"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=rank_main, args=(r, int(world), rendezvous, out, mode, dirs))
             for r in range(int(world))]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        sys.exit(f"rank(s) failed with exit codes {bad}")


if __name__ == "__main__":
    main()
