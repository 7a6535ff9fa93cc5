"""Stage 1, data: ingest and mix conversation logs, validate every line, statistics, tokenize with the chat template and loss mask."""
