"""What every part of worker_lib stands on: the contract with the supervisor (variables, the
heartbeat slot), the backend's choice, storage on any fsspec URL with its checksums, the
heartbeat itself, RNG capture and --chaos's requests. Imports nothing else of worker_lib."""
