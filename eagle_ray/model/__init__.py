"""EAGLE-3 draft model: architecture, TTT training loss, draft vocabulary, vLLM export."""

from eagle_ray.model.drafter import (
    EXPORT_ARCHITECTURE,
    DrafterArch,
    Eagle3Drafter,
    TTTOutputs,
    drafter_arch_from,
    drafter_arch_from_target_config,
    export_param_names,
    state_dict_for_export,
    ttt_attention_mask,
    vllm_config,
)
from eagle_ray.model.vocab import (
    build_draft_vocab,
    draft_target_ids,
    draft_to_target,
    target_to_draft_map,
)

__all__ = [
    "EXPORT_ARCHITECTURE",
    "DrafterArch",
    "Eagle3Drafter",
    "TTTOutputs",
    "build_draft_vocab",
    "draft_target_ids",
    "draft_to_target",
    "drafter_arch_from",
    "drafter_arch_from_target_config",
    "export_param_names",
    "state_dict_for_export",
    "target_to_draft_map",
    "ttt_attention_mask",
    "vllm_config",
]
