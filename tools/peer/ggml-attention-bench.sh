#!/usr/bin/env bash
# Builds ggml's CPU backend from llama.cpp's source, compiles tools/peer/ggml-attention-bench.cpp
# against it and runs it: ggml's CPU flash attention on the decode workloads of pkv-bench's default
# CPU run, for comparison with pagedkv (docs/perf/peer-cpu.md).
#
# usage: tools/peer/ggml-attention-bench.sh [--build DIR] [--jobs N] SOURCE [harness options...]
#   SOURCE       llama.cpp's source tree (ggml in SOURCE/ggml), or ggml's own tree, which llama.cpp's
#                ggml/ is synced with (SOURCE/src/ggml-cpu)
#   --build DIR  the build folder, outside this repository (default: SOURCE/../build-ggml-cpu)
#   --jobs N     build jobs (default 2)
#   harness options: --threads, --iters, --json, --filter, --list, --layout, --mask, --prec, --rotate-mb
#   (SOURCE --help lists them)
# The build is a release build of the CPU backend alone (GGML_NATIVE: tuned for this machine), static,
# configured once per build folder and brought up to date on every run.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
build="" jobs=2
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    *) break ;;
  esac
done
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  sed -n '6,13s/^# \{0,1\}//p' "$0" >&2
  exit 2
fi
src="$(cd "$1" && pwd)"
shift

# The ggml tree: llama.cpp's ggml/ folder, or the source itself when it is ggml's own repository.
if [ -f "$src/ggml/CMakeLists.txt" ] && [ -d "$src/ggml/src/ggml-cpu" ]; then
  ggml="$src/ggml"
  what="llama.cpp"
elif [ -f "$src/CMakeLists.txt" ] && [ -d "$src/src/ggml-cpu" ]; then
  ggml="$src"
  what="ggml"
else
  echo "ggml-attention-bench.sh: $src is neither llama.cpp's source (ggml/) nor ggml's (src/ggml-cpu/)" >&2
  exit 2
fi

# What was built, for the output and the JSON: the commit, and for ggml's tree the llama.cpp commit
# it was last synced with.
peer="$what"
if git -C "$src" rev-parse --verify -q HEAD >/dev/null 2>&1; then
  peer="$what $(git -C "$src" rev-parse HEAD)"
  [ -z "$(git -C "$src" status --porcelain --untracked-files=no)" ] || peer="$peer-dirty"
else
  peer="$what (not a git checkout)"
fi
if [ "$what" = ggml ] && [ -f "$src/scripts/sync-llama.last" ]; then
  peer="$peer, synced with llama.cpp $(tr -d '[:space:]' <"$src/scripts/sync-llama.last")"
fi

build="${build:-$(dirname "$src")/build-ggml-cpu}"
mkdir -p "$build"
build="$(cd "$build" && pwd)"
case "$build/" in
  "$repo"/*) echo "ggml-attention-bench.sh: the build folder $build is inside this repository" >&2; exit 2 ;;
esac

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$ggml" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DGGML_CUDA=OFF -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF >"$build/configure.log" ||
    { cat "$build/configure.log" >&2; exit 1; }
fi
cmake --build "$build" -j "$jobs" --target ggml-base ggml-cpu >"$build/build.log" ||
  { tail -50 "$build/build.log" >&2; exit 1; }

# The harness, linked statically with the same OpenMP flags as the CPU backend.
openmp="$(sed -n 's/^OpenMP_CXX_FLAGS:STRING=//p' "$build/CMakeCache.txt")"
# shellcheck disable=SC2086 # openmp is a list of flags
"${CXX:-c++}" -std=c++17 -O2 -Wall -Wextra -I"$ggml/include" -I"$repo/tools" \
  "$here/ggml-attention-bench.cpp" -o "$build/ggml-attention-bench" \
  "$build/src/libggml-cpu.a" "$build/src/libggml-base.a" $openmp -lpthread -lm

exec "$build/ggml-attention-bench" --peer "$peer" "$@"
