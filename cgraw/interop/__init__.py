"""Framework adapters (layer L5): torch and CuPy are imported lazily, only when the user has."""
