"""What runs in the fork server (``zygote``) and the processes it forks (``worker_exit``,
``parked_spare``, ``store_host``), with ``linux``, the process controls both sides use. It never
imports the supervisor's side (``launcher.process``), and this file imports nothing."""
