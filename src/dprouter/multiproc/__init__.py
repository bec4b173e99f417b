"""``--processes N``: the supervisor, the serving processes, and the control plane that
runs discovery, breakers and the admin API once for all of them."""
