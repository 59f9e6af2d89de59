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
