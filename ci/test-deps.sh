#!/usr/bin/env bash
# Installs what `make test` needs when it is missing: cmocka (C unit tests) and pytest. Each
# install is announced with its exact command before it runs, and its own output is shown.
set -euo pipefail
PYTHON=${PYTHON:-python3}
CC=${CC:-cc}
say() { echo "test-deps: $*"; }
run() {
  echo "test-deps: + $*"
  "$@"
}
have_cmocka() {
  pkg-config --exists cmocka 2>/dev/null && return 0
  # The header where the compiler looks (cmocka.h needs these four first).
  printf '#include <stdarg.h>\n#include <stddef.h>\n#include <stdint.h>\n#include <setjmp.h>\n#include <cmocka.h>\n' |
    "$CC" -E -x c - >/dev/null 2>&1
}
if have_cmocka; then
  say "cmocka present"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  say "cmocka is missing: installing the system package libcmocka-dev with apt-get"
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libcmocka-dev ||
    { run apt-get update -q && run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libcmocka-dev; }
else
  echo "test-deps: cmocka is missing: install libcmocka-dev (Debian/Ubuntu) or cmocka-devel (Fedora)" >&2
  exit 1
fi
if "$PYTHON" -c "import pytest" 2>/dev/null; then
  say "pytest present ($PYTHON)"
else
  say "pytest is missing: installing it into $PYTHON's environment with pip"
  run "$PYTHON" -m pip install "pytest>=7"
fi
