"""``VLLM_DSV4_MTP_DRAFT_PRECISION``: the switch, its refusals, what ``stored`` makes the portable draft compute.

Pure parts: the switch and its messages, the FP8 1x128 activation rounding from its definition, the rounding plan
read from each layout's ``quantization_config``. Draft parts build the draft class the way vLLM does (a real
``VllmConfig``, one-process gloo) on ``dsv4-mtp quantize --mtp amd`` output (MTP routed experts MXFP4 W4A4, shared
expert FP8 blocks, the rest BF16) and check which modules round their inputs, and that a ``stored`` forward
differs from a ``bf16`` one on the same weights. Engine parts: ``tests/test_draft_precision_engine.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_dsv4_mtp import draft_policy
from vllm_dsv4_mtp.formats.fp8 import E4M3_MAX, fake_quant_act

PREC = draft_policy.DRAFT_PRECISION_ENV
QUANT = draft_policy.QUANTIZED_MTP_ENV


# ------------------------------------------------------------------------------------------------ the switch
def test_draft_precision_switch_and_its_messages():
    assert draft_policy.draft_precision({}) == "bf16"
    assert draft_policy.draft_precision({PREC: " Stored"}) == "stored"
    with pytest.raises(draft_policy.MtpPrecisionError) as e:
        draft_policy.draft_precision({PREC: "fp8"})
    assert str(e.value) == "VLLM_DSV4_MTP_DRAFT_PRECISION='fp8' is not valid; expected one of bf16, stored"


def _hf(ckpt):
    from vllm_dsv4_mtp.tools.tiny import hf_config

    return hf_config(ckpt)


def test_stored_with_refuse_and_stored_on_a_bf16_only_draft_are_refused(ckpts):
    ckpt = ckpts["bf16-amd"]
    with pytest.raises(draft_policy.MtpPrecisionError) as e:
        draft_policy.check_draft(
            _hf(ckpt), str(ckpt), torch.bfloat16, {PREC: "stored", QUANT: "refuse"}, stored_ok=True
        )
    assert str(e.value) == (
        "VLLM_DSV4_MTP_DRAFT_PRECISION=stored computes the MTP layer as the checkpoint stores it, "
        "but VLLM_DSV4_MTP_QUANTIZED_MTP=refuse refuses a quantized MTP layer; unset one of them"
    )
    with pytest.raises(draft_policy.MtpPrecisionError) as e:  # a draft that computes BF16 only (gfx950 today)
        draft_policy.check_draft(_hf(ckpt), str(ckpt), torch.bfloat16, {PREC: "stored"})
    assert str(e.value).startswith("VLLM_DSV4_MTP_DRAFT_PRECISION=stored: this MTP draft computes in BF16 only")
    plan = draft_policy.check_draft(_hf(ckpt), str(ckpt), torch.bfloat16, {PREC: "stored"}, stored_ok=True)
    assert plan.precision == "stored" and plan.quantized_mtp == "dequantize"
    assert draft_policy.check_draft(_hf(ckpt), str(ckpt), torch.bfloat16, {}).precision == "bf16"


# --------------------------------------------------------------------------------- FP8 activation rounding
def _e4m3_grid() -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return codes[codes.isfinite()].unique()


def test_fp8_activation_rounding_from_its_definition():
    torch.manual_seed(0)
    grid = _e4m3_grid()
    x = torch.randn(3, 320) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(320 // 3 + 1)[:320]
    got = fake_quant_act(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    for lo in range(0, 320, 128):  # groups of 128 along K, the last one 64 wide
        g, q = x[:, lo : lo + 128], got[:, lo : lo + 128]
        s = g.abs().amax(-1, keepdim=True) / E4M3_MAX
        # every element is the nearest e4m3 value of x / s, times s (ties aside: random data has none)
        nearest = grid[(g / s).unsqueeze(-1).sub(grid).abs().argmin(-1)]
        torch.testing.assert_close(q, nearest * s, rtol=1e-6, atol=0)
        torch.testing.assert_close(q.abs().amax(-1), g.abs().amax(-1), rtol=1e-6, atol=0)  # the max maps to 448
    # e8m0: the scale is the power of two at or above amax / 448; values on its grid are unchanged
    s = torch.tensor(2.0**-3)
    on_grid = grid[torch.randint(len(grid), (2, 128))] * s
    on_grid[:, 0] = 448 * s
    assert torch.equal(fake_quant_act(on_grid, "e8m0"), on_grid)
    assert torch.equal(fake_quant_act(on_grid.bfloat16(), "e8m0"), on_grid.bfloat16())
    assert not torch.equal(fake_quant_act(x), x)


# ------------------------------------------------------------------------------------- the rounding plans
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One seed's tiny model as BF16, through `quantize --mtp amd`, and in the published layouts."""
    from vllm_dsv4_mtp.quant.quantize import quantize_checkpoint
    from vllm_dsv4_mtp.testing.published_layouts import build_published
    from vllm_dsv4_mtp.tools.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("draft-precision")
    bf16 = build_tiny_checkpoint(root / "bf16", seed=0)
    quantize_checkpoint(bf16, root / "bf16-amd", mtp="amd", progress=False)
    quantize_checkpoint(bf16, root / "bf16-mxfp4", progress=False)
    return {
        "bf16": bf16,
        "bf16-amd": root / "bf16-amd",
        "bf16-mxfp4": root / "bf16-mxfp4",
        "amd": build_published(root / "amd", "amd", seed=0),
        "official": build_published(root / "official", "official", seed=0),
    }


def _spec(ckpt):
    from vllm_dsv4_mtp.config import DeepseekV4Spec

    return DeepseekV4Spec.from_dict(json.loads((ckpt / "config.json").read_text()), source=str(ckpt))


def test_rounding_plan_of_each_layout(ckpts):
    from vllm_dsv4_mtp.model.quantization import draft_rounding

    plan = draft_rounding(_spec(ckpts["bf16-amd"]))
    assert plan.routed and plan.shared is not None and plan.e_proj is None and plan.h_proj is None
    assert plan.shared.keywords == {"scale_format": "float32"}  # Quark's dynamic 1x128 inputs: float scales
    for name in ("bf16", "bf16-mxfp4"):  # nothing quantized in the MTP layer: stored is bf16
        assert draft_rounding(_spec(ckpts[name])) == type(plan)()
    for name in ("amd", "official"):  # FP8 attention projections: not emulated, refused by name
        with pytest.raises(
            ValueError,
            match=r"MTP module mtp\.0\.attn\.\w+ is declared quantized .*"
            r"attention projections are not emulated",
        ):
            draft_rounding(_spec(ckpts[name]))


# ---------------------------------------------------------------------------------------- the draft itself
def _build(ckpt, monkeypatch, precision, log: list | None = None):
    """The draft as vLLM builds and loads it; ``log`` receives what the draft's logger emits while it is built
    (a handler on that logger, added once vLLM's config has set up its logging)."""
    import logging

    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader
    from vllm_dsv4_mtp.model.mtp import DeepSeekV4MTPModel

    monkeypatch.setenv(PREC, precision)
    cfg = EngineArgs(
        model=str(ckpt),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=256,
        skip_tokenizer_init=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: log.append(record.getMessage()) if log is not None else None
    logger = logging.getLogger("vllm.dsv4_mtp.mtp")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype):
            draft = DeepSeekV4MTPModel(vllm_config=cfg)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    reader = CheckpointReader(ckpt)
    draft.load_weights((n, reader.get(n)) for n in reader.names())
    # what vLLM's loader does after load_weights: each layer's processing, then the model's hook
    process_weights_after_loading(draft, cfg.model_config, torch.device("cpu"))
    return draft


@pytest.mark.usefixtures("vllm_dist")
def test_stored_draft_rounds_what_the_checkpoint_declares(ckpts, monkeypatch):
    log = []
    stored = _build(ckpts["bf16-amd"], monkeypatch, "stored", log)
    info = stored.describe()
    assert info["precision"] == "stored" and info["expert_activation_quant"] is True
    assert info["shared_fp8_inputs"] is True and info["proj_fp8_inputs"] == (False, False)
    assert (
        "vllm-dsv4-mtp: MTP draft precision stored (VLLM_DSV4_MTP_DRAFT_PRECISION=stored): as stored: routed "
        "experts MXFP4 W4A4, shared FP8 1x128 inputs, e_proj unrounded, h_proj unrounded"
    ) in log
    log = []
    bf16 = _build(ckpts["bf16-amd"], monkeypatch, "bf16", log)
    assert (
        "vllm-dsv4-mtp: MTP draft precision bf16 (VLLM_DSV4_MTP_DRAFT_PRECISION=bf16): exact BF16 upcast of the "
        "stored weights, activations unquantized"
    ) in log
    info = bf16.describe()
    assert info["precision"] == "bf16" and info["expert_activation_quant"] is False
    assert info["shared_fp8_inputs"] is False
    # the same weights (the exact decode) either way
    ps, pb = dict(stored.named_parameters()), dict(bf16.named_parameters())
    assert ps.keys() == pb.keys() and all(torch.equal(ps[k], pb[k]) for k in ps)
    # the MoE of the MTP block: stored rounds its inputs, bf16 does not; each equals its own recomputation
    torch.manual_seed(0)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    ids = torch.randint(0, 640, (5,))
    with torch.no_grad():
        ys = stored.model.layer(0).mtp_block.ffn(x, ids)
        yb = bf16.model.layer(0).mtp_block.ffn(x, ids)
    assert not torch.equal(ys, yb)
    se = stored.model.layer(0).mtp_block.ffn.shared_experts
    with torch.no_grad():
        gate, up = se.gate_up_proj(fake_quant_act(x)).chunk(2, dim=-1)
        from vllm_dsv4_mtp.model.experts import swiglu_clamped

        want = se.down(fake_quant_act(swiglu_clamped(gate, up, se.swiglu_limit)))
        torch.testing.assert_close(se(x).float(), want.float(), rtol=0, atol=0)


@pytest.mark.usefixtures("vllm_dist")
def test_stored_on_published_amd_layout_is_refused_at_start(ckpts, monkeypatch):
    with pytest.raises(draft_policy.MtpPrecisionError, match=r"mtp\.0\.attn\.\w+ is declared quantized"):
        _build(ckpts["amd"], monkeypatch, "stored")
    assert _build(ckpts["amd"], monkeypatch, "bf16").describe()["precision"] == "bf16"
