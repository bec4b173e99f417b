"""``python -m dprouter.launch_router``: the SGLang router's launch line run as dprouter,
for a framework that starts ``python -m sglang_router.launch_router`` (``cli/launch.py``;
``dprouter launch`` is the same command)."""

from dprouter.cli.launch import launch

if __name__ == "__main__":
    launch.main(prog_name="python -m dprouter.launch_router")
