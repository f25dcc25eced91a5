"""What runs outside the supervisor, in the fork server (``zygote``) and the processes it forks: a
worker's start and exit (``worker_exit``), a parked warm spare (``parked_spare``), the store host
(``store_host``); and ``linux``, the process controls both sides use. The supervisor's side is
``launcher.process``, which this package never imports.

Kept free of imports: the zygote runs as ``python -m launcher.forked.zygote``.
"""
