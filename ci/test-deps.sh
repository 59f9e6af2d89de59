#!/usr/bin/env bash
# Installs what `make test` needs when it is missing: cmocka (C unit tests) and pytest.
set -euo pipefail
PYTHON=${PYTHON:-python3}
have_cmocka() {
  pkg-config --exists cmocka 2>/dev/null || [ -f /usr/include/cmocka.h ] || [ -f /usr/local/include/cmocka.h ]
}
if ! have_cmocka; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing libcmocka-dev (C unit tests)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libcmocka-dev >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libcmocka-dev >/dev/null; }
  else
    echo "cmocka is missing: install libcmocka-dev (Debian/Ubuntu) or cmocka-devel (Fedora)" >&2
    exit 1
  fi
fi
if ! "$PYTHON" -c "import pytest" 2>/dev/null; then
  echo "installing pytest"
  "$PYTHON" -m pip install -q "pytest>=7"
fi
