"""The serve benchmark's CPU side (tools/serve_bench.py): the preset's model folder and its
tokenizer, the command lines (parsed by vLLM's own parsers), the summary of vLLM's result files,
the bad-request comparison, and the whole study against a stand-in vLLM (tests/python/tools/
fake_vllm.py), its failure exits included. The study itself needs a GPU: see docs/SERVE.md."""

import json
import os
import subprocess
import sys

import pytest

from tools import e2e, serve_bench

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = serve_bench.REPO


def _has(module):
    """Whether module is installed."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except Exception:
        return False


needs_tokenizers = pytest.mark.skipif(not _has("tokenizers"), reason="needs the tokenizers package")
needs_vllm = pytest.mark.skipif(not _has("vllm.benchmarks.serve"), reason="needs vLLM")


def _args(*extra):
    return serve_bench.parser().parse_args(["study", "--out-dir", "/tmp/x", *extra])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not _has("tokenizers"):
        pytest.skip("needs the tokenizers package")
    d = tmp_path_factory.mktemp("model")
    path, cfg = serve_bench.prepare_model_dir(str(d), "Qwen3-30B-A3B")
    return path


# ---- the model folder ---------------------------------------------------------------------------


def test_presets_match_opgraft_presets():
    from opgraft.presets import PRESETS, from_config

    for name in serve_bench.PRESET_SPECIALS:
        shape, p = from_config(serve_bench.preset_config(name)), PRESETS[name]
        assert (shape.num_experts, shape.hidden, shape.inter, shape.top_k) == \
            (p.num_experts, p.hidden, p.inter, p.top_k)
    with pytest.raises(SystemExit):
        serve_bench.preset_config("Llama-3-8B")


def test_prepare_writes_the_config_and_keeps_an_existing_tokenizer(model_dir, tmp_path):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    assert cfg == e2e.MODEL_CONFIGS["Qwen3-30B-A3B"]
    assert all(os.path.isfile(os.path.join(model_dir, f)) for f in serve_bench.TOKENIZER_FILES)
    # A folder with its own config and tokenizer: both kept as they are.
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"architectures": ["X"], "vocab_size": 100}))
    (own / "tokenizer.json").write_text("{}")
    (own / "tokenizer_config.json").write_text("{}")
    path, cfg = serve_bench.prepare_model_dir(str(own), None)
    assert cfg["vocab_size"] == 100 and (own / "tokenizer.json").read_text() == "{}"
    # The default folder depends on the config only (vLLM's compile cache key holds the path).
    c = serve_bench.preset_config("Qwen3-30B-A3B")
    assert serve_bench.default_model_dir(c, "q") == serve_bench.default_model_dir(dict(c), "q")
    assert serve_bench.default_model_dir(c, "q") != serve_bench.default_model_dir({**c, "vocab_size": 1}, "q")


def test_special_tokens_of_any_config():
    assert serve_bench.special_tokens({"vocab_size": 100, "bos_token_id": 1, "eos_token_id": [2, 3]}) == \
        {1: "<s>", 2: "</s>", 3: "</s1>", 99: "<unk>"}
    qwen = serve_bench.special_tokens(serve_bench.preset_config("Qwen3-30B-A3B"), "Qwen3-30B-A3B")
    assert qwen[151645] == "<|im_end|>" and qwen[151935] == "<unk>"
    assert serve_bench.special_tokens({"vocab_size": 50, "eos_token_id": 49}) == {49: "</s>", 48: "<unk>"}
    for bad in ({"vocab_size": 10, "eos_token_id": 10}, {"eos_token_id": 1}, {"vocab_size": True}):
        with pytest.raises(SystemExit):
            serve_bench.special_tokens(bad)


@needs_tokenizers
def test_tokenizer_loads_offline_with_transformers_and_round_trips(model_dir, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    vocab = e2e.MODEL_CONFIGS["Qwen3-30B-A3B"]["vocab_size"]
    assert len(tok) == vocab and tok.vocab_size == vocab
    assert tok.num_special_tokens_to_add() == 0  # a prompt is its random tokens alone
    assert tok.eos_token_id == 151645 and sorted(tok.all_special_ids) == [151643, 151644, 151645, 151935]
    # What vLLM's random dataset does: token ids -> text -> the same ids again.
    import random

    rng = random.Random(0)
    special = set(tok.all_special_ids)
    for n in (1, 128, 2048):
        ids = [i for i in (rng.randrange(vocab) for _ in range(n + 8)) if i not in special][:n]
        text = tok.decode(ids)
        assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode([5, 6, 151645], skip_special_tokens=True) == "t5 t6"
    assert tok.encode("t5 hello", add_special_tokens=False) == [5, 151935]  # unknown word -> <unk>


# ---- command lines and environment --------------------------------------------------------------


def test_capture_sizes_and_prompt_counts():
    assert serve_bench.capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert serve_bench.capture_sizes(8) == [1, 2, 4, 8]
    assert serve_bench.capture_sizes(12) == [1, 2, 4, 8, 12]
    assert serve_bench.capture_sizes(1) == [1]
    a = _args()
    assert [serve_bench.num_prompts(c, a) for c in (1, 8, 32)] == [16, 16, 64]
    assert serve_bench.max_num_seqs(a) == 32
    assert serve_bench.max_num_seqs(_args("--concurrency", "1,4", "--parts", "serve")) == 4
    assert serve_bench.max_num_seqs(_args("--concurrency", "1,4")) == 8  # the latency batches too


def test_server_and_latency_share_the_engine_arguments():
    a = _args()
    engine = serve_bench.engine_argv(a)
    serve = serve_bench.serve_argv(a, "/m", 8000)
    lat = serve_bench.latency_argv(a, "/m", 8, "/o.json")
    assert serve[:2] == ["serve", "/m"] and serve[2:2 + len(engine)] == engine
    assert lat[:2] == ["--model", "/m"] and lat[2:2 + len(engine)] == engine
    assert "--load-format" in engine and engine[engine.index("--load-format") + 1] == "dummy"
    assert json.loads(engine[engine.index("--compilation-config") + 1]) == \
        {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32]}


def test_child_env_per_setting():
    a = _args()
    base = {"PYTHONPATH": "/site", "OPGRAFT_DISABLE": "1", "KEEP": "x"}
    off, on = serve_bench.child_env("disabled", a, base), serve_bench.child_env("opgraft", a, base)
    assert off["OPGRAFT_DISABLE"] == "1" and "OPGRAFT_DISABLE" not in on and on["OPGRAFT_MOE_EXPERTS"] == "opgraft"
    for env in (off, on):
        assert env["OPGRAFT_STATS"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1" and env["KEEP"] == "x"
        assert env["PYTHONPATH"] == ROOT + os.pathsep + "/site"
        assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in env
    # vLLM's own variables are part of its compile cache key: equal in both settings.
    assert {k: v for k, v in off.items() if k.startswith("VLLM_")} == {k: v for k, v in on.items() if k.startswith("VLLM_")}
    sep = _args("--compile-cache", "separate")
    assert serve_bench.child_env("disabled", sep, base)["VLLM_CACHE_ROOT"] != \
        serve_bench.child_env("opgraft", sep, base)["VLLM_CACHE_ROOT"]


def test_cli_rejects_bad_arguments():
    for argv in (["study", "--out-dir", "x", "--lengths", "128"], ["study", "--out-dir", "x", "--lengths", "128x1"],
                 ["study", "--out-dir", "x", "--modes", "stock"], ["study", "--out-dir", "x", "--parts", "serve,serve"],
                 ["study", "--out-dir", "x", "--max-model-len", "300"],
                 ["study", "--out-dir", "x", "--long", "--max-model-len", "2048"],
                 ["study", "--out-dir", "x", "--concurrency", "0"], ["study", "--out-dir", "x", "--init-std", "2"],
                 ["prepare"]):
        with pytest.raises(SystemExit) as ei:
            serve_bench.main(argv)
        assert ei.value.code == 2, argv


def _run_check(what, where):
    res = subprocess.run([sys.executable, os.path.join(HERE, "serve_bench_vllm_check.py"), what, where],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(line[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def parsed(model_dir):
    return _run_check("parse", model_dir)


@needs_vllm
def test_command_lines_parse_with_vllms_own_parsers(parsed, model_dir):
    got = parsed
    s = got["serve"]
    assert s["model_tag"] == model_dir and s["load_format"] == "dummy" and s["max_model_len"] == 4096
    assert s["max_num_seqs"] == 32 and s["max_num_batched_tokens"] == 8192 and s["enable_prefix_caching"] is False
    assert s["worker_cls"] == serve_bench.WORKER_CLS and s["port"] == 8123 and s["capture"] == [1, 2, 4, 8, 16, 24, 32]
    c = got["client"]
    assert (c["dataset_name"], c["random_input_len"], c["random_output_len"], c["max_concurrency"]) == ("random", 128, 256, 8)
    assert c["ignore_eos"] is True and c["temperature"] == 0 and c["save_result"] is True and c["num_prompts"] == 16
    assert c["metric_percentiles"] == "50,90,99" and c["metadata"] == ["mode=opgraft", "input_len=128", "output_len=256"]
    lat = got["latency"]
    assert (lat["batch_size"], lat["input_len"], lat["output_len"], lat["num_iters"]) == (8, 128, 256, 8)
    assert lat["worker_cls"] == serve_bench.WORKER_CLS and lat["enable_prefix_caching"] is False


@needs_vllm
def test_the_server_and_bench_latency_configs_hash_alike(parsed):
    """They then share torch.compile's cache."""
    if "no_config" in parsed:
        pytest.skip(f"this vLLM builds no engine configuration on this host: {parsed['no_config']}")
    a, b = parsed["hashes"]
    assert a == b


@needs_vllm
def test_latency_runner_runs_vllms_bench_latency_on_one_engine(tmp_path):
    got = _run_check("latency-memo", str(tmp_path))
    assert got["rc"] == 0 and got["engines"] == 1 and got["rpcs"] == ["opgraft_stats"]
    assert [r["ok"] for r in got["status"]["runs"]] == [True, True]
    assert got["status"]["stats"] == [{"moe": {"taken": 7}}]
    assert all({"avg_latency", "latencies", "percentiles"} <= set(keys) for keys in got["result_keys"])


# ---- summaries ----------------------------------------------------------------------------------

META = {"gpu": "NVIDIA H200", "date": "2026-12-01", "vllm": "0.26.0", "commit": "abc"}


def test_serve_row_from_vllm_result_keys():
    res = {"median_tpot_ms": 4.0, "p99_tpot_ms": 4.5, "median_itl_ms": 3.9, "p99_itl_ms": 6.0,
           "median_ttft_ms": 20.0, "p99_ttft_ms": 30.0, "output_throughput": 250.0, "num_prompts": 16,
           "completed": 16, "failed": 0, "duration": 17.0}
    row = serve_bench.serve_row(res, "opgraft", 128, 256, 1, META, "vllm/x.json")
    assert row["client"] == "vllm bench serve" and row["mode"] == "opgraft" and row["concurrency"] == 1
    assert (row["tpot_ms_median"], row["tpot_ms_p99"], row["itl_ms_median"], row["itl_ms_p99"]) == (4.0, 4.5, 3.9, 6.0)
    assert (row["ttft_ms_median"], row["ttft_ms_p99"], row["output_tok_s"]) == (20.0, 30.0, 250.0)
    assert (row["gpu"], row["date"], row["vllm"], row["commit"]) == ("NVIDIA H200", "2026-12-01", "0.26.0", "abc")
    assert (row["input_len"], row["output_len"]) == (128, 256)
    lrow = serve_bench.latency_row({"avg_latency": 1.1, "latencies": [1.0, 1.2], "percentiles": {"50": 1.05, "99": 1.2}},
                                   "disabled", 8, 128, 256, META, "vllm/l.json")
    assert (lrow["client"], lrow["batch_size"], lrow["latency_s_median"], lrow["latency_s_p99"], lrow["iters"]) == \
        ("vllm bench latency", 8, 1.05, 1.2, 2)


def test_bad_request_comparison():
    def res(over, zero, ok=True):
        return {"checks": {"over_long_prompt": {"status": over, "error_type": "BadRequestError"},
                           "max_tokens_0": {"status": zero, "error_type": "BadRequestError" if zero == 400 else ""},
                           "malformed_json": {"status": 400, "error_type": "Bad Request"}},
                "good_after": {"ok": ok}}

    same = serve_bench.compare_bad_requests({"disabled": res(400, 400), "opgraft": res(400, 400)})
    assert same["same_as_stock"] is True and all(c["same"] for c in same["checks"])
    assert same["kept_serving"] == {"disabled": True, "opgraft": True}
    diff = serve_bench.compare_bad_requests({"disabled": res(400, 400), "opgraft": res(400, 200, ok=False)})
    assert diff["same_as_stock"] is False and [c["same"] for c in diff["checks"]] == [True, False, True]
    assert diff["kept_serving"]["opgraft"] is False
    assert serve_bench.compare_bad_requests({"opgraft": res(400, 400)})["same_as_stock"] is None
    assert serve_bench.error_type({"error": {"type": "BadRequestError"}}) == "BadRequestError"
    assert serve_bench.error_type({"detail": "x"}) == "detail" and serve_bench.error_type({"choices": []}) == ""
    assert serve_bench.error_type("Internal Server Error").startswith("unparsed")


def test_plugin_lines_by_process(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) INFO [__init__.py:113] opgraft 0.1.0: MoE experts seam installed\n"
                   "(APIServer pid=1) INFO [api_server.py:1] Starting vLLM API server\n"
                   "(EngineCore pid=2) INFO [__init__.py:113] opgraft 0.1.0: MoE experts seam installed\n"
                   "(EngineCore pid=2) INFO [dispatch.py:1] moe call handed back to vLLM: 12 tokens > moe.max_tokens 8\n"
                   "(EngineCore pid=2) WARNING [dispatch.py:2] opgraft stats (pid 2): moe calls taken 5, handed back 1 {}\n")
    got = serve_bench.plugin_lines(str(log))
    assert len(got["api_server"]) == 1 and len(got["engine_core"]) == 3
    assert serve_bench.plugin_lines(str(tmp_path / "none.log")) == {"api_server": [], "engine_core": []}


# ---- the study against a stand-in vLLM ----------------------------------------------------------


@pytest.fixture()
def fake_python(tmp_path):
    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {HERE!r})\nimport fake_vllm\n"
                    "sys.exit(fake_vllm.main(sys.argv[1:]))\n")
    path.chmod(0o755)
    return str(path)


def _study(model_dir, fake_python, out, monkeypatch, flags="", extra=()):
    monkeypatch.setenv("FAKE_VLLM", flags)
    rc = serve_bench.main(["study", "--out-dir", str(out), "--model-dir", model_dir, "--python", fake_python,
                           "--startup-timeout", "60", *extra])
    with open(out / "serve-summary.json") as f:
        return rc, json.load(f)


def test_study_with_a_stand_in_vllm(model_dir, fake_python, tmp_path, monkeypatch, capsys):
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch)
    assert rc == 0 and s["failures"] == []
    assert sorted((r["mode"], r["concurrency"]) for r in s["rows"]) == \
        [(m, c) for m in ("disabled", "opgraft") for c in (1, 8, 32)]
    fields = ("client", "mode", "concurrency", "input_len", "output_len", "tpot_ms_median", "tpot_ms_p99",
              "itl_ms_median", "itl_ms_p99", "ttft_ms_median", "ttft_ms_p99", "output_tok_s", "gpu", "date",
              "vllm", "commit")
    assert all(all(k in r for k in fields) and r["tpot_ms_median"] > 0 for r in s["rows"])
    assert all(os.path.isfile(tmp_path / "out" / r["result_file"]) for r in s["rows"] + s["latency_rows"])
    assert sorted((r["mode"], r["batch_size"]) for r in s["latency_rows"]) == \
        [("disabled", 1), ("disabled", 8), ("opgraft", 1), ("opgraft", 8)]
    cmp = s["bad_requests_compare"]
    assert cmp["same_as_stock"] is True and cmp["kept_serving"] == {"disabled": True, "opgraft": True}
    checks = s["bad_requests"]["opgraft"]["checks"]
    assert checks["over_long_prompt"]["status"] == 400 and checks["malformed_json"]["status"] == 400
    assert s["counters"]["serve:opgraft"][0]["moe"]["taken"] == 96 and s["counters"]["serve:disabled"][0]["moe"] is None
    log = s["plugin_log"]["serve:opgraft"]
    assert any("MoE experts seam installed" in ln for ln in log["api_server"])
    assert any("MoE experts seam installed" in ln for ln in log["engine_core"])
    assert any("opgraft stats (pid" in ln for ln in log["engine_core"])  # the clean stop wrote them
    assert s["stops"]["serve:opgraft"]["how"] == "SIGINT"
    assert all(v.startswith("done") for v in s["phases"].values()) and len(s["phases"]) == 4
    assert s["commands"]["serve:opgraft"]["server"].startswith("vllm serve " + model_dir + " --load-format dummy")
    out = capsys.readouterr().out
    assert "TPOT/stock" in out and "same answers as stock: yes" in out


def test_study_exits_nonzero_when_a_server_does_not_start(model_dir, fake_python, tmp_path, monkeypatch, capsys):
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "serve-exits", ["--parts", "serve"])
    assert rc == 1
    assert [f["setting"] for f in s["failures"]] == ["serve:disabled", "serve:opgraft"]  # the next still ran
    for f in s["failures"]:
        assert "exited with status 3" in f["error"] and "fake start-up failure" in f["error"]  # the log's tail
    out = capsys.readouterr().out
    assert "FAILED serve:disabled" in out and "fake start-up failure" in out


def test_study_exits_nonzero_when_the_client_fails(model_dir, fake_python, tmp_path, monkeypatch):
    opts = ["--parts", "serve", "--modes", "opgraft"]
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "", opts)
    assert rc == 0 and len(s["rows"]) == 3
    # Again into the same folder, the client failing: the first run's result files are not taken.
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "client-fails", opts)
    assert rc == 1 and s["failures"][0]["setting"] == "serve:opgraft" and s["rows"] == []
    assert "vllm bench serve failed" in s["failures"][0]["error"] and "fake client failure" in s["failures"][0]["error"]
    assert s["bad_requests"]["opgraft"]["good_after"]["ok"] is True  # the rest of the setting still ran


def test_study_exits_nonzero_when_latency_fails(model_dir, fake_python, tmp_path, monkeypatch):
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "latency-fails", ["--parts", "latency"])
    assert rc == 1 and [f["setting"] for f in s["failures"]] == ["latency:disabled", "latency:opgraft"]
    assert "fake latency failure" in s["failures"][0]["error"]


def test_study_reports_a_different_answer_to_a_bad_request(model_dir, fake_python, tmp_path, monkeypatch, capsys):
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "opgraft-differs", ["--parts", "serve"])
    cmp = s["bad_requests_compare"]
    assert cmp["same_as_stock"] is False
    assert [c["name"] for c in cmp["checks"] if not c["same"]] == ["max_tokens_0"]
    assert "same answers as stock: NO" in capsys.readouterr().out


def test_budget_skips_the_phases_that_do_not_fit(model_dir, fake_python, tmp_path, monkeypatch):
    # The first phase always runs; bench latency's estimate (from the first start-up and a guess
    # of its runs' length) exceeds what is left.
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "",
                   ["--modes", "disabled", "--budget-s", "30"])
    assert rc == 0 and s["phases"]["serve:disabled"].startswith("done")
    assert s["phases"]["latency:disabled"].startswith("skipped") and "--parts latency" in s["phases"]["latency:disabled"]


def test_budget_runs_the_latency_settings_together_or_not_at_all(model_dir, fake_python, tmp_path, monkeypatch):
    # The first latency phase needs room for both settings; when it is skipped the second one,
    # whose own estimate is one setting's, is skipped with it (a GPU run once ran it alone).
    monkeypatch.setattr(serve_bench, "estimate_s",
                        lambda part, index, args, seen: 1e6 if (part, index) == ("latency", 0) else 0.0)
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "", ["--budget-s", "300"])
    assert rc == 0 and s["phases"]["serve:disabled"].startswith("done") and s["phases"]["serve:opgraft"].startswith("done")
    assert s["phases"]["latency:disabled"].startswith("skipped: needs")
    assert s["phases"]["latency:opgraft"].startswith("skipped with latency:disabled")
    assert not s["latency_rows"]


@needs_vllm
def test_vllms_bench_serve_client_against_a_stand_in_server(model_dir, fake_python, tmp_path, monkeypatch):
    """vLLM's own `vllm bench serve` code (random dataset with the local tokenizer, streaming,
    its result file) against the stand-in server; the summary reads its result file."""
    rc, s = _study(model_dir, fake_python, tmp_path / "out", monkeypatch, "real-client",
                   ["--parts", "serve", "--modes", "disabled", "--concurrency", "1,4", "--lengths", "16x8",
                    "--min-prompts", "4"])
    assert rc == 0, s["failures"]
    for r in s["rows"]:
        res = json.load(open(tmp_path / "out" / r["result_file"]))
        assert res["completed"] == r["num_prompts"] and res["total_input_tokens"] == 16 * r["num_prompts"]
        assert res["total_output_tokens"] == 8 * r["num_prompts"] and res["mode"] == "disabled"
        assert all(isinstance(r[k], float) and r[k] > 0 for k in ("tpot_ms_median", "tpot_ms_p99", "itl_ms_median",
                                                                 "ttft_ms_median", "output_tok_s"))


@needs_vllm
def test_worker_class_reinitialises_after_loading_and_reports_counters(monkeypatch):
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu_worker import Worker

    from tools import serve_worker

    cls = resolve_obj_by_qualname(serve_bench.WORKER_CLS)  # how vLLM finds --worker-cls
    assert cls is serve_worker.ReinitWorker and issubclass(cls, Worker)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(64, 64)
    model.input_layernorm = torch.nn.LayerNorm(64)
    loaded = []
    monkeypatch.setattr(Worker, "load_model", lambda self, **kw: loaded.append(kw))
    w = cls.__new__(cls)
    w.model_runner = SimpleNamespace(get_model=lambda: model)
    monkeypatch.setenv(serve_worker.INIT_STD_ENV, "0.02")
    w.load_model(load_dummy_weights=True)
    assert loaded == [{"load_dummy_weights": True}]  # vLLM's own loading first
    assert torch.all(model.input_layernorm.weight == 1) and torch.all(model.proj.bias == 0)
    assert abs(model.proj.weight.std().item() - 0.02) < 0.004
    first = model.proj.weight.clone()
    w.load_model()
    assert torch.equal(first, model.proj.weight)  # seeded per parameter name: the same in every setting
    stats = w.opgraft_stats()
    assert stats["init"]["std"] == 0.02 and stats["init"]["params"] == 4 and "plugin" in stats and "pid" in stats
    monkeypatch.setenv(serve_worker.INIT_STD_ENV, "0")
    w.load_model()
    assert w.opgraft_stats()["init"] == {"std": 0.0, "params": 0}
    monkeypatch.setenv(serve_worker.INIT_STD_ENV, "x")
    with pytest.raises(ValueError):
        w.load_model()


def test_phase_estimates_for_the_budget():
    a = _args()
    seen = {"startup": [], "client": 0.0, "latency": 0.0}
    assert serve_bench.estimate_s("serve", 0, a, seen) == \
        serve_bench.COLD_START_S + serve_bench.client_guess_s(a) + serve_bench.PHASE_OVERHEAD_S
    seen.update(startup=[150.0, 80.0], client=45.0)
    assert serve_bench.estimate_s("serve", 1, a, seen) == 80.0 + 45.0 + serve_bench.PHASE_OVERHEAD_S
    one = 80.0 + serve_bench.latency_guess_s(a) + serve_bench.PHASE_OVERHEAD_S
    assert serve_bench.estimate_s("latency", 0, a, seen) == 2 * one  # room for both settings, or neither
    seen["latency"] = 120.0
    assert serve_bench.estimate_s("latency", 1, a, seen) == 120.0
    # The guesses grow with the work asked for.
    assert serve_bench.client_guess_s(_args("--lengths", "128x256,2048x256")) > serve_bench.client_guess_s(a) > 30
    assert serve_bench.latency_guess_s(_args("--latency-iters", "16")) > serve_bench.latency_guess_s(a) > 10


def test_local_requests_bypass_a_proxy(monkeypatch):
    env = serve_bench.child_env("opgraft", _args(), {"no_proxy": "corp.example", "http_proxy": "http://proxy:1"})
    assert env["no_proxy"] == "corp.example,127.0.0.1,localhost" and env["NO_PROXY"] == "127.0.0.1,localhost"
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # nothing listens there
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=srv.handle_request, daemon=True).start()
    assert serve_bench.http_request("GET", f"http://127.0.0.1:{srv.server_port}/health", timeout=10) == (200, {})
    srv.server_close()
