"""Data preparation: ingestion of conversation logs (see ingest.py; formats.py, validate.py, mix.py)."""
