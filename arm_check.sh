#!/usr/bin/env bash
# arm_check.sh -- check Reame on aarch64 from an x86-64 Linux box: cross-build the llama.cpp
# libraries for aarch64 and run Reame's own tests on them under qemu-user emulation.
#
# Usage: ./arm_check.sh [--timeout SECONDS] [--jobs N] [--tests "NODEIDS"] [--help]
#
#   1. ./build_llama.sh --cross aarch64 -> ./_llama-aarch64 (cached in $REAME_HOME/build)
#   2. an arm64 Debian bookworm root with python3, numpy, pytest and zstandard, from
#      debootstrap --foreign (its packages are unpacked, none of their scripts run, so
#      nothing runs as arm64 during setup), cached in $REAME_HOME/arm64-root/<version>
#   3. under qemu-aarch64 (called directly: no binfmt_misc needed), each must pass:
#      patches/test_kernels_neon.c (the NEON multi-token kernels, bit for bit against
#      ggml's one-row kernel, as shipped and as an armv8.6-a+i8mm build would compile
#      them), `import reame` + the library, `reame.py run gemma3-270m`, and the tests
#        test_import_without_libllama_numpy_zstandard
#        test_rows_of_one_step_get_the_logits_they_get_alone[qwen]
#        test_batched_equals_alone[gemma]
#        test_cache_hit_equals_cold[gemma]
#        test_spec_lookup_equals_plain_greedy
#      with the models of $REAME_HOME/models linked into a scratch REAME_HOME.
#
#   --timeout S   give up (and fail) after S seconds in all (default 3600)
#   --jobs N      compile jobs for the cross build (default: number of CPUs)
#   --tests "..." other test_reame.py node ids (space-separated) instead of the above
#   Needs root for debootstrap; installs g++-aarch64-linux-gnu, qemu-user-static and
#   debootstrap with apt-get when missing. The models: python3 reame.py pull gemma3-270m
#   qwen2.5-coder-0.5b. REAME_DEBIAN_MIRROR=URL picks debootstrap's mirror, REAME_NICE=N
#   the nice level of the heavy steps (default 19). Exit status 0 only if all passed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REAME_HOME="${REAME_HOME:-$HOME/.cache/reame}"
# bump when the package list or the way the root is made changes (a fresh root is made)
ROOT_VERSION="bookworm-arm64-1"
ROOT_PKGS="python3,python3-numpy,python3-pytest,python3-zstandard,libgomp1"
ROOT="$REAME_HOME/arm64-root/$ROOT_VERSION"
LIBDIR="$HERE/_llama-aarch64"
TIMEOUT=3600
JOBS="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"
TESTS="test_reame.py::test_import_without_libllama_numpy_zstandard
test_reame.py::test_rows_of_one_step_get_the_logits_they_get_alone[qwen]
test_reame.py::test_batched_equals_alone[gemma]
test_reame.py::test_cache_hit_equals_cold[gemma]
test_reame.py::test_spec_lookup_equals_plain_greedy"
NICE=(nice -n "${REAME_NICE:-19}")

say() { printf '[arm_check] %s\n' "$*" >&2; }
die() { printf '[arm_check] FAIL: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) shift; TIMEOUT="${1:?--timeout needs seconds}" ;;
    --jobs) shift; JOBS="${1:?--jobs needs a number}" ;;
    --tests) shift; TESTS="${1:?--tests needs node ids}" ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done

T0=$(date +%s)
DEADLINE=$((T0 + TIMEOUT))
# run a command within what is left of --timeout; 124 means it ran out
bounded() {
  local left=$((DEADLINE - $(date +%s)))
  [ "$left" -gt 0 ] || die "out of time (--timeout $TIMEOUT s) before: $*"
  timeout --kill-after=10 "$left" "$@"
}
step_t=$T0
step() { local now; now=$(date +%s); say "-- $* (at $((now - T0)) s)"; step_t=$now; }
done_step() { say "   ok in $(( $(date +%s) - step_t )) s"; }
check_rc() {  # $1: rc, $2: what
  [ "$1" = 0 ] && return 0
  [ "$1" = 124 ] || [ "$1" = 137 ] && die "$2: timed out (--timeout $TIMEOUT s)"
  die "$2 (exit status $1)"
}

[ "$(uname -s)" = Linux ] || die "needs a Linux host (this is $(uname -s))"
case "$(uname -m)" in x86_64|amd64) ;; *) say "note: host is $(uname -m), not x86-64; trying anyway" ;; esac

# -- tools
need_pkgs=""
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || need_pkgs="$need_pkgs g++-aarch64-linux-gnu"
QEMU="$(command -v qemu-aarch64-static || command -v qemu-aarch64 || true)"
[ -n "$QEMU" ] || need_pkgs="$need_pkgs qemu-user-static"
command -v debootstrap >/dev/null 2>&1 || [ -f "$ROOT/.reame-ready" ] || need_pkgs="$need_pkgs debootstrap"
command -v dpkg-deb >/dev/null 2>&1 || die "dpkg-deb not found: this script needs a Debian or Ubuntu host"
if [ -n "$need_pkgs" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing$need_pkgs"
    # shellcheck disable=SC2086
    { apt-get install -y -q $need_pkgs || { apt-get update -q && apt-get install -y -q $need_pkgs; }; } >&2 \
      || die "could not install them: apt-get install -y$need_pkgs"
    QEMU="$(command -v qemu-aarch64-static || command -v qemu-aarch64)"
  else
    die "missing tools: install them (Debian/Ubuntu: sudo apt-get install -y$need_pkgs)"
  fi
fi

# -- 1. the aarch64 libraries
step "1. cross build: ./build_llama.sh --cross aarch64"
set +e; bounded "${NICE[@]}" "$HERE/build_llama.sh" --cross aarch64 --jobs "$JOBS"; rc=$?; set -e
check_rc "$rc" "build_llama.sh --cross aarch64"
[ -f "$LIBDIR/libllama.so" ] && [ -f "$LIBDIR/manifest.json" ] || die "no $LIBDIR/libllama.so after the build"
SRC="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["source_dir"])' "$LIBDIR/manifest.json")"
done_step

# -- 2. the arm64 Python
step "2. arm64 Python root: $ROOT"
if [ ! -f "$ROOT/.reame-ready" ]; then
  [ "$(id -u)" = 0 ] || die "making the arm64 root needs root (debootstrap); run once as root or copy $ROOT from a machine that has it"
  [ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || die "no Debian archive keyring: apt-get install -y debian-archive-keyring"
  rm -rf "$ROOT.tmp"; mkdir -p "$(dirname "$ROOT")"
  say "   debootstrap --foreign --arch=arm64 --variant=minbase bookworm (downloads ~60 MB)"
  set +e
  # shellcheck disable=SC2086
  bounded "${NICE[@]}" debootstrap --foreign --arch=arm64 --variant=minbase --include="$ROOT_PKGS" \
    bookworm "$ROOT.tmp" ${REAME_DEBIAN_MIRROR:-} >"$REAME_HOME/arm64-root/debootstrap.log" 2>&1
  rc=$?; set -e
  [ "$rc" = 0 ] || { tail -20 "$REAME_HOME/arm64-root/debootstrap.log" >&2; check_rc "$rc" "debootstrap (log: $REAME_HOME/arm64-root/debootstrap.log)"; }
  # unpack every downloaded package (debootstrap's first stage unpacked only the base ones)
  for deb in "$ROOT.tmp"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$ROOT.tmp" || die "cannot unpack $deb"; done
  rm -f "$ROOT.tmp"/var/cache/apt/archives/*.deb
  # the links update-alternatives would have made (numpy's BLAS and LAPACK)
  for l in blas/libblas.so.3 lapack/liblapack.so.3; do
    ln -sf "$l" "$ROOT.tmp/usr/lib/aarch64-linux-gnu/$(basename "$l")"
  done
  rm -rf "$ROOT"; mv "$ROOT.tmp" "$ROOT"
fi
# an x86 script standing for the arm64 python3: sys.executable is this script, so the
# tests' subprocesses (sys.executable ...) run under qemu too
PY="$ROOT/usr/bin/python3-qemu"
cat >"$PY.tmp" <<EOF
#!/bin/sh
exec "$QEMU" -L "$ROOT" -0 "$PY" "$ROOT/usr/bin/python3" "\$@"
EOF
chmod +x "$PY.tmp"; mv "$PY.tmp" "$PY"
set +e; out="$(bounded "$PY" -c 'import platform, numpy, zstandard, pytest; print(platform.machine(), "python", platform.python_version(), "numpy", numpy.__version__, "pytest", pytest.__version__)' 2>&1)"; rc=$?; set -e
check_rc "$rc" "the arm64 python3 does not start under $QEMU: $out"
case "$out" in aarch64*) ;; *) die "the arm64 python3 reports '$out', not aarch64" ;; esac
say "   $out"
touch "$ROOT/.reame-ready"
done_step

# -- 3. under emulation
WORK="$(mktemp -d "${TMPDIR:-/tmp}/arm_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/home/models"
for m in gemma3-270m qwen2.5-coder-0.5b; do
  [ -f "$REAME_HOME/models/$m.gguf" ] || die "model $m is not pulled: python3 reame.py pull gemma3-270m qwen2.5-coder-0.5b"
  ln -s "$REAME_HOME/models/$m.gguf" "$WORK/home/models/$m.gguf"
done
RUN_ENV=(env REAME_HOME="$WORK/home" REAME_LIBLLAMA="$LIBDIR")

step "3a. NEON kernel test (patches/test_kernels_neon.c) under qemu-aarch64"
G="$SRC/ggml"
INC=(-I"$G/include" -I"$G/src" -I"$G/src/ggml-cpu")
ARM_ARCH="$(python3 -c 'import json,sys; f=[x for x in json.load(open(sys.argv[1]))["flags"] if "GGML_CPU_ARM_ARCH=" in x]; print(f[0].split("=",1)[1] if f else "armv8.2-a+dotprod")' "$LIBDIR/manifest.json")"
builds=("shipped:-O2 -march=$ARM_ARCH:" "i8mm-from-source:-O3 -march=armv8.6-a+dotprod+i8mm:$G/src/ggml-cpu/arch/arm/quants.c")
for b in "${builds[@]}"; do
  name="${b%%:*}"; rest="${b#*:}"; opt="${rest%%:*}"; extra="${rest#*:}"
  # shellcheck disable=SC2086
  bounded "${NICE[@]}" aarch64-linux-gnu-gcc -std=gnu11 $opt "${INC[@]}" "$HERE/patches/test_kernels_neon.c" $extra \
    -o "$WORK/test_kernels_neon_$name" -L"$LIBDIR" -lggml-cpu -lggml-base -lm -Wl,-rpath,"$LIBDIR" \
    || die "test_kernels_neon.c ($name) does not compile"
  for seed in 0x9E3779B97F4A7C15 0x1234567; do
    set +e; out="$(bounded "${NICE[@]}" "$QEMU" -L "$ROOT" "$WORK/test_kernels_neon_$name" "$seed" 2>&1)"; rc=$?; set -e
    printf '%s\n' "$out" | sed "s/^/[arm_check]   $name: /" >&2
    if ! { [ "$rc" = 0 ] && printf '%s\n' "$out" | tail -1 | grep -q 'test_kernels_neon: PASS'; }; then
      [ "$rc" = 0 ] && rc=1
      check_rc "$rc" "test_kernels_neon ($name, seed $seed)"
    fi
    printf '%s' "$out" | grep -q 'reame_vec_dot_q4_K_q8_K_neon' || die "test_kernels_neon ($name) tested no NEON kernel"
  done
done
done_step

step "3b. import reame and load $LIBDIR under qemu-aarch64"
set +e
out="$(cd "$HERE" && bounded "${NICE[@]}" "${RUN_ENV[@]}" "$PY" -c '
import ctypes, os, reame
L = reame.lib()
print("libllama", L.llama_version().decode() if hasattr(L, "llama_version") else "?", "on", os.uname().machine)
cpu = [l.split()[-1] for l in open("/proc/self/maps") if "libggml-cpu" in l]
assert cpu and hasattr(ctypes.CDLL(cpu[0]), "reame_vec_dot_q4_K_q8_K_neon"), "no NEON multi-token kernels in %s" % cpu
print("NEON multi-token kernels in", cpu[0])
' 2>&1)"; rc=$?
set -e
printf '%s\n' "$out" | sed 's/^/[arm_check]   /' >&2
check_rc "$rc" "import reame / load the aarch64 library"
done_step

step "3c. smoke: reame.py run gemma3-270m under qemu-aarch64"
set +e
out="$(cd "$HERE" && bounded "${NICE[@]}" "${RUN_ENV[@]}" "$PY" reame.py run gemma3-270m "The capital of France is" \
        --temperature 0 --max-tokens 16 --ctx 512 --raw 2>&1)"; rc=$?
set -e
printf '%s\n' "$out" | sed 's/^/[arm_check]   > /' >&2
check_rc "$rc" "reame.py run gemma3-270m"
[ -n "$(printf '%s' "$out" | tr -d '[:space:]')" ] || die "reame.py run gemma3-270m printed nothing"
done_step

step "3d. tests under qemu-aarch64: $(echo $TESTS | tr '\n' ' ')"
set +e
# shellcheck disable=SC2086
(cd "$HERE" && bounded "${NICE[@]}" "${RUN_ENV[@]}" "$PY" -m pytest -v -ra -p no:cacheprovider --durations=0 $TESTS) >&2
rc=$?
set -e
check_rc "$rc" "tests under qemu-aarch64"
done_step

say "PASS: all aarch64 checks passed in $(( $(date +%s) - T0 )) s"
