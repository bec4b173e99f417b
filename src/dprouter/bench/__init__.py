"""``dprouter bench``: the seed scenarios, policies and peers measured side by side."""
