"""One router as an HTTP server: its components (``parts``), the routes, admission and
drain, the admin API, the endpoint table, metrics, the dashboard."""
