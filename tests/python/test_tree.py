"""The tree itself: no file carries merge-conflict markers, and the core names no op."""
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


def test_core_names_no_op():
    # The core and the kernels' common folder serve every op: an op's name there (code or comment)
    # means op knowledge leaked out of its folder. The ops are the folders of src/ops/.
    ops = sorted(d for d in os.listdir(os.path.join(ROOT, "src", "ops"))
                 if os.path.isdir(os.path.join(ROOT, "src", "ops", d)))
    assert {"moe", "attention", "linear"} <= set(ops)
    word = re.compile(r"\b(" + "|".join(ops + ["attn", "experts?"]) + r")\b", re.I)
    bad = []
    for folder in ("src/core", "kernels/common"):
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            with open(os.path.join(ROOT, folder, f), encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if word.search(line):
                        bad.append(f"{folder}/{f}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
