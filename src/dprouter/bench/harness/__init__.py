"""What the scenarios are built from: load generators, processes pinned to cores, a
trivial backend, bare proxies, the peer routers, etcd, the offline router (``sim_router``)."""
