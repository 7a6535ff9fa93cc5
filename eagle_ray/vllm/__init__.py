"""The vLLM runtime: engine arguments and pool resources, and the CPU platform plugin vLLM loads."""
