"""Process mechanics on the supervisor's side, no policy: plan, spawn, watch and stop worker groups,
and its ends of the fork server, the spares, the store host and the orphan guard (what runs in
those: ``launcher.forked``, ``launcher.orphan_guard``)."""
