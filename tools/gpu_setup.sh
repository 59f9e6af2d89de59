# Sourced (not run) by the GPU-host scripts tools/gpu_vllm_study.sh and tools/gpu_serve_study.sh,
# from the checkout's root, with $parts (the folder of a wheelhouse staged with
# stage_wheelhouse.py, docs/AIRGAP.md) and $out (the results folder) set. Installs vLLM from the
# wheelhouse (unless OPGRAFT_SITE already has it) and opgraft from this checkout into OPGRAFT_SITE
# (default /tmp/opgraft-site), exports PYTHONPATH, and prints the versions and the GPU it found.
# Leaves: site, log ($out/setup.log, every step timed), t0, and stamp NAME (prints the seconds
# since start, into setup.log too). A failed install step ends the calling script (exit 1) after
# printing the log's last lines.
site=${OPGRAFT_SITE:-/tmp/opgraft-site}
mkdir -p "$out" "$site"
log=$out/setup.log
t0=$(date +%s.%N)
stamp() { awk -v a="$t0" -v b="$(date +%s.%N)" -v n="$1" 'BEGIN { printf "[%-22s] %7.1f s since start\n", n, b - a }' | tee -a "$log"; }

if PYTHONPATH=$site python3 -c "import vllm" >/dev/null 2>&1; then
  echo "vLLM already installed in $site" | tee -a "$log"
else
  bash tools/unstage_wheelhouse.sh --target "$site" --work /tmp/opgraft-unstage \
    --pip-arg=--no-compile "$parts" >>"$log" 2>&1 || { tail -40 "$log"; exit 1; }
  rm -rf /tmp/opgraft-unstage/wheels
fi
stamp "vLLM wheelhouse installed"
export PYTHONPATH=$site
if ! python3 -m pip install -q --no-index --no-build-isolation --no-deps --upgrade --target "$site" . \
    >>"$log" 2>&1; then
  # No usable build backend here: build with CMake and lay the package out by hand, with the
  # entry point vLLM looks for.
  echo "pip could not build opgraft; CMake build + manual layout" | tee -a "$log"
  { cmake -S . -B /tmp/opgraft-build -DOPGRAFT_BUILD_TESTS=OFF && cmake --build /tmp/opgraft-build -j; } \
    >>"$log" 2>&1 || { tail -40 "$log"; exit 1; }
  rm -rf "$site/opgraft" "$site"/opgraft-*.dist-info
  cp -r python/opgraft "$site/" && cp -P /tmp/opgraft-build/libopgraft.so* "$site/opgraft/"
  ver=$(python3 -c "import sys; sys.path.insert(0, 'python'); import opgraft; print(opgraft.__version__)")
  di=$site/opgraft-$ver.dist-info
  mkdir -p "$di"
  printf 'Metadata-Version: 2.1\nName: opgraft\nVersion: %s\n' "$ver" >"$di/METADATA"
  python3 - "$di/entry_points.txt" <<'PY'  # the entry points pyproject.toml declares
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
groups = dict(p.get("entry-points", {}), console_scripts=p.get("scripts", {}))
with open(sys.argv[1], "w") as f:
    for g, eps in groups.items():
        f.write(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
PY
fi
stamp "opgraft installed"
python3 - <<'PY' 2>&1 | grep -v "^INFO\|^WARNING" | tee -a "$log"
from importlib.metadata import entry_points, version
import torch
print("vllm", version("vllm"), "| torch", torch.__version__, "| opgraft", version("opgraft"),
      "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("vllm.general_plugins:", [f"{e.name} = {e.value}" for e in entry_points(group="vllm.general_plugins")])
PY
stamp "checked"
