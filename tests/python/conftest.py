import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, ROOT)  # the development tools (tools/) are tested too

# On Python < 3.12 the standard library still has distutils, and setuptools' distutils shim
# asserts when the stdlib copy was imported first. Importing vLLM's fused-MoE module (bench
# tests) and later torch.utils.cpp_extension (which imports setuptools; plugin tests) in one
# pytest process hits that order. Tell setuptools to keep the stdlib copy for the test run.
os.environ.setdefault("SETUPTOOLS_USE_DISTUTILS", "stdlib")


import pytest  # noqa: E402

# The switches a seam test must not inherit from the shell that runs it.
PLUGIN_SWITCHES = ("OPGRAFT_DISABLE", "OPGRAFT_ATTN_BACKEND", "OPGRAFT_ATTENTION", "OPGRAFT_ATTENTION_VARIANT",
                   "OPGRAFT_LINEAR", "OPGRAFT_LINEAR_FP8", "OPGRAFT_LINEAR_VARIANT", "OPGRAFT_MOE_EXPERTS", "OPGRAFT_MOE_FP8",
                   "OPGRAFT_MOE_ROUTE", "OPGRAFT_NORM_FUSION", "OPGRAFT_ATTENTION_PROLOGUE", "OPGRAFT_ATTENTION_CACHE_WRITE")


@pytest.fixture
def clean_plugin(monkeypatch):
    """The plugin as a fresh vLLM process meets it: the platform taken for CUDA, none of its
    switches set, no seam installed, no counters; undone after the test."""
    from opgraft import dispatch
    from opgraft.vllm import _reset_for_tests

    monkeypatch.setenv("OPGRAFT_FORCE_PLATFORM", "1")
    for k in PLUGIN_SWITCHES:
        monkeypatch.delenv(k, raising=False)
    _reset_for_tests()
    dispatch.reset_stats()
    yield
    _reset_for_tests()
    dispatch.reset_stats()
