"""Prefill/decode requests: a pair of targets chosen per request, and one flow per engine
kind (``nixl``, ``moriio``, ``sglang``) over sequential or concurrent legs."""
