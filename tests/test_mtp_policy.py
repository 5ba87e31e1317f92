"""The MTP draft's start-up checks and precision policy, with their exact messages.

Most checks build the draft the way vLLM does (a real ``VllmConfig`` from ``EngineArgs(..., speculative_config=
{"method": "mtp"}).create_engine_config()``, the draft class constructed under it in a one-process gloo context) and
feed ``load_weights`` the checkpoint's tensors; two start a real engine (on a checkpoint without MTP weights, and
with vLLM's unpadded draft path on CPU). Covered: quantized MTP weights decoded exactly to BF16 by default / refused
on request (``VLLM_DSV4_MTP_QUANTIZED_MTP=refuse``), the draft never quantized through the target's quant config,
MTP weights absent (found before any precision question) / missing / mis-shaped, float16 refused, and vLLM's own
behaviour for ``num_nextn_predict_layers: 0``; ``disable_padded_drafter_batch`` refused on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from engines import vllm_engine

from vllm_dsv4_mtp import draft_policy as mtp_policy

ENV = mtp_policy.QUANTIZED_MTP_ENV
REFUSAL_TAIL = (
    ", and VLLM_DSV4_MTP_QUANTIZED_MTP=refuse. Unset it (the default, 'dequantize', decodes quantized "
    "MTP weights exactly to BF16 at load), or use a checkpoint whose MTP layer is stored BF16."
)


# ------------------------------------------------------------------------------------------ pure policy
def test_quantized_mtp_option():
    assert mtp_policy.quantized_mtp_option({}) == "dequantize"  # the draft is BF16 by design
    assert mtp_policy.quantized_mtp_option({ENV: "Refuse "}) == "refuse"
    with pytest.raises(mtp_policy.MtpPrecisionError) as e:
        mtp_policy.quantized_mtp_option({ENV: "fp8"})
    assert str(e.value) == "VLLM_DSV4_MTP_QUANTIZED_MTP='fp8' is not valid; expected one of dequantize, refuse"


def test_draft_dtype():
    assert mtp_policy.check_draft_dtype(torch.bfloat16) is torch.bfloat16
    assert mtp_policy.check_draft_dtype(torch.float32) is torch.float32
    with pytest.raises(mtp_policy.MtpPrecisionError) as e:
        mtp_policy.check_draft_dtype(torch.float16)
    assert str(e.value) == (
        "the DeepSeek-V4 MTP draft runs in bfloat16 (or float32 for testing), but the engine "
        "dtype is torch.float16; start vLLM with dtype='bfloat16'"
    )


def _mtp_modules():
    from vllm_dsv4_mtp.config import DeepseekV4Spec, weight_slots
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    spec = DeepseekV4Spec.from_dict(tiny_config())
    return [s.module for s in weight_slots(spec).values() if s.is_mtp and s.quantizable]


def _spec(quantization_config, **fields):
    from vllm_dsv4_mtp.config import DeepseekV4Spec
    from vllm_dsv4_mtp.tools.tiny import tiny_config

    return DeepseekV4Spec.from_dict({**tiny_config(**fields), "quantization_config": quantization_config})


def test_declared_precisions_of_quark_and_official_configs():
    from vllm_dsv4_mtp.formats.quark_config import mxfp4_experts_config

    modules = _mtp_modules()
    assert "mtp.0.e_proj" in modules and "mtp.0.ffn.experts.7.w2" in modules
    # the AMD export's policy: mtp.* excluded -> nothing declared quantized
    assert mtp_policy.declared_mtp_precisions(_spec(mxfp4_experts_config(exclude=["re:mtp\\..*"]))) == {}
    # a Quark config that does not exclude the MTP layer: its experts (and every linear, global MXFP4) are MXFP4
    declared = mtp_policy.declared_mtp_precisions(_spec(mxfp4_experts_config(exclude=["head"])))
    assert declared["mtp.0.ffn.experts.0.w1"] == "mxfp4" and declared["mtp.0.e_proj"] == "mxfp4"
    # the official release: FP8 block linears, FP4 routed experts -- also when config.json has no expert_dtype
    # (the published Pro / Flash configs omit it; vLLM takes it as fp4)
    official = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    for expert_dtype in ("fp4", None):
        declared = mtp_policy.declared_mtp_precisions(_spec(official, expert_dtype=expert_dtype))
        assert declared["mtp.0.h_proj"] == "fp8-block" and declared["mtp.0.ffn.experts.3.w3"] == "fp4"
        assert declared["mtp.0.ffn.shared_experts.w1"] == "fp8-block"
    assert mtp_policy.declared_mtp_precisions(_spec(official, expert_dtype="fp8"))["mtp.0.ffn.experts.3.w3"] == (
        "fp8-block"
    )


def test_cpu_expand_kernel_replacement():
    """The replacement for vLLM's broken CPU expand kernel (vllm-project/vllm#55005) expands per request."""
    from vllm_dsv4_mtp.workarounds.cpu_expand_kernel import expand_kernel_impl

    for x in (torch.tensor([0.7, 0.0, 1.3]), torch.tensor([5, 0, 2], dtype=torch.int32)):
        out = torch.full((6,), -9, dtype=x.dtype)
        expand_kernel_impl(out, x, torch.tensor([2, 3, 5]), 0, 1)
        want = torch.tensor([x[0], x[0], 1, x[2], x[2], -9], dtype=x.dtype)
        assert torch.equal(out, want), (out, want)


# ------------------------------------------------------------------------------ the draft, built as vLLM does
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Tiny checkpoints sharing one set of BF16 weights (seed 0) in several storage layouts."""
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("mtp-policy")
    # what `quantize --allow-missing-mtp` leaves when the Quark config does not exclude the MTP layer: its
    # config declares mtp.* MXFP4, and there are no mtp.* tensors at all
    leaky = build_tiny_checkpoint(root / "quark-no-mtp", seed=0, experts="mxfp4", mtp=False)
    cfg = json.loads((leaky / "config.json").read_text())
    cfg["quantization_config"]["exclude"] = [
        e for e in cfg["quantization_config"]["exclude"] if not e.startswith("mtp.")
    ]
    (leaky / "config.json").write_text(json.dumps(cfg))
    return {
        "bf16": build_tiny_checkpoint(root / "bf16", seed=0),
        "no-mtp": build_tiny_checkpoint(root / "no-mtp", seed=0, mtp=False),
        # the official release layout: FP8 128x128 linears (MTP included) and FP4 routed experts (MTP included)
        "official": build_tiny_checkpoint(root / "official", seed=0, experts="fp4-official", linears="fp8"),
        "quark": build_tiny_checkpoint(root / "quark", seed=0, experts="mxfp4"),
        "quark-no-mtp": leaky,
    }


def _vllm_config(ckpt, dtype="bfloat16"):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(ckpt),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()


def _build_draft(ckpt, dtype="bfloat16"):
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_dsv4_mtp.model.mtp import DeepSeekV4MTPModel

    cfg = _vllm_config(ckpt, dtype)
    with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
        return DeepSeekV4MTPModel(vllm_config=cfg)


def _tensors(ckpt):
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader

    reader = CheckpointReader(ckpt)
    return {name: reader.get(name) for name in reader.names()}


@pytest.mark.usefixtures("vllm_dist")
def test_bf16_checkpoint_loads_every_draft_parameter(ckpts):
    draft = _build_draft(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    loaded = draft.load_weights(iter(tensors.items()))
    assert loaded == {n for n, _ in draft.named_parameters()}
    p = dict(draft.named_parameters())
    assert torch.equal(p["model.layers.4.e_proj.weight"], tensors["mtp.0.e_proj.weight"])
    assert torch.equal(p["model.layers.4.shared_head.norm.weight"], tensors["mtp.0.norm.weight"])
    assert torch.equal(p["model.layers.4.hc_head.fn"], tensors["mtp.0.hc_head_fn"])
    w13 = p["model.layers.4.mtp_block.ffn.experts.w13_weight"]
    assert torch.equal(w13[5, 64:], tensors["mtp.0.ffn.experts.5.w3.weight"])
    assert draft.is_unused_checkpoint_weight("layers.0.attn.wq_a.weight")
    assert not draft.is_unused_checkpoint_weight("mtp.0.e_proj.weight")


@pytest.mark.usefixtures("vllm_dist")
def test_draft_never_takes_the_targets_quant_config(ckpts, monkeypatch):
    """Built under a quantized checkpoint's config, every draft linear is unquantized and its experts BF16."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    monkeypatch.setenv(ENV, "dequantize")  # the official layout declares its MTP layer quantized
    for name in ("quark", "official"):
        draft = _build_draft(ckpts[name])
        linears = [(n, m) for n, m in draft.named_modules() if isinstance(m, LinearBase)]
        assert sorted(n for n, _ in linears) == [
            "model.layers.4.e_proj",
            "model.layers.4.h_proj",
            "model.layers.4.mtp_block.attn.fused_wqa_wkv",
            "model.layers.4.mtp_block.attn.wo_b",
            "model.layers.4.mtp_block.attn.wq_b",
            "model.layers.4.mtp_block.ffn.shared_experts.down_proj",
            "model.layers.4.mtp_block.ffn.shared_experts.gate_up_proj",
        ]
        for n, m in linears:
            assert isinstance(m.quant_method, UnquantizedLinearMethod), (name, n, m.quant_method)
        assert draft.describe()["expert_activation_quant"] is False
        assert draft.model.layer(0).mtp_block.ffn.experts.w13_weight.dtype == torch.bfloat16


@pytest.mark.usefixtures("vllm_dist")
def test_quantized_mtp_is_refused_on_request(ckpts, monkeypatch):
    monkeypatch.setenv(ENV, "refuse")
    with pytest.raises(mtp_policy.MtpPrecisionError) as e:
        _build_draft(ckpts["official"])
    n = len(_mtp_modules())
    assert str(e.value) == (
        f"{ckpts['official']}/config.json: MTP module mtp.0.attn.wkv (and {n - 1} more MTP "
        "modules) is declared fp8-block by quantization_config" + REFUSAL_TAIL
    )


@pytest.mark.usefixtures("vllm_dist")
def test_quantized_mtp_tensor_refused_even_if_config_says_bf16(ckpts, monkeypatch):
    """A BF16-declared checkpoint with an FP8 MTP tensor: the tensor itself is refused, by name."""
    from vllm_dsv4_mtp.formats.fp8 import quantize_block_fp8

    monkeypatch.setenv(ENV, "refuse")
    draft = _build_draft(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    q, s = quantize_block_fp8(tensors["mtp.0.h_proj.weight"].float())
    tensors["mtp.0.h_proj.weight"], tensors["mtp.0.h_proj.scale"] = q, s
    with pytest.raises(mtp_policy.MtpPrecisionError) as e:
        draft.load_weights(iter(tensors.items()))
    assert str(e.value) == (
        f"{ckpts['bf16']}: MTP tensor mtp.0.h_proj.weight is stored FP8 (float8_e4m3fn)" + REFUSAL_TAIL
    )


@pytest.mark.usefixtures("vllm_dist")
def test_quantized_mtp_is_dequantized_exactly_by_default(ckpts, monkeypatch):
    from vllm_dsv4_mtp.formats import mxfp4
    from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

    monkeypatch.delenv(ENV, raising=False)
    draft = _build_draft(ckpts["official"])
    tensors = _tensors(ckpts["official"])
    loaded = draft.load_weights(iter(tensors.items()))
    assert loaded == {n for n, _ in draft.named_parameters()}
    p = dict(draft.named_parameters())
    want = dequantize_block_fp8(tensors["mtp.0.e_proj.weight"], tensors["mtp.0.e_proj.scale"], torch.bfloat16)
    assert torch.equal(p["model.layers.4.e_proj.weight"], want)
    w1 = mxfp4.dequantize(
        tensors["mtp.0.ffn.experts.2.w1.weight"].view(torch.uint8),
        tensors["mtp.0.ffn.experts.2.w1.scale"].view(torch.uint8),
        torch.bfloat16,
    )
    assert torch.equal(p["model.layers.4.mtp_block.ffn.experts.w13_weight"][2, :64], w1)
    # FP8 / FP4 codes are exact in BF16, and close to the BF16 weights they were made from
    ref = _tensors(ckpts["bf16"])["mtp.0.e_proj.weight"].float()
    assert (want.float() - ref).abs().max() <= 0.07 * ref.abs().max()


NO_MTP_TAIL = (
    "speculative decoding with method 'mtp' needs the checkpoint's MTP layer, but it has no MTP weights: "
    "no mtp.* tensor in its index or shards (config.json says num_nextn_predict_layers=1). Serve it "
    "without a speculative config, or use a checkpoint that ships its MTP layer."
)


@pytest.mark.parametrize("option", ["dequantize", "refuse"])
@pytest.mark.usefixtures("vllm_dist")
def test_checkpoint_without_mtp_weights_is_an_error_before_any_precision_question(ckpts, monkeypatch, option):
    """The draft's constructor reads the checkpoint's tensor names: no mtp.* is said first, also for a
    quantized export whose config would otherwise be refused for its precision (what ``quantize
    --allow-missing-mtp`` writes)."""
    monkeypatch.setenv(ENV, option)
    for name in ("no-mtp", "quark-no-mtp"):
        with pytest.raises(mtp_policy.MtpMissingError) as e:
            _build_draft(ckpts[name])
        assert str(e.value) == f"{ckpts[name]}: {NO_MTP_TAIL}"


@pytest.mark.usefixtures("vllm_dist")
def test_missing_or_misshaped_mtp_tensor_is_named(ckpts):
    tensors = _tensors(ckpts["bf16"])
    without = {k: v for k, v in tensors.items() if k != "mtp.0.ffn.experts.6.w2.weight"}
    with pytest.raises(ValueError) as e:
        _build_draft(ckpts["bf16"]).load_weights(iter(without.items()))
    assert str(e.value) == f"{ckpts['bf16']}: mtp.0.ffn.experts.6.w2.weight: tensor missing from the checkpoint"
    bad = dict(tensors, **{"mtp.0.hnorm.weight": torch.ones(64, dtype=torch.bfloat16)})
    with pytest.raises(ValueError) as e:
        _build_draft(ckpts["bf16"]).load_weights(iter(bad.items()))
    assert str(e.value) == f"{ckpts['bf16']}: mtp.0.hnorm.weight: expected shape (128,), got (64,)"
    extra = dict(tensors, **{"mtp.1.e_proj.weight": tensors["mtp.0.e_proj.weight"]})
    with pytest.raises(ValueError) as e:
        _build_draft(ckpts["bf16"]).load_weights(iter(extra.items()))
    assert str(e.value) == (f"{ckpts['bf16']}: mtp.1.e_proj.weight: MTP layer 1 is beyond num_nextn_predict_layers=1")


def test_num_nextn_predict_layers_zero_fails_in_vllm(tmp_path):
    """vLLM 0.32 itself rejects ``{"method": "mtp", "num_speculative_tokens": K}`` on a config with
    ``num_nextn_predict_layers: 0`` before any of the plugin's model code runs (``SpeculativeConfig`` computes
    ``K % 0``): an error, if not a clear one. The plugin's ``--config-format dsv4_mtp`` parser names the field
    first (tests/test_startup_checks.py); without it this is what vLLM prints. Without K, vLLM asks for
    ``num_speculative_tokens``. Either way speculation is never silently off."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint, tiny_config

    d = build_tiny_checkpoint(tmp_path / "zero", tiny_config(num_nextn_predict_layers=0), mtp=False)
    assert json.loads((Path(d) / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with pytest.raises(ZeroDivisionError):
        EngineArgs(
            model=str(d),
            max_model_len=256,
            skip_tokenizer_init=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        ).create_engine_config()
    with pytest.raises(Exception, match="num_speculative_tokens must be provided"):
        EngineArgs(
            model=str(d), max_model_len=256, skip_tokenizer_init=True, speculative_config={"method": "mtp"}
        ).create_engine_config()


# ------------------------------------------------------------------------------------------ through vLLM
@pytest.mark.engine
def test_engine_start_without_mtp_weights_fails_naming_the_checkpoint(ckpts):
    """The real engine (in-process, so the worker's exception reaches the caller unchanged)."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError) as e:
        with vllm_engine(
            ckpts["no-mtp"],
            in_process=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=256,
            skip_tokenizer_init=True,
            speculative_config=spec,
        ):
            pass  # not reached: the engine must not start
    assert str(e.value) == f"{ckpts['no-mtp']}: {NO_MTP_TAIL}"


@pytest.mark.engine
def test_unpadded_drafts_on_cpu_are_refused_at_engine_start_from_two_draft_tokens():
    """``disable_padded_drafter_batch`` on CPU: vLLM's unpadded draft path would make each draft token after the
    first see a sequence one more position too long (``attention/backend.py``). With K = 2 the engine refuses to
    start, naming the field, instead of failing at the first request's second draft token; with K = 1 (no second
    draft token) it serves."""
    from vllm import SamplingParams

    from vllm_dsv4_mtp.attention.backend import UNPADDED_DRAFTS_ON_CPU
    from vllm_dsv4_mtp.embedded import BF16_CHECKPOINT_DIR

    kw = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": True}
    with pytest.raises(ValueError) as e:  # in process: the worker's exception reaches the caller unchanged
        with vllm_engine(BF16_CHECKPOINT_DIR, in_process=True, speculative_config=spec, **kw):
            pass  # not reached: the engine must not start
    assert str(e.value) == UNPADDED_DRAFTS_ON_CPU
    # its own process: in this one, a running in-process engine would join the module's vllm_dist groups
    k1 = {**spec, "num_speculative_tokens": 1}
    with vllm_engine(BF16_CHECKPOINT_DIR, in_process=False, speculative_config=k1, **kw) as llm:
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
        (out,) = llm.generate([{"prompt_token_ids": list(range(3, 40))}], sp, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12


@pytest.mark.usefixtures("vllm_dist")
def test_draft_linears_take_the_float32_route_where_the_cpu_has_no_16bit_gemm(ckpts, monkeypatch):
    """The MTP layer's vLLM linears (``e_proj``, ``h_proj`` and its block's) after vLLM's post-load step on a CPU
    without a 16-bit GEMM: each holds the float32 copy of exactly its loaded weight and computes through it, the
    loaded weight beside it."""
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_dsv4_mtp.cpu.kit import KIT

    monkeypatch.setattr(KIT, "native_gemm", lambda d: False)
    draft = _build_draft(ckpts["bf16"])
    tensors = _tensors(ckpts["bf16"])
    draft.load_weights(iter(tensors.items()))
    loaded = {n: m.weight.detach().clone() for n, m in draft.named_modules() if isinstance(m, LinearBase)}
    process_weights_after_loading(draft, _vllm_config(ckpts["bf16"]).model_config, torch.device("cpu"))
    linears = {n: m for n, m in draft.named_modules() if isinstance(m, LinearBase)}
    assert {"model.layers.4.e_proj", "model.layers.4.h_proj"} <= set(linears)
    for name, m in linears.items():
        assert torch.equal(m.float32_weight, loaded[name].float()), name
        assert torch.equal(m.weight, loaded[name]), name
    e_proj = linears["model.layers.4.e_proj"]
    assert torch.equal(loaded["model.layers.4.e_proj"], tensors["mtp.0.e_proj.weight"])
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.equal(e_proj(x), F.linear(x.float(), tensors["mtp.0.e_proj.weight"].float()).to(torch.bfloat16))
