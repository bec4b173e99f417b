"""Files run by inference-perf's own (Python 3.12) environment, not by dprouter's."""
