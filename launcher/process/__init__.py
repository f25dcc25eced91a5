"""Process mechanics on the supervisor's side: plan, spawn, watch and stop worker groups; the
supervisor's ends of the fork server, the warm spares, the store host and the orphan guard. No
policy here. What runs in those other processes is ``launcher.forked`` and
``launcher.orphan_guard``.
"""
