// time_kernels.c -- times reame-kernels.c's kernels (AVX-512, or the AVX2 ones where the
// compiler has no AVX-512: Q4_K/Q6_K/Q8_0 ggml's own for one token): nanoseconds per (weight block,
// token) for k = 1..32 tokens a call, the weights in L2 (256 rows of n values; more rows
// put them in memory), best of 20 passes. Type 0 Q4_K (beside it, where reame_amx_ok(), the
// AMX tiles' kernel), 1 Q6_K (256-value blocks), 2 Q8_0,
// 3 Q5_0 (32-value blocks; beside them ggml's one-row kernel, token by token). A
// measurement, not a test (test_kernels.c checks the bits); it is how a candidate kernel
// is judged before it goes into the build. Built like
// test_kernels.c's "from the source" builds ($SRC = "source_dir" in _llama/manifest.json;
// X86 = $SRC/ggml/src/ggml-cpu/arch/x86, whose quants.c #includes ./reame-kernels.c, so a
// candidate is timed by copying quants.c and it into a directory of their own):
//
//   cc -std=gnu11 -O3 -march=native -I$SRC/ggml/include -I$SRC/ggml/src -I$SRC/ggml/src/ggml-cpu
//      -I$X86 patches/time_kernels.c DIR/quants.c -L_llama -lggml-cpu -lggml-base -lm
//      -Wl,-rpath,_llama -o time_kernels && ./time_kernels [n] [rows] [type]
//
// AVX2 (a 2-core Zen 3 guest), Q5_0, n = 896, 256 rows: 1.77 ns per block-token for one token
// against ggml's one-row kernel's 2.15, 0.62 at 16 tokens; from memory (131072 rows) 2.04
// against 2.29 with the next 8 rows prefetched, 3.70 without. A token's 8 products summed in
// turn, not 4 tokens' products abreast (which spilled half of them to the stack): 1.70-1.83
// against 1.79-1.97 at one token, 0.59-0.62 against 0.62-0.64 at 16, 0.54 against 0.57 at 64
// (3 alternated runs). Q8_0 on AVX2 keeps ggml's bits: a candidate with the Q5_0 kernel's
// arithmetic (8 rows transposed, |w| against the token's bytes signed by w, each pair sum to
// int32) was 1.1x-1.3x as fast from 16 tokens on but 0.8x-0.9x from 1 to 8 (ggml's one-row
// Q8_0 kernel has nothing to unpack, so transposing only adds work), and so was one that
// folded untransposed rows' sums with vphaddd for up to 8 tokens.
// Measured on the 2-core Sapphire Rapids guest (n = 1536, Q4_K): 6.2 ns per block-token
// for one token, 4.5 for 2, 3.6 for 4, 3.2 for 8 to 32. A candidate with the same products
// on 256-bit registers (bit-identical results; Intel cores run zmm VNNI on one port) gave
// 6.1, 4.4, 3.4, 3.3, 3.3 and 3.9 at 32: no better, so it is not in the build.
// With the AMX tiles (n = 8960, 512 rows): 21, 11, 5.5, 2.9, 1.5 and 1.1 ns at 1, 2, 4, 8,
// 16 and 32 tokens, against 6.3, 4.3, 3.6, 4.2, 4.3 and 4.3 for the 512-bit kernel beside it
// (which, where AMX is, takes the tiles' arithmetic).
// Q5_0 (n = 896, 256 rows): 1.41 ns per block-token for one token against ggml's 1.82, 0.66
// from 16 tokens on; AMX tiles 3.7 at one token, 0.87 at 4, 0.42 at 8, 0.22 at 16 and 0.17
// at 32. Q8_0: 1.19 against 1.59, 0.63 from 8 tokens; tiles 0.32 at 8, 0.13 at 32. (The
// 512-bit kernel with 16 block sums a register and four accumulators, the tiles' arithmetic,
// against its predecessor's per-lane float steps: Q5_0 1.76 -> 1.41 at one token and 0.73 ->
// 0.66 from 8; Q8_0 1.55 -> 1.19 and 0.71 -> 0.63.) Tiles of 8 token rows for steps of up to
// 8 tokens took 8 tokens to 0.35 (Q5_0) and 0.23 (Q8_0) here, and 4 tokens below the 512-bit
// kernel, but the model did not move (llama-bench -p 8: 182-184 against 185 tok/s; -p 4 with
// the tiles: 0.94x-0.96x), so they are not in the build and ggml-cpu.c gives the tiles 8+.
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-quants.h"  // quantize_row_*_ref (libggml-base)
#include "quants.h"       // quantize_row_q8_K, quantize_row_q8_0, ggml_vec_dot_q8_0_q8_0 (libggml-cpu)

#if defined(__AVX512F__) && defined(__AVX512BW__)
void reame_vec_dot_q4_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_mm_q8_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q4_K_q8_K_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
int reame_amx_ok(void);
void reame_mm_q4_K_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q8_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
// the kernel ggml-cpu.c gives a k-token matmul of this type
static void run_kernel(int type, int n, int rows, int k, float * out, const char * w, size_t rs, const char * y, size_t by) {
    if (type == 2) reame_mm_q8_0_q8_0_512(n, rows, k, out, rows, w, rs, y, by);
    else if (type == 3) reame_mm_q5_0_q8_0_512(n, rows, k, out, rows, w, rs, y, by);
    else if (type == 0) reame_mm_q4_K_q8_K_512(n, rows, k, out, rows, w, rs, y, by);
    else for (int r = 0; r < rows; ++r) reame_vec_dot_q6_K_q8_K_512(n, k, out + r, rows, w + r * rs, y, by);
}
#else  // AVX2: the kernels ggml-cpu.c calls there (one Q4_K/Q6_K/Q8_0 token: ggml's own)
void reame_vec_dot_q4_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_mm_q8_0_q8_0_mc(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_q8_0_avx2(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
static void run_kernel(int type, int n, int rows, int k, float * out, const char * w, size_t rs, const char * y, size_t by) {
    if (type == 3) {
        reame_mm_q5_0_q8_0_avx2(n, rows, k, out, rows, w, rs, y, by);
    } else if (type == 2 && k > 1) {
        reame_mm_q8_0_q8_0_mc(n, rows, k, out, rows, w, rs, y, by);
    } else if (type == 2) {
        for (int r = 0; r < rows; ++r) ggml_vec_dot_q8_0_q8_0(n, out + r, 0, w + r * rs, 0, y, 0, 1);
    } else {
        for (int r = 0; r < rows; ++r) {
            if (k == 1) (type == 0 ? ggml_vec_dot_q4_K_q8_K : ggml_vec_dot_q6_K_q8_K)(n, out + r, 0, w + r * rs, 0, y, 0, 1);
            else (type == 0 ? reame_vec_dot_q4_K_q8_K_mc : reame_vec_dot_q6_K_q8_K_mc)(n, k, out + r, rows, w + r * rs, y, by);
        }
    }
}
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char ** argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 1536, rows = argc > 2 ? atoi(argv[2]) : 256;
    const int type = argc > 3 ? atoi(argv[3]) : 0, q0 = type >= 2, qk = q0 ? 32 : 256;
    if (type < 0 || type > 3 || n < 2 * qk || n % (q0 ? 64 : 256) || rows < 1) {
        fprintf(stderr, "usage: time_kernels [n: a multiple of 256 (64 for types 2, 3)] [rows] [type: 0 Q4_K, 1 Q6_K, 2 Q8_0, 3 Q5_0]\n");
        return 2;
    }
    static const char * names[] = {"Q4_K", "Q6_K", "Q8_0", "Q5_0"};
    static const size_t bsize[] = {sizeof(block_q4_K), sizeof(block_q6_K), sizeof(block_q8_0), sizeof(block_q5_0)};
    ggml_cpu_init();
    const int nb = n / qk;
    const size_t rs = nb * bsize[type], by = q0 ? nb * sizeof(block_q8_0) : nb * sizeof(block_q8_K);
    float * f = malloc(sizeof(float) * n), * out = malloc(sizeof(float) * rows * 32);
    char * w = malloc(rs * rows), * y = malloc(by * 32);
    srand(1);
    for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < n; ++i) f[i] = rand() / (float) RAND_MAX - 0.5f;
        void * row = w + r * rs;
        if (type == 0) quantize_row_q4_K_ref(f, row, n);
        else if (type == 1) quantize_row_q6_K_ref(f, row, n);
        else if (type == 2) quantize_row_q8_0_ref(f, row, n);
        else quantize_row_q5_0_ref(f, row, n);
    }
    for (int c = 0; c < 32; ++c) {
        for (int i = 0; i < n; ++i) f[i] = rand() / (float) RAND_MAX - 0.5f;
        if (q0) quantize_row_q8_0(f, y + c * by, n); else quantize_row_q8_K(f, y + c * by, n);
    }
    static const int ks[] = {1, 2, 4, 8, 16, 32};
    for (int ki = 0; ki < 6; ++ki) {
        const int k = ks[ki];
        double best = 1e30, best_ggml = 1e30, best_amx = 1e30;
        for (int rep = 0; rep < 20; ++rep) {
            double t0 = now();
            run_kernel(type, n, rows, k, out, w, rs, y, by);
            double t = now() - t0;
            best = t < best ? t : best;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            if (type != 1 && reame_amx_ok()) {  // the AMX tiles (ggml-cpu.c takes them from REAME_AMX_MIN tokens)
                t0 = now();
                (type == 0 ? reame_mm_q4_K_amx : type == 2 ? reame_mm_q8_0_amx : reame_mm_q5_0_amx)(n, rows, k, out, rows, w, rs, y, by);
                t = now() - t0;
                best_amx = t < best_amx ? t : best_amx;
            }
#endif
            if (!q0) continue;
            t0 = now();
            for (int c = 0; c < k; ++c) for (int r = 0; r < rows; ++r) {
                (type == 2 ? ggml_vec_dot_q8_0_q8_0 : ggml_vec_dot_q5_0_q8_0)(n, out + r, 0, w + r * rs, 0, y + c * by, 0, 1);
            }
            t = now() - t0;
            best_ggml = t < best_ggml ? t : best_ggml;
        }
        printf("%s n=%d k=%2d: %.2f ns per block-token", names[type], n, k, best * 1e9 / ((double) rows * nb * k));
        if (q0) printf(" (ggml's one-row kernel: %.2f)", best_ggml * 1e9 / ((double) rows * nb * k));
        if (best_amx < 1e30) printf(" (AMX tiles: %.2f)", best_amx * 1e9 / ((double) rows * nb * k));
        printf("\n");
    }
    free(f); free(out); free(w); free(y);
    return 0;
}
