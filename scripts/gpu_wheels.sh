#!/usr/bin/env bash
# Wheels that the GPU machine lent to some sessions lacks (it reaches no package index) for the
# DeepSpeed GPU tests (tests/test_gpu_deepspeed.py, Lightning's DeepSpeedStrategy in
# tests/test_gpu.py): DeepSpeed itself (pure Python, built here from its source distribution) and
# what it needs beyond that machine's image (pydantic and its own needs, hjson), for CPython 3.12
# on x86-64 Linux, at the versions scripts/constraints.txt pins. Into .whl/ (ignored through
# .git/info/exclude); scripts/gpu_check.sh installs them there when .whl/ travels:
#
#   bash scripts/gpu_wheels.sh          # then: run (carry [".whl"]) OUT=$OUT bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-.venv/bin/python}"
dest=.whl
mkdir -p "$dest"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pin() {  # NAME==VERSION as scripts/constraints.txt pins it
  local line
  line=$(grep -i -E "^$1==" scripts/constraints.txt) || { echo "no pin for $1 in scripts/constraints.txt" >&2; exit 2; }
  echo "$line"
}
binary=(pydantic pydantic_core annotated-types typing-inspection typing_extensions hjson)
reqs=()
for n in "${binary[@]}"; do reqs+=("$(pin "$n")"); done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${reqs[@]}"
"$py" -m pip wheel -q --no-deps -w "$dest" "$(pin deepspeed)"
# libaio (Debian's libaio1 and libaio-dev): DeepSpeed's async-io op, which its fast and
# decoupled checkpoint engines need (benchmarks/bench_deepspeed.py), links it and is built on that
# machine; plain files (links may not travel), found through CPATH/LIBRARY_PATH/LD_LIBRARY_PATH
if command -v apt-get > /dev/null; then
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download libaio1 libaio-dev > /dev/null 2>&1) &&
    for d in "$tmp"/*.deb; do dpkg -x "$d" "$tmp/root"; done &&
    mkdir -p "$dest/libaio/include" "$dest/libaio/lib" &&
    cp "$tmp/root/usr/include/libaio.h" "$dest/libaio/include/" &&
    cp -L "$tmp/root/usr/lib/x86_64-linux-gnu/libaio.so.1" "$dest/libaio/lib/libaio.so.1" &&
    cp -L "$tmp/root/usr/lib/x86_64-linux-gnu/libaio.so.1" "$dest/libaio/lib/libaio.so" ||
    echo "libaio not fetched: DeepSpeed's async-io engines will not build there" >&2
  rm -rf "$tmp"
fi
ls -l "$dest"
du -sh "$dest"
