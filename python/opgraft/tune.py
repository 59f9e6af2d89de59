"""Correctness-gated coordinate descent over an op's tunables (`opgraft tune moe|attention|linear`).

The search itself (coordinate_descent) is pure Python and takes any cost function, so it is tested
without a GPU; the GPU cost function (opgraft.cli.cmd_tune) sets a configuration through the
library's tunables API, checks the op's output against the fp64 oracle (an incorrect configuration
can never win) and times the kernel as the op's bench does (other data read before each call).
"""

from __future__ import annotations

import math
import re
from typing import Callable


def coordinate_descent(cost: Callable[[dict], float], space: dict, start: dict, rounds: int = 2,
                       min_gain: float = 0.01, progress: Callable[[str], None] | None = None):
    """Minimises cost(config) one key at a time. cost returns math.inf for a rejected (incorrect or
    failing) configuration. A move must gain at least min_gain (relative) to be taken, so noise
    does not wander. Returns (best_config, best_cost, history)."""
    best = dict(start)
    best_cost = cost(best)
    history = [(dict(best), best_cost)]
    seen = {tuple(sorted(best.items())): best_cost}
    for r in range(rounds):
        improved = False
        for key, values in space.items():
            for v in values:
                if best.get(key) == v:
                    continue
                cand = dict(best, **{key: v})
                sig = tuple(sorted(cand.items()))
                if sig in seen:
                    c = seen[sig]
                else:
                    c = cost(cand)
                    seen[sig] = c
                    history.append((dict(cand), c))
                if progress:
                    progress(f"round {r + 1} {key}={v}: {c:.2f} (best {best_cost:.2f})")
                if c < best_cost * (1.0 - min_gain):
                    best, best_cost, improved = cand, c, True
        if not improved:
            break
    if not math.isfinite(best_cost):
        raise RuntimeError("no configuration passed the correctness check")
    return best, best_cost, history


# ---- where the winners go -------------------------------------------------------------------

MAX_TOKENS = 64  # the kernel's token limit (src/moe.c)


def token_ranges(tokens: list[int], upper: int = MAX_TOKENS) -> list[tuple[int, int]]:
    """Splits 1..upper among the tuned counts (tokens, a batch, rows) at geometric midpoints, e.g.
    [1, 8] -> [(1, 2), (3, 64)]: each tuned count covers the counts nearest to it on a log scale."""
    ts = sorted(set(tokens))
    ranges = []
    lo = 1
    for i, t in enumerate(ts):
        hi = upper if i == len(ts) - 1 else max(t, int((t * ts[i + 1]) ** 0.5))
        ranges.append((lo, hi))
        lo = hi + 1
    return ranges


def make_entries(winners: list[dict]) -> list[dict]:
    """Tune-file entries from winners [{arch, gpu, shape, tokens: (lo, hi), values, why}]."""
    out = []
    for w in winners:
        out.append({"arch": int(w["arch"]), "gpu": w["gpu"], "shape": w["shape"],
                    "tokens": [int(w["tokens"][0]), int(w["tokens"][1])],
                    "values": {k: int(v) for k, v in sorted(w["values"].items())}, "why": w["why"]})
    return out


def read_tune_file(path: str) -> dict:
    """The tune file at path as a dict ({"version": 1, "entries": []} where there is none); ValueError
    where it exists but is not one this module wrote, so that it is never overwritten."""
    import json
    import os

    if not os.path.exists(path):
        return {"version": 1, "entries": []}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}); refusing to overwrite it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} cannot be read as UTF-8 text ({e}); refusing to overwrite it") from None
    if not (isinstance(doc, dict) and doc.get("version") == 1 and isinstance(doc.get("entries"), list) and
            all(isinstance(e, dict) and isinstance(e.get("tokens") or [], list) for e in doc["entries"])):
        raise ValueError(f"{path} is not an opgraft tune file (version 1); refusing to overwrite it")
    return doc


def merge_tune_file(path: str, entries: list[dict]) -> dict:
    """Writes entries into the JSON tune file at path (created if missing). An older entry with the
    same arch, gpu, shape and tokens is replaced. The file is replaced atomically."""
    import json
    import os
    import tempfile

    doc = read_tune_file(path)
    key = lambda e: (e.get("arch"), e.get("gpu"), e.get("shape"), tuple(e.get("tokens") or ()))
    new_keys = {key(e) for e in entries}
    doc["entries"] = [e for e in doc["entries"] if key(e) not in new_keys] + entries
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tune-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return doc


BEGIN, END = "/* BEGIN TUNED ROWS */", "/* END TUNED ROWS */"


def _c_string(s) -> str:
    if s is None:
        return "NULL"
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def baked_rows(entries: list[dict]) -> list[str]:
    rows = []
    for e in entries:
        lo, hi = e.get("tokens") or (0, 0)
        for k, v in e["values"].items():
            rows.append(f"    {{{e.get('arch') or 0}, {_c_string(e.get('gpu'))}, {_c_string(e.get('shape'))}, {lo}, {hi}, "
                        f"{_c_string(k)}, {int(v)}, {_c_string(e.get('why', ''))}}},")
    return rows


_STR = r'(?:NULL|"(?:[^"\\]|\\.)*")'
_ROW = re.compile(rf'^\s*\{{(\d+), ({_STR}), ({_STR}), (\d+), (\d+), ({_STR}), (-?\d+), ({_STR})\}},\s*$')


def _row_signature(line: str):
    """(arch, gpu, shape, lo, hi, key) of a baked-table row, or None for other lines."""
    m = _ROW.match(line)
    return m.groups()[:6] if m else None


def inject_baked(table_path: str, entries: list[dict]) -> int:
    """Adds rows for entries to an op's baked table (src/ops/<op>/table.c) just before the END marker,
    replacing older rows of the same arch, gpu, shape, tokens and key. Returns rows written."""
    text = open(table_path, encoding="utf-8").read()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{table_path} has no {BEGIN} ... {END} markers")
    head, rest = text.split(BEGIN, 1)
    body, tail = rest.split(END, 1)
    new = baked_rows(entries)
    new_sigs = {_row_signature(r) for r in new}
    kept = [line for line in body.split("\n") if _row_signature(line) not in new_sigs or _row_signature(line) is None]
    while kept and not kept[-1].strip():
        kept.pop()
    if not kept:  # no rows yet: the first one starts on a line of its own
        kept = [""]
    body = "\n".join(kept + new) + "\n    "
    with open(table_path, "w", encoding="utf-8") as f:
        f.write(head + BEGIN + body + END + tail)
    return len(new)
