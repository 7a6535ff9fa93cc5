"""Small helpers every stage shares: error messages, output directories, provenance and atomic writes, tables."""
