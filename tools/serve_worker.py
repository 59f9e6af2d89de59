"""The vLLM worker class of the serve benchmark (tools/serve_bench.py, `--worker-cls
tools.serve_worker.ReinitWorker`): vLLM's own GPU worker, with two additions.

- Right after loading, the dummy weights are re-initialised (OPGRAFT_SERVE_INIT_STD, default
  0.02; 0 keeps vLLM's): matrices N(0, std^2) seeded per parameter name, norm weights 1, biases 0,
  the values tools/e2e.py gives them. vLLM's dummy weights are uniform in +-1e-3 and the same in
  every layer; with them the router's logits are almost equal, which is not how a trained model
  spreads its tokens over the experts. Doing it before torch.compile and the CUDA-graph capture
  (instead of through an RPC after start-up) works the same for `vllm serve` and `vllm bench
  latency`, which has no hook after start-up.
- `opgraft_stats`, callable by name through collective_rpc (the server's /collective_rpc in
  VLLM_SERVER_DEV_MODE, LLM.collective_rpc), returns the plugin's state and counters in this
  process.

Both settings (stock and opgraft) use this class, so it changes nothing between them.
"""

from __future__ import annotations

import logging
import os

from vllm.v1.worker.gpu_worker import Worker

from tools import e2e

INIT_STD_ENV = "OPGRAFT_SERVE_INIT_STD"


def _logger():
    try:
        from vllm.logger import init_logger

        return init_logger("vllm.opgraft_serve_bench")
    except Exception:
        return logging.getLogger("opgraft_serve_bench")


def init_std() -> float:
    try:
        std = float(os.environ.get(INIT_STD_ENV, "0.02"))
    except ValueError:
        raise ValueError(f"{INIT_STD_ENV}={os.environ[INIT_STD_ENV]!r} is not a number") from None
    if not 0 <= std < 1:
        raise ValueError(f"{INIT_STD_ENV}={std} must be in [0, 1)")
    return std


class ReinitWorker(Worker):
    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        std = init_std()
        self._opgraft_init = e2e._worker_reinit(self, std) if std > 0 else {"std": 0.0, "params": 0}
        _logger().info("serve bench: weights re-initialised: %s", self._opgraft_init)

    def opgraft_stats(self) -> dict:
        out = e2e._worker_stats(self)
        out["init"] = getattr(self, "_opgraft_init", None)
        return out
