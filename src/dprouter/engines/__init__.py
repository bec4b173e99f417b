"""How each engine kind is spoken to: where a rank is written (``dialects``), what each
P/D flow puts on the wire (``pd_wire``), and the engines' KV-cache events (``kvevents``)."""
