"""Stage 3, extract: the target's prefill captures the EAGLE-3 aux-layer and final hidden states (vLLM or transformers backend)."""
