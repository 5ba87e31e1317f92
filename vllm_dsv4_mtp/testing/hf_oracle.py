"""HF transformers' ``DeepseekV4ForCausalLM`` as the independent oracle for the plugin's target model.

transformers 5.19 loads the native DeepSeek-V4 names itself (its conversion mapping) but neither quantized
experts nor FP8 linears, and it runs only in float32 (its norms stay float32 and a bf16 run hits a dtype
error). :func:`dequantized_copy` therefore writes a BF16 copy of a checkpoint whose MXFP4 experts and FP8
linears are decoded exactly (``formats.mxfp4`` / ``formats.fp8``), which :func:`load_hf_model` then loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def dequantized_copy(src: str | Path, dst: str | Path) -> Path:
    """Write ``dst``: the checkpoint ``src`` with every quantized tensor decoded exactly to BF16 (MXFP4 and
    FP8 values are exactly representable in bfloat16) and no ``quantization_config``; MTP tensors dropped."""
    from vllm_dsv4_mtp.formats import mxfp4
    from vllm_dsv4_mtp.formats.checkpoint import CheckpointReader, CheckpointWriter
    from vllm_dsv4_mtp.formats.fp8 import dequantize_block_fp8

    reader = CheckpointReader(src)
    names = set(reader.names())
    dst = Path(dst)
    with CheckpointWriter(dst, max_shard_bytes=2**31, overwrite=True) as w:
        for name in sorted(names):
            if name.startswith("mtp.") or name.endswith((".scale", ".weight_scale")):
                continue
            t = reader.get(name)
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            scale = next((base + s for s in (".weight_scale", ".scale") if base and base + s in names), None)
            if scale is not None and t.dtype in (torch.uint8, torch.int8):
                s = reader.get(scale)
                s = s.view(torch.uint8) if s.dtype != torch.uint8 else s
                t = mxfp4.dequantize(t.view(torch.uint8), s, dtype=torch.float32)
                if t.abs().max() > torch.finfo(torch.bfloat16).max:
                    raise ValueError(f"{name}: decoded values overflow bfloat16")
                t = t.to(torch.bfloat16)
            elif scale is not None and t.dtype == torch.float8_e4m3fn:
                t = dequantize_block_fp8(t, reader.get(scale), dtype=torch.bfloat16)
            elif scale is not None:
                raise ValueError(f"{name}: has scale {scale} but dtype {t.dtype}")
            w.add(name, t)
        cfg = dict(reader.config)
        cfg.pop("quantization_config", None)
        cfg.pop("expert_dtype", None)
        w.write_config(cfg)
    for f in Path(src).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, dst / f.name)
    return dst


def load_hf_model(ckpt: str | Path, dtype: torch.dtype = torch.float32):
    """HF ``DeepseekV4ForCausalLM`` on a native, unquantized checkpoint (any compress ratios), eval mode."""
    from transformers import DeepseekV4ForCausalLM

    from vllm_dsv4_mtp.tools.tiny import hf_config

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{ckpt}: quantized checkpoint; make a dequantized_copy() for HF first")
    model = DeepseekV4ForCausalLM.from_pretrained(str(ckpt), config=hf_config(ckpt), dtype=dtype)
    return model.eval()


@torch.no_grad()
def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence (no cache) next-token log-probabilities ``[len(token_ids), vocab]`` float32."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def sharpen_routing(ckpt: str | Path, bias_scale: float = 100.0) -> None:
    """Scale every ``ffn.gate.bias`` of a BF16 checkpoint in place so the bias alone decides expert selection.

    The routing weights still come from the unbiased scores, so the MoE maths is unchanged; only the top-k
    choice no longer flips on near-ties under rounding. Parity tests use it to see the precision floor of
    everything else.
    """
    from vllm_dsv4_mtp.testing.mtp_checkpoints import rewrite_tensors

    rewrite_tensors(ckpt, lambda name, t: t * bias_scale if name.endswith("ffn.gate.bias") else None)


def engine_prompt_logprobs_vs_hf(llm, prompts: list[list[int]], hf_model) -> dict[str, float]:
    """Run ``prompts`` through a vLLM ``LLM`` for their prompt log-probabilities (one greedy token each) and
    compare them with HF's: :func:`compare_prompt_logprobs`'s report."""
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, detokenize=False),
    )
    return compare_prompt_logprobs(outs, prompts, hf_model)


@torch.no_grad()
def compare_prompt_logprobs(outputs, prompts: list[list[int]], hf_model) -> dict[str, float]:
    """Per-position log-probabilities of vLLM's prompt logprobs (``prompt_logprobs >= 1``) against HF.

    For every prompt position ``i >= 1``: ``|logprob_vllm(tok_i) - logprob_hf(tok_i)|`` and whether vLLM's top-1
    token equals HF's argmax. Returns ``max_abs``, ``mean_abs``, ``top1`` (agreement fraction), ``positions``.
    """
    diffs, agree = [], []
    for out, prompt in zip(outputs, prompts):
        ref = hf_logprobs(hf_model, prompt)
        for i in range(1, len(prompt)):
            entry = out.prompt_logprobs[i]
            diffs.append(abs(entry[prompt[i]].logprob - ref[i - 1, prompt[i]].item()))
            top = min(entry.items(), key=lambda kv: kv[1].rank)[0]
            agree.append(top == int(ref[i - 1].argmax()))
    d = torch.tensor(diffs)
    return {
        "max_abs": d.max().item(),
        "mean_abs": d.mean().item(),
        "top1": sum(agree) / len(agree),
        "positions": len(agree),
    }


@torch.no_grad()
def greedy_agreement(outputs, prompts: list[list[int]], hf_model, margin: float = 1e-4) -> dict[str, int]:
    """Check a greedy continuation against a full-sequence HF forward over ``prompt + generated``.

    At every generated step the emitted token must be HF's argmax; steps where HF's top-2 log-probabilities
    are within ``margin`` (a tie the oracle itself cannot decide) are counted separately.
    Returns ``steps``, ``mismatches`` (outside ties) and ``ties``.
    """
    steps = mismatches = ties = 0
    for out, prompt in zip(outputs, prompts):
        gen = list(out.outputs[0].token_ids)
        ref = hf_logprobs(hf_model, prompt + gen)[len(prompt) - 1 : len(prompt) - 1 + len(gen)]
        top2 = ref.topk(2, dim=-1).values
        for j, tok in enumerate(gen):
            steps += 1
            if tok != int(ref[j].argmax()):
                if (top2[j, 0] - top2[j, 1]) < margin:
                    ties += 1
                else:
                    mismatches += 1
    return {"steps": steps, "mismatches": mismatches, "ties": ties}


class W4A4Experts(torch.nn.Module):
    """An HF ``DeepseekV4Experts`` whose GEMM inputs are rounded to MXFP4 (the Quark W4A4 scheme).

    Holds the HF module's (already dequantized) weights; each expert's input and its SwiGLU output are
    ``fake_quant``-ed along the reduction dim before the GEMM, and the routing weight multiplies the output of
    ``w2`` (as vLLM's fused MoE does). Used to give the oracle the same activation rounding as the plugin.
    """

    def __init__(self, hf_experts):
        super().__init__()
        self.inner = hf_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from vllm_dsv4_mtp.formats.mxfp4 import fake_quant

        ex = self.inner
        out = torch.zeros_like(hidden_states)
        for e in torch.unique(top_k_index).tolist():
            token, slot = torch.nonzero(top_k_index == e, as_tuple=True)
            h = ex._apply_gate(torch.nn.functional.linear(fake_quant(hidden_states[token]), ex.gate_up_proj[e]))
            y = torch.nn.functional.linear(fake_quant(h), ex.down_proj[e])
            out.index_add_(0, token, y * top_k_weights[token, slot, None].to(y.dtype))
        return out


def with_w4a4_experts(hf_model):
    """Swap every routed-experts module of an HF DeepSeek-V4 model for :class:`W4A4Experts` (in place)."""
    for layer in hf_model.model.layers:
        layer.mlp.experts = W4A4Experts(layer.mlp.experts)
    return hf_model
