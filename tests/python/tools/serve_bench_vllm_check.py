"""Checks of tools/serve_bench.py against the installed vLLM, each in a process of its own (they
set vLLM's platform to the CPU one, as the vllm CLI does for `vllm bench`, which must not leak
into other tests). Prints one JSON object.

    python serve_bench_vllm_check.py parse MODEL_DIR      the command lines, parsed by vLLM
    python serve_bench_vllm_check.py latency-memo OUT_DIR the latency runner on a stand-in engine
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))  # the checkout

from vllm import platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

if platforms.current_platform.is_unspecified():
    platforms.current_platform = CpuPlatform()

from tools import serve_bench  # noqa: E402


def study_args(model_dir, out):
    return serve_bench.parser().parse_args(["study", "--out-dir", out, "--model-dir", model_dir])


def parse(model_dir: str) -> dict:
    from vllm.benchmarks import latency
    from vllm.benchmarks.serve import add_cli_args as serve_client_args
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    try:  # vLLM 0.26; later releases moved it
        from vllm.entrypoints.openai.cli_args import validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = study_args(model_dir, "/tmp/unused")
    out = {}
    top = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
    s = top.parse_args(serve_bench.serve_argv(args, model_dir, 8123))
    validate_parsed_serve_args(s)
    out["serve"] = {k: getattr(s, k) for k in ("model_tag", "load_format", "max_model_len", "max_num_seqs",
                                               "max_num_batched_tokens", "enable_prefix_caching", "worker_cls",
                                               "port", "host", "dtype", "gpu_memory_utilization")}
    out["serve"]["capture"] = s.compilation_config.get("cudagraph_capture_sizes") \
        if isinstance(s.compilation_config, dict) else s.compilation_config.cudagraph_capture_sizes

    c = FlexibleArgumentParser()
    serve_client_args(c)
    b = c.parse_args(serve_bench.bench_serve_argv(args, model_dir, 8123, "opgraft", 128, 256, 8, "/tmp/r", "f.json"))
    out["client"] = {k: getattr(b, k) for k in ("dataset_name", "random_input_len", "random_output_len",
                                                "random_range_ratio", "max_concurrency", "num_prompts",
                                                "ignore_eos", "temperature", "save_result", "result_dir",
                                                "result_filename", "metric_percentiles", "percentile_metrics",
                                                "backend", "endpoint", "port", "metadata", "num_warmups")}

    lp = FlexibleArgumentParser()
    latency.add_cli_args(lp)
    la = lp.parse_args(serve_bench.latency_argv(args, model_dir, 8, "/tmp/l.json"))
    out["latency"] = {k: getattr(la, k) for k in ("batch_size", "input_len", "output_len", "num_iters",
                                                  "num_iters_warmup", "output_json", "load_format",
                                                  "enable_prefix_caching", "worker_cls", "max_num_seqs")}
    # The server's and bench latency's vLLM configurations hash alike: they share the compile cache.
    s.model = s.model_tag
    try:
        serve_cfg = AsyncEngineArgs.from_cli_args(s).create_engine_config(UsageContext.OPENAI_API_SERVER)
        lat_cfg = EngineArgs.from_cli_args(la).create_engine_config(UsageContext.LLM_CLASS)
    except RuntimeError as e:  # vLLM 0.34 builds no config on an x86 CPU without triton-cpu
        if "requires Triton" not in str(e):
            raise
        out["no_config"] = str(e)
        return out
    out["hashes"] = [serve_cfg.compute_hash(), lat_cfg.compute_hash()]
    return out


def latency_memo(out_dir: str) -> dict:
    """serve_bench.latency_main with vLLM's bench latency code and a stand-in engine: one engine
    for both runs, vLLM's result files, the counters read by method name."""
    from vllm import LLM

    made, rpcs = [], []

    class Engine:
        class llm_engine:
            class model_config:
                max_model_len = 4096

        def generate(self, prompts, sampling_params=None, use_tqdm=False):
            return []

        def collective_rpc(self, method):
            rpcs.append(method)
            return [{"moe": {"taken": 7}}]

    def from_engine_args(cls, engine_args):
        made.append(engine_args)
        return Engine()

    LLM.from_engine_args = classmethod(from_engine_args)
    args = study_args(os.path.join(out_dir, "model"), out_dir)
    runs = [{"argv": serve_bench.latency_argv(args, os.path.join(out_dir, "model"), b,
                                              os.path.join(out_dir, f"lat-b{b}.json")),
             "batch_size": b, "result_file": os.path.join(out_dir, f"lat-b{b}.json")} for b in (1, 8)]
    runs_path, status_path = os.path.join(out_dir, "r.runs.json"), os.path.join(out_dir, "r.status.json")
    with open(runs_path, "w") as f:
        json.dump(runs, f)
    rc = serve_bench.latency_main(runs_path, status_path)
    with open(status_path) as f:
        status = json.load(f)
    results = [json.load(open(r["result_file"])) for r in runs]
    return {"rc": rc, "engines": len(made), "rpcs": rpcs, "status": status,
            "result_keys": [sorted(r) for r in results]}


if __name__ == "__main__":
    what, where = sys.argv[1], sys.argv[2]
    res = parse(where) if what == "parse" else latency_memo(where)
    print("RESULT " + json.dumps(res, default=str))
