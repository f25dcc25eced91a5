"""--chaos: faults injected into the user's own run, from the supervisor's side."""
