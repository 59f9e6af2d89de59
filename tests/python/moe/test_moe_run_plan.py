"""The MoE op's launch loop (_run_plan) without a GPU: a stale plan is made again once, a refused
plan raises its reason, and the workspace is the caller's where it fits."""

import types

import pytest

torch = pytest.importorskip("torch")

from opgraft import _lib  # noqa: E402
from opgraft.ops import moe  # noqa: E402


def _plan(handle=1, reason="", need=64):
    return types.SimpleNamespace(handle=handle, reason=reason, workspace_bytes=need)


def test_a_stale_plan_is_made_again_once(monkeypatch):
    monkeypatch.setattr(moe, "forget_plans", lambda: None)
    seen = []
    statuses = iter([_lib.ESTALE, _lib.OK])
    moe._run_plan(_plan(1), None, "cpu", lambda p, ws: seen.append(p.handle) or next(statuses), lambda: _plan(2))
    assert seen == [1, 2]
    with pytest.raises(_lib.OpgraftError):  # stale twice: the error, not a third try
        moe._run_plan(_plan(1), None, "cpu", lambda p, ws: _lib.ESTALE, lambda: _plan(2))


def test_a_refused_plan_raises_its_reason():
    with pytest.raises(_lib.OpgraftError, match="moe.route is 0"):
        moe._run_plan(_plan(None, "moe.route is 0"), None, "cpu", lambda p, ws: pytest.fail("launched"), None)


def test_the_callers_workspace_is_used_where_it_fits():
    ws = torch.empty(128, dtype=torch.uint8)
    got = []
    moe._run_plan(_plan(need=64), ws, "cpu", lambda p, w: got.append(w) or _lib.OK, None)
    moe._run_plan(_plan(need=256), ws, "cpu", lambda p, w: got.append(w) or _lib.OK, None)
    assert got[0] == ws.data_ptr() and got[1] != ws.data_ptr()
