"""The shared vocabulary: typed records and pure rules that every part of the launcher speaks
(the configuration, events, outcomes, failures, the policy). It imports nothing above it: only
``launcher.grammar``, the standard library and worker_lib's contract."""
