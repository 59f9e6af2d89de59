#!/usr/bin/env bash
# Reassemble, verify and install a wheelhouse made by stage_wheelhouse.py, on the (air-gapped)
# target. Needs bash, coreutils (cat, sha256sum or python3's hashlib), tar and python3 with pip.
#
#   unstage_wheelhouse.sh [options] PARTS_DIR
#
# PARTS_DIR holds wheelhouse.tar.partNNN (collected over any number of transfers) and
# manifest.json. Steps, each timed:
#   1. read the manifest            4. concatenate the parts, check the tar's sha256
#   2. check every part is present  5. extract, check every wheel's size and sha256
#   3. check every part's sha256    6. pip install --no-index --no-deps (unless --verify-only)
#   7. check that the packages the target already had (skipped at staging) meet the staged
#      packages' requirements (a warning, or an error with --strict)
#
# Options:
#   --manifest FILE   manifest (default PARTS_DIR/manifest.json)
#   --work DIR        where the tar and the wheels go (default PARTS_DIR/unstaged)
#   --target DIR      install with pip --target DIR (default WORK/site); use it with
#                     PYTHONPATH=DIR
#   --into-env        install into the environment of --python instead of a --target folder
#   --python PY       interpreter that runs pip (default: python3)
#   --pip-arg ARG     extra argument for pip install (repeatable), e.g. --pip-arg=--no-compile
#   --verify-only     stop after step 5 (no install); for checking a transfer
#   --keep-tar        keep WORK/wheelhouse.tar (default: deleted once extracted)
#   --strict          fail (exit 8) when step 7 finds an unmet requirement
#   -h, --help
#
# Exit status: 0 ok, 2 usage or unreadable manifest, 3 missing part(s), 4 corrupt part(s),
# 5 tar checksum mismatch, 6 wheel missing or corrupt, 7 pip install failed, 8 unmet
# requirement (--strict only).
set -euo pipefail

PYTHON=${PYTHON:-python3}
MANIFEST=""
WORK=""
TARGET=""
INTO_ENV=0
VERIFY_ONLY=0
KEEP_TAR=0
STRICT=0
PIP_ARGS=()
PARTS_DIR=""

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; }
die() { local code=$1; shift; printf 'ERROR: %s\n' "$*" >&2; exit "$code"; }

while [ $# -gt 0 ]; do
  case "$1" in
    --manifest) MANIFEST=${2:?--manifest needs a file}; shift 2 ;;
    --manifest=*) MANIFEST=${1#*=}; shift ;;
    --work) WORK=${2:?--work needs a folder}; shift 2 ;;
    --work=*) WORK=${1#*=}; shift ;;
    --target) TARGET=${2:?--target needs a folder}; shift 2 ;;
    --target=*) TARGET=${1#*=}; shift ;;
    --into-env) INTO_ENV=1; shift ;;
    --python) PYTHON=${2:?--python needs an interpreter}; shift 2 ;;
    --python=*) PYTHON=${1#*=}; shift ;;
    --pip-arg) PIP_ARGS+=("${2:?--pip-arg needs a value}"); shift 2 ;;
    --pip-arg=*) PIP_ARGS+=("${1#*=}"); shift ;;
    --verify-only) VERIFY_ONLY=1; shift ;;
    --keep-tar) KEEP_TAR=1; shift ;;
    --strict) STRICT=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) usage >&2; die 2 "unknown option $1" ;;
    *) [ -z "$PARTS_DIR" ] || die 2 "only one PARTS_DIR, got '$PARTS_DIR' and '$1'"
       PARTS_DIR=$1; shift ;;
  esac
done
[ -n "$PARTS_DIR" ] || { usage >&2; die 2 "PARTS_DIR is missing"; }
[ -d "$PARTS_DIR" ] || die 2 "no such folder: $PARTS_DIR"
[ "$INTO_ENV" = 1 ] && [ -n "$TARGET" ] && die 2 "--into-env and --target exclude each other"
PARTS_DIR=$(cd "$PARTS_DIR" && pwd)
MANIFEST=${MANIFEST:-$PARTS_DIR/manifest.json}
WORK=${WORK:-$PARTS_DIR/unstaged}
[ -f "$MANIFEST" ] || die 2 "manifest not found: $MANIFEST (copy manifest.json next to the parts or pass --manifest)"
command -v "$PYTHON" >/dev/null 2>&1 || die 2 "no python interpreter '$PYTHON' (set --python)"

now() { date +%s.%N 2>/dev/null || date +%s; }
T_ALL=$(now)
T_STEP=$T_ALL
step_done() {  # step_done NAME: print how long the step took
  local t; t=$(now)
  awk -v a="$T_STEP" -v b="$t" -v n="$1" 'BEGIN { printf "[%-9s] %8.2f s\n", n, b - a }'
  T_STEP=$t
}

if command -v sha256sum >/dev/null 2>&1; then
  sha256() { sha256sum "$1" | cut -d' ' -f1; }
else
  sha256() {
    "$PYTHON" -c 'import hashlib,sys
h=hashlib.sha256()
with open(sys.argv[1],"rb") as f:
    for b in iter(lambda: f.read(1<<20), b""): h.update(b)
print(h.hexdigest())' "$1"
  }
fi
fsize() { wc -c <"$1" | tr -d ' '; }
# mismatch FILE SIZE SHA256: prints why FILE is not the expected one, nothing when it is.
mismatch() {
  local size sum
  [ -f "$1" ] || { echo "missing"; return; }
  size=$(fsize "$1")
  [ "$size" = "$2" ] || { echo "size $size, expected $2"; return; }
  sum=$(sha256 "$1")
  [ "$sum" = "$3" ] || echo "sha256 $sum, expected $3"
}

# ---- 1. manifest -----------------------------------------------------------------------------
LISTING=$("$PYTHON" - "$MANIFEST" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1], encoding="utf-8"))
t = m["tar"]
print("tar\t%s\t%d\t%s" % (t["name"], t["size"], t["sha256"]))
for p in m["parts"]:
    print("part\t%s\t%d\t%s" % (p["file"], p["size"], p["sha256"]))
for w in m["wheels"]:
    print("wheel\t%s\t%d\t%s" % (w["file"], w["size"], w["sha256"]))
EOF
) || die 2 "cannot read the manifest $MANIFEST (not a stage_wheelhouse.py manifest, or damaged)"
IFS=$'\t' read -r _ TAR_NAME TAR_SIZE TAR_SHA <<<"$(grep '^tar' <<<"$LISTING")"
PARTS=(); PART_SIZES=(); PART_SHAS=()
WHEELS=(); WHEEL_SIZES=(); WHEEL_SHAS=()
while IFS=$'\t' read -r kind file size sha; do
  case "$kind" in
    part) PARTS+=("$file"); PART_SIZES+=("$size"); PART_SHAS+=("$sha") ;;
    wheel) WHEELS+=("$file"); WHEEL_SIZES+=("$size"); WHEEL_SHAS+=("$sha") ;;
  esac
done <<<"$LISTING"
[ "${#PARTS[@]}" -gt 0 ] || die 2 "the manifest lists no parts"
echo "manifest: ${#PARTS[@]} parts, tar $TAR_SIZE bytes, ${#WHEELS[@]} wheels"
step_done manifest

# ---- 2. presence -------------------------------------------------------------------------------
MISSING=()
for f in "${PARTS[@]}"; do
  [ -f "$PARTS_DIR/$f" ] || MISSING+=("$f")
done
if [ "${#MISSING[@]}" -gt 0 ]; then
  die 3 "${#MISSING[@]} of ${#PARTS[@]} parts missing from $PARTS_DIR: ${MISSING[*]}
       transfer them (again) and rerun; nothing was changed"
fi
echo "all ${#PARTS[@]} parts present"
step_done presence

# ---- 3. part checksums -------------------------------------------------------------------------
BAD=()
for i in "${!PARTS[@]}"; do
  why=$(mismatch "$PARTS_DIR/${PARTS[$i]}" "${PART_SIZES[$i]}" "${PART_SHAS[$i]}")
  [ -z "$why" ] || BAD+=("${PARTS[$i]} ($why)")
done
if [ "${#BAD[@]}" -gt 0 ]; then
  printf 'ERROR: corrupt part: %s\n' "${BAD[@]}" >&2
  die 4 "${#BAD[@]} of ${#PARTS[@]} parts are corrupt; transfer those again and rerun"
fi
echo "all ${#PARTS[@]} parts match their sha256"
step_done parts

# ---- 4. reassemble -----------------------------------------------------------------------------
mkdir -p "$WORK"
TAR=$WORK/$TAR_NAME
( cd "$PARTS_DIR" && cat "${PARTS[@]}" ) >"$TAR"
sum=$(sha256 "$TAR")
if [ "$sum" != "$TAR_SHA" ]; then
  rm -f "$TAR"
  die 5 "reassembled tar has sha256 $sum, expected $TAR_SHA (parts out of order or from another build?)"
fi
echo "tar reassembled: $TAR ($(fsize "$TAR") bytes, sha256 ok)"
step_done reassemble

# ---- 5. extract + wheel checksums --------------------------------------------------------------
rm -rf "$WORK/wheels"
tar -xf "$TAR" -C "$WORK" --no-same-owner
[ "$KEEP_TAR" = 1 ] || rm -f "$TAR"
BAD=()
WHEEL_PATHS=()
for i in "${!WHEELS[@]}"; do
  WHEEL_PATHS+=("$WORK/wheels/${WHEELS[$i]}")
  why=$(mismatch "${WHEEL_PATHS[$i]}" "${WHEEL_SIZES[$i]}" "${WHEEL_SHAS[$i]}")
  [ -z "$why" ] || BAD+=("${WHEELS[$i]} ($why)")
done
if [ "${#BAD[@]}" -gt 0 ]; then
  printf 'ERROR: bad wheel: %s\n' "${BAD[@]}" >&2
  die 6 "${#BAD[@]} wheel(s) missing or corrupt after extraction"
fi
echo "${#WHEELS[@]} wheels extracted to $WORK/wheels, all sha256 ok"
step_done extract

if [ "$VERIFY_ONLY" = 1 ]; then
  awk -v a="$T_ALL" -v b="$(now)" 'BEGIN { printf "[%-9s] %8.2f s\n", "total", b - a }'
  echo "verify-only: not installing"
  exit 0
fi

# ---- 6. install --------------------------------------------------------------------------------
"$PYTHON" -m pip --version >/dev/null 2>&1 || die 7 "$PYTHON has no pip"
INSTALL=("$PYTHON" -m pip install --no-index --no-deps --disable-pip-version-check)
if [ "$INTO_ENV" = 1 ]; then
  where="the environment of $(command -v "$PYTHON")"
else
  TARGET=${TARGET:-$WORK/site}
  mkdir -p "$TARGET"
  TARGET=$(cd "$TARGET" && pwd)
  INSTALL+=(--target "$TARGET" --upgrade)
  where=$TARGET
fi
echo "installing ${#WHEELS[@]} wheels into $where ..."
if ! "${INSTALL[@]}" ${PIP_ARGS[@]+"${PIP_ARGS[@]}"} "${WHEEL_PATHS[@]}"; then
  die 7 "pip install failed (see above); the verified wheels are in $WORK/wheels"
fi
step_done install

# ---- 7. requirements on what the target already had --------------------------------------------
if [ "$INTO_ENV" = 1 ]; then CHECK_PATH=""; else CHECK_PATH=$TARGET; fi
set +e
PYTHONPATH="$CHECK_PATH${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - "$MANIFEST" <<'EOF'
import json, sys
try:
    from importlib import metadata
except ImportError:
    sys.exit(0)
try:
    from packaging.specifiers import SpecifierSet
except ImportError:
    try:
        from pip._vendor.packaging.specifiers import SpecifierSet
    except ImportError:
        SpecifierSet = None
m = json.load(open(sys.argv[1], encoding="utf-8"))
unmet = 0
for rec in m.get("skipped_present", []):
    spec = ",".join(rec.get("specifiers", []))
    try:
        have = metadata.version(rec["name"])
    except metadata.PackageNotFoundError:
        print("  MISSING   %s%s (needed by %s): not installed here"
              % (rec["name"], spec, ", ".join(rec["required_by"])))
        unmet += 1
        continue
    if not spec or SpecifierSet is None:
        continue
    try:
        ok = SpecifierSet(spec).contains(have, prereleases=True)
    except Exception:
        continue
    if not ok:
        by = rec.get("specifiers_by") or {}
        who = "; ".join("%s needs %s" % (k, v) for k, v in by.items()
                        if v and not SpecifierSet(v).contains(have, prereleases=True))
        print("  MISMATCH  %s %s installed, but %s" % (rec["name"], have, who or spec))
        unmet += 1
print("requirements on pre-installed packages: %d checked, %d unmet"
      % (len(m.get("skipped_present", [])), unmet))
sys.exit(1 if unmet else 0)
EOF
rc=$?
set -e
step_done check
awk -v a="$T_ALL" -v b="$(now)" 'BEGIN { printf "[%-9s] %8.2f s\n", "total", b - a }'
if [ "$rc" != 0 ] && [ "$STRICT" = 1 ]; then
  die 8 "unmet requirements on pre-installed packages (listed above)"
fi
[ "$rc" != 0 ] && echo "WARNING: unmet requirements above; the install itself is complete"
if [ "$INTO_ENV" != 1 ]; then
  echo "done. Use it with:  export PYTHONPATH=$TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
else
  echo "done."
fi
