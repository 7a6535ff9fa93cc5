"""Stage 2, generate: the target regenerates the responses through a pool of vLLM replicas (Ray Data)."""
