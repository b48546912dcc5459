"""Models on top of the core: the built-in names (the tiny model, SmolLM2), warm starts,
loading, precision and the critic."""
