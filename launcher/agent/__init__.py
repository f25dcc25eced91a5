"""The agent: one node's supervisor. ``supervise`` builds the node's parts from the launch's
sections (``parts``) and picks the node's role; ``loop`` runs attempts until the role ends the
run; ``attempt`` runs one on this node (spawn, watch, stop: ``group_stop``); ``held`` records the
run's end where this node holds it. Kept free of imports: ``launcher.agent.supervise`` is the
entry."""
