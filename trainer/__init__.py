"""What plugs into train.py's loop: flags and their checks, torchrun and FSDP2, checkpoints and
exact resume, dynamic sampling, the update's machinery, reporters."""
