"""What every command checks when it starts, before any work: the modules it needs beyond the
standard library (a missing one ends the command with one line saying what to install, never a
traceback) and the files it will write (a path that cannot be written is refused up front, not
after a long run)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_HINTS = {"torch": "pip install torch", "vllm": "pip install vllm", "matplotlib": "pip install matplotlib"}


def require(name: str, prog: str):
    """Returns the imported module, or prints why `prog` cannot run and exits with status 2."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        print(f"{prog}: needs {name}, which cannot be imported here ({e}); {_HINTS.get(name, 'install it')}",
              file=sys.stderr)
        raise SystemExit(2) from None


def require_gpu(prog: str, why: str = ""):
    """Returns torch when a CUDA GPU is usable here, or prints why `prog` cannot run (torch missing,
    or no GPU: "PROG: no CUDA GPU here" + why) and exits with status 2."""
    torch = require("torch", prog)
    if not torch.cuda.is_available():
        print(f"{prog}: no CUDA GPU here{why}", file=sys.stderr)
        raise SystemExit(2)
    return torch


def output_problem(path: str, flag: str) -> str | None:
    """Why `path` (given with option `flag`) cannot be written, or None. Creates nothing."""
    if not path:
        return f"{flag}: empty path"
    if os.path.isdir(path):
        return f"{flag} {path}: is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{flag} {path}: no such directory {parent}"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return f"{flag} {path}: not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag} {path}: cannot create a file in {parent}"
    return None


def check_outputs(prog: str, outputs: dict) -> bool:
    """Prints `prog: error: ...` for each unusable output ({flag: path or None}); True when all
    are usable."""
    ok = True
    for flag, path in outputs.items():
        why = output_problem(path, flag) if path is not None else None
        if why:
            print(f"{prog}: error: {why}", file=sys.stderr)
            ok = False
    return ok


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default; options without one (None, required, or a flag)
    say in their help what happens when they are not given."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        if "default" in (action.help or ""):  # the help already says it, in its own words
            return action.help
        return super()._get_help_string(action)
