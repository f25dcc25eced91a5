"""The run directory: its storage and lock, the records run.json holds, resume logic, checkpoints seen."""
