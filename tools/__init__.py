"""Tools on top of the core: plots, the viewer, reporters, checks, and eval.py's features (a chat
endpoint as the policy, a training run's settings, the paired comparison, the files it writes)."""
