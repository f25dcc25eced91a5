"""Many nodes: where nodes meet (rendezvous), what they tell each other per attempt (channel),
and what SLURM tells us about them (slurm)."""
