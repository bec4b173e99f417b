"""The engine model served over HTTP in either persona (vLLM, SGLang): the endpoints,
their bodies and errors, metrics, KV-event publishers, P/D roles, a cluster of them."""
