"""What plugs into train.py's loop: flags and their checks, torchrun and FSDP2, checkpoints
and exact resume, the update's machinery (batching, statistics), reporters. What a step
computes is train.py's."""
