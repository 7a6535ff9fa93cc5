"""The EAGLE-3 draft model: architecture, TTT training loss, draft vocabulary (vLLM's file layout is in eagle_ray.export)."""

from eagle_ray.model.drafter import (
                                     DrafterArch,
                                     Eagle3Drafter,
                                     TTTOutputs,
                                     drafter_arch_from,
                                     drafter_arch_from_target_config,
                                     ttt_attention_mask,
                                     )
from eagle_ray.model.vocab import (
                                   build_draft_vocab,
                                   draft_target_ids,
                                   draft_to_target,
                                   target_to_draft_map,
                                   )

__all__ = [
    "DrafterArch",
    "Eagle3Drafter",
    "TTTOutputs",
    "build_draft_vocab",
    "draft_target_ids",
    "draft_to_target",
    "drafter_arch_from",
    "drafter_arch_from_target_config",
    "target_to_draft_map",
    "ttt_attention_mask",
]
