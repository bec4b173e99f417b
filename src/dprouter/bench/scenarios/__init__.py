"""One module per scenario (``run(quick, out) -> Result``), named in ``bench/command.py``."""
