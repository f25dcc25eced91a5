"""The leaf: what a user may write (durations, the chaos spec, SLURM's variables) and the errors
that refuse it, with their exit codes. It imports only the standard library, so the vocabulary and
every layer above may use it."""
