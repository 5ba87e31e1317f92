"""vLLM's attention backend record and metadata builder of the portable layers.

Every layer's rows (``model/paged_rows.py``: :class:`PagedRowCache`) name :class:`PortableAttentionBackend` as
their backend. vLLM uses only its builder, :class:`PortableAttentionMetadataBuilder`, which turns each step's
``CommonAttentionMetadata`` into the host-side addressing of ``model/attention_metadata.py``, once for the whole
KV-cache group (the target and its MTP draft). There is no ``AttentionImpl``: the layers compute attention
themselves (``model/attention.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from vllm_dsv4_mtp.model.attention_metadata import PortableAttentionMetadata

PORTABLE_BACKEND_NAME = "DSV4_MTP_PORTABLE"

# On CPU, vLLM's unpadded draft path (0.32; 0.33's prepare_inputs reads the same) hands the draft metadata whose
# seq_lens is the tensor it also keeps as seq_lens_cpu_upper_bound (llm_base_proposer.prepare_inputs makes it with
# async_tensor_h2d, which on CPU returns its input; seen in 0.32), and each later draft step of one call increments
# both (eagle_step_update_slot_mapping_and_metadata, then "+= 1"): the k-th draft token's sequence would be k - 1
# positions too long. The padded path (the default) keeps them apart; with one draft token there is no later step.
UNPADDED_DRAFTS_ON_CPU = (
    "speculative_config.disable_padded_drafter_batch=True with num_speculative_tokens > 1 is not supported on CPU: "
    "vLLM's unpadded draft path makes the draft's seq_lens on CPU the same tensor as its seq_lens_cpu_upper_bound "
    "and increments both at every draft step, so the k-th draft token would see a sequence k - 1 positions too "
    "long; leave disable_padded_drafter_batch unset (the default padded path)"
)


class PortableAttentionMetadataBuilder(AttentionMetadataBuilder[PortableAttentionMetadata]):
    """Turns vLLM's ``CommonAttentionMetadata`` into :class:`PortableAttentionMetadata` (host addressing)."""

    _cudagraph_support = AttentionCGSupport.NEVER
    reorder_batch_threshold = None  # decodes, verifies and prefills may come in any order
    supports_update_block_table = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        spec = vllm_config.speculative_config
        if (
            spec is not None
            and spec.disable_padded_drafter_batch
            and spec.num_speculative_tokens > 1
            and (spec.use_eagle() or spec.uses_draft_model())
            and torch.device(device).type == "cpu"
        ):
            raise ValueError(UNPADDED_DRAFTS_ON_CPU)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PortableAttentionMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        # host copies: the drafter updates seq_lens (and its slot buffer) in place after building
        return PortableAttentionMetadata.create(
            query_start_loc=_host(cm.query_start_loc_cpu[: n + 1]),
            seq_lens=_host(cm.seq_lens[:n]),
            block_table=_host(cm.block_table_tensor[:n]),
            slot_mapping=cm.slot_mapping,
            num_actual_tokens=cm.num_actual_tokens,
            block_size=self.block_size,
            device=cm.block_table_tensor.device,
        )


def _host(t: torch.Tensor) -> np.ndarray:
    """An int64 host copy of ``t``."""
    return t.detach().cpu().numpy().astype(np.int64)


class PortableAttentionBackend(AttentionBackend):
    """vLLM backend record of the portable core (only its builder is used; no ``AttentionImpl``)."""

    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return PORTABLE_BACKEND_NAME

    @staticmethod
    def get_builder_cls():
        return PortableAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(
            f"{PORTABLE_BACKEND_NAME} has no AttentionImpl: its layers compute attention themselves"
        )
