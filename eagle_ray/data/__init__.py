"""Data preparation: ingestion of conversation logs (see ingest.py)."""
