"""Development tools of opgraft (not shipped in the wheel): the GPU check, sweeps, the per-block
trace, the step probe, the end-to-end study, the serve benchmark, the air-gapped wheelhouse. Run
from a checkout with the package importable, e.g. `PYTHONPATH=python python -m tools.gpucheck`."""
import sys


def tunable_variants(specs: list, suffix: str, prog: str):
    """A tool's --extra NAME=KEY:VALUE,...[@SUFFIX] options: [(name, {tunable: value}, whether
    @SUFFIX was given)], or None after one error line on stderr for a spec of any other form (no
    name, no tunable, a value that is no integer, another suffix)."""
    out = []
    for spec in specs:
        name, _, kvs = spec.partition("=")
        kvs, at, tail = kvs.partition("@")
        try:
            cfg = {k: int(v) for k, v in (kv.split(":") for kv in kvs.split(",") if kv)}
        except ValueError:
            cfg = {}
        if not name or not cfg or (at and tail != suffix):
            print(f"{prog}: error: --extra {spec!r}: want NAME=KEY:VALUE,...[@{suffix}]", file=sys.stderr)
            return None
        out.append((name, cfg, bool(at)))
    return out
