"""The tree itself: no file carries merge-conflict markers."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = re.compile(r"^(<<<<<<< |>>>>>>> |=======$)", re.M)


def test_no_conflict_markers():
    bad = []
    for base, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "results", "__pycache__")]
        for f in files:
            if f.endswith((".c", ".h", ".cu", ".cuh", ".py", ".md", ".sh", ".txt", ".toml", ".cmake", ".json")) \
                    or f in ("Makefile", "run"):
                path = os.path.join(base, f)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    if MARKER.search(fh.read()):
                        bad.append(os.path.relpath(path, ROOT))
    assert not bad, f"merge-conflict markers in {bad}"
