"""What a scenario found (``results``: tables, checks, the report) and its plots."""
