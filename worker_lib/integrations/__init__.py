"""Adapters that give a framework's training every guarantee ftlaunch gives a worker_lib script:
resume from the newest step every rank committed, beats for hang detection, and a preemption
that stops every rank at one agreed step.

- ``worker_lib.integrations.lightning``: ``FaultTolerance``, a Lightning ``Callback``
- ``worker_lib.integrations.transformers``: ``FaultTolerance``, a Hugging Face ``TrainerCallback``
- ``worker_lib.integrations.accelerate``: ``save_state``, ``load_state`` and ``after_step``

Each imports its framework only when it is imported itself: ``import worker_lib`` never does.
"""
