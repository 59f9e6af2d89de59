"""Development tools of opgraft (not shipped in the wheel): the GPU check, sweeps, the per-block
trace, the step probe, the end-to-end study, the serve benchmark, the air-gapped wheelhouse. Run
from a checkout with the package importable, e.g. `PYTHONPATH=python python -m tools.gpucheck`."""
