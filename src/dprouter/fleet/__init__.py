"""What the router routes to: workers and their targets, the load board, the registry and
its snapshot, circuit breakers, engine probing, load reports and health checks, and where
workers come from (``membership``)."""
