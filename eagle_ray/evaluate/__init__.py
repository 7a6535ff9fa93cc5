"""Stage 6, evaluate: check that serving feeds the trained features, and measure acceptance length."""
