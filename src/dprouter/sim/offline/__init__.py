"""The engine model driven offline in virtual time, no sockets: arrivals, routes, and a
report of what it measured."""
