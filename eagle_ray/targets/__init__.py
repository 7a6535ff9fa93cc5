"""Target models: loading tensors by name, checking a download against a recipe, resolving paths, the tiny twins."""
