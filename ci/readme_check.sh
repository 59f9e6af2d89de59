#!/usr/bin/env bash
# The README's two commands as a new user runs them: in a fresh virtualenv, from this checkout,
# with no GPU visible. The commands are read from the README's first code block, so the check
# follows the README. The first (`pip install . && opgraft bench moe ...`) must exit 0 and say that
# there is no GPU and what it ran instead; the installed wheel must carry the manylinux_2_28 tag
# and its libopgraft need no newer glibc; then the second (`make test`) runs in that virtualenv.
#
# pip's own cache is used (torch comes from PyPI: a few GB the first time, from the cache after).
# The virtualenv is removed at the end. OPGRAFT_README_CHECK is set for everything it runs, and a
# check started under it returns at once: the check never runs itself again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${OPGRAFT_README_CHECK:-}" ]; then
  echo "readme check: skipped (already inside one)"
  exit 0
fi
export OPGRAFT_README_CHECK=1
t0=$SECONDS
step() { echo "== readme check [$((SECONDS - t0)) s]: $*"; }
fail() {
  echo "readme check: FAILED: $*" >&2
  exit 1
}

# The README's first code block: its first two commands, trailing comments removed.
mapfile -t CMDS < <(awk '/^```/ { n++; next } n == 1' README.md | sed -e 's/[[:space:]]*#.*$//' -e '/^[[:space:]]*$/d')
[ "${#CMDS[@]}" -ge 2 ] || fail "README.md's first code block does not hold two commands"
INSTALL_AND_BENCH=${CMDS[0]}
TEST=${CMDS[1]}
case "$INSTALL_AND_BENCH" in *"pip install ."*"opgraft bench"*) ;; *) fail "unexpected first command: $INSTALL_AND_BENCH" ;; esac
[ "$TEST" = "make test" ] || fail "unexpected second command: $TEST"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/opgraft-readme-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
VENV_PY=${OPGRAFT_README_CHECK_PYTHON:-python3}
step "fresh virtualenv in $WORK/venv ($("$VENV_PY" --version 2>&1))"
"$VENV_PY" -m venv "$WORK/venv"

# Only what a new user's shell has: the virtualenv first on PATH, no settings of the CI's own
# environments (their interpreters, the vLLM they expect), no GPU.
run_as_user() {
  env -u PYTHON -u PYTHONPATH -u NEWEST_VLLM_PYTHON -u OPGRAFT_EXPECT_VLLM_NEWEST -u OPGRAFT_REQUIRE_VLLM \
    -u OPGRAFT_LIBRARY -u OPGRAFT_CACHE_DIR VIRTUAL_ENV="$WORK/venv" PATH="$WORK/venv/bin:$PATH" \
    CUDA_VISIBLE_DEVICES="" PIP_PROGRESS_BAR=off PIP_DISABLE_PIP_VERSION_CHECK=1 bash -c "$1"
}

step "\$ $INSTALL_AND_BENCH"
rc=0
run_as_user "$INSTALL_AND_BENCH" 2>&1 | tee "$WORK/first.log" || rc=$?
[ "$rc" = 0 ] || fail "the README's first command exited $rc"
grep -q "^no GPU here (torch sees no CUDA GPU)" "$WORK/first.log" || fail "the bench did not say that there is no GPU"
grep -q "C fp64 oracle vs Python loop" "$WORK/first.log" || fail "the bench did not report its oracle check"
grep -q "moe_gate_up_bf16" "$WORK/first.log" || fail "the bench did not report the kernels' compile"

step "the installed wheel: its tag and libopgraft's glibc symbol versions"
site=$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
tag=$(sed -n 's/^Tag: //p' "$site"/opgraft-*.dist-info/WHEEL)
echo "wheel tag: $tag"
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
  [ "$tag" = py3-none-manylinux_2_28_x86_64 ] || fail "the wheel is tagged $tag, not py3-none-manylinux_2_28_x86_64"
  "$WORK/venv/bin/python" -m tools.glibc_check "$site"/opgraft/libopgraft.so* || fail "libopgraft needs a newer glibc"
  # The same wheel file again, for auditwheel's own verdict (PyPA's checker, where it installs).
  "$WORK/venv/bin/pip" wheel -q --no-deps -w "$WORK/wheel" . || fail "pip wheel . failed"
  if "$WORK/venv/bin/pip" install -q auditwheel; then
    "$WORK/venv/bin/auditwheel" show "$WORK"/wheel/opgraft-*.whl | tee "$WORK/auditwheel.txt"
    grep -Eq 'consistent with.*"manylinux_2_([0-9]|1[0-9]|2[0-8])_x86_64"' <(tr '\n' ' ' < "$WORK/auditwheel.txt") ||
      fail "auditwheel does not find the wheel consistent with manylinux_2_28_x86_64 or older"
  else
    echo "readme check: auditwheel could not be installed: its check is skipped (tools.glibc_check passed)"
  fi
fi
"$WORK/venv/bin/python" -c 'import torch; print("torch", torch.__version__, "installed with opgraft")'

step "\$ $TEST"
run_as_user "$TEST" || fail "the README's test command failed in the fresh virtualenv"
step "both README commands passed"
