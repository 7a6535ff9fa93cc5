"""Stage 5, export: write a trained drafter in the file layout vLLM serves."""
