"""Where a recipe's target lives on disk: the tiny twins are built on first use."""

from __future__ import annotations

from pathlib import Path

from eagle_ray.config import SMOLLM2_ALIAS, TINY_KIMI_ALIAS, TINY_TARGET_ALIAS, TargetConfig


def resolve_target_path(target: TargetConfig) -> Path:
    """The local directory of the target; builds the tiny target on first use."""
    if target.path == TINY_TARGET_ALIAS:
        from eagle_ray.targets.tiny.target import ensure_tiny_target

        return ensure_tiny_target()
    if target.path == TINY_KIMI_ALIAS:
        from eagle_ray.targets.tiny.kimi import ensure_tiny_kimi

        return ensure_tiny_kimi()
    if target.path == SMOLLM2_ALIAS:
        from eagle_ray.targets.smollm2 import ensure_smollm2

        return ensure_smollm2()
    from eagle_ray.targets.check import require_remote_code_consent

    path = Path(target.path)
    require_remote_code_consent(target, path)
    return path
