"""The tiny targets built locally in seconds: a Llama and a Kimi-K2.5 twin, with their tokenizer and corpus."""
