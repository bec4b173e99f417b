"""Real SGLang (CPU) servers for the end-to-end tests: see README.md and server.py."""
