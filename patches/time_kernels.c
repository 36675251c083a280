// time_kernels.c -- times reame-kernels.c's AVX-512 Q4_K/Q6_K kernels: nanoseconds per
// (weight block, token) for k = 1..32 tokens a call, the weights in L2 (256 rows of n
// values), best of 20 passes. A measurement, not a test (test_kernels.c checks the bits);
// it is how a candidate kernel is judged before it goes into the build. Built like
// test_kernels.c's "from the source" builds ($SRC = "source_dir" in _llama/manifest.json;
// X86 = $SRC/ggml/src/ggml-cpu/arch/x86, whose quants.c #includes ./reame-kernels.c, so a
// candidate is timed by copying quants.c and it into a directory of their own):
//
//   cc -std=gnu11 -O3 -march=native -I$SRC/ggml/include -I$SRC/ggml/src -I$SRC/ggml/src/ggml-cpu
//      -I$X86 patches/time_kernels.c DIR/quants.c -L_llama -lggml-cpu -lggml-base -lm
//      -Wl,-rpath,_llama -o time_kernels && ./time_kernels [n] [rows] [q6]
//
// Measured on the 2-core Sapphire Rapids guest (n = 1536, Q4_K): 6.2 ns per block-token
// for one token, 4.5 for 2, 3.6 for 4, 3.2 for 8 to 32. A candidate with the same products
// on 256-bit registers (bit-identical results; Intel cores run zmm VNNI on one port) gave
// 6.1, 4.4, 3.4, 3.3, 3.3 and 3.9 at 32: no better, so it is not in the build.
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-quants.h"  // quantize_row_q4_K_ref, quantize_row_q6_K_ref (libggml-base)
#include "quants.h"       // quantize_row_q8_K (libggml-cpu)

void reame_vec_dot_q4_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char ** argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 1536, rows = argc > 2 ? atoi(argv[2]) : 256;
    const int q6 = argc > 3 && atoi(argv[3]);
    if (n < 256 || n % 256 || rows < 1) {
        fprintf(stderr, "usage: time_kernels [n: a multiple of 256] [rows] [q6: 0 or 1]\n");
        return 2;
    }
    const int nb = n / 256;
    const size_t rs = q6 ? nb * sizeof(block_q6_K) : nb * sizeof(block_q4_K), by = nb * sizeof(block_q8_K);
    float * f = malloc(sizeof(float) * n), * out = malloc(sizeof(float) * rows * 32);
    char * w = malloc(rs * rows), * y = malloc(by * 32);
    srand(1);
    for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < n; ++i) f[i] = rand() / (float) RAND_MAX - 0.5f;
        if (q6) quantize_row_q6_K_ref(f, (block_q6_K *) (w + r * rs), n);
        else quantize_row_q4_K_ref(f, (block_q4_K *) (w + r * rs), n);
    }
    for (int c = 0; c < 32; ++c) {
        for (int i = 0; i < n; ++i) f[i] = rand() / (float) RAND_MAX - 0.5f;
        quantize_row_q8_K(f, y + c * by, n);
    }
    static const int ks[] = {1, 2, 4, 8, 16, 32};
    for (int ki = 0; ki < 6; ++ki) {
        double best = 1e30;
        for (int rep = 0; rep < 20; ++rep) {
            const double t0 = now();
            for (int r = 0; r < rows; ++r) {
                (q6 ? reame_vec_dot_q6_K_q8_K_512 : reame_vec_dot_q4_K_q8_K_512)(n, ks[ki], out + r, rows, w + r * rs, y, by);
            }
            const double t = now() - t0;
            best = t < best ? t : best;
        }
        printf("%s n=%d k=%2d: %.2f ns per block-token\n", q6 ? "Q6_K" : "Q4_K", n, ks[ki], best * 1e9 / ((double) rows * nb * ks[ki]));
    }
    free(f); free(out); free(w); free(y);
    return 0;
}
