"""Prefill/decode disaggregation: one flow per engine kind, chosen once at start-up."""
