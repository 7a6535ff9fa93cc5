"""Stage 4, train: Ray Train DDP over the drafter, from the store (offline) or from extractor actors (online); checkpoints."""
