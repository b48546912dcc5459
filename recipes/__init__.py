"""Training recipes beside RL: SFT on expert trajectories, AgentEvol, DPO."""
