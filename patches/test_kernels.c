// test_kernels.c -- tests reame-kernels.c, the multi-token Q4_K/Q6_K dot products that
// build_llama.sh's patches put into ggml's x86 CPU backend. test_reame.py builds and runs
// it (test_c_kernels_batched_equal_alone), against the patched tree's headers
// ($SRC = "source_dir" in _llama/manifest.json; INC = -I$SRC/ggml/include -I$SRC/ggml/src
// -I$SRC/ggml/src/ggml-cpu):
//
//   the shipped build:  cc -O2 -std=gnu11 [-march=native] $INC test_kernels.c
//                          -L_llama -lggml-cpu -lggml-base -lm -Wl,-rpath,_llama
//   from the source, as an AVX2 (or AVX) build would compile it: the same plus
//                       $SRC/ggml/src/ggml-cpu/arch/x86/quants.c (ggml's one-row kernels and
//                       reame-kernels.c) and -O3 -march=native -mno-avx512f (or -mno-avx2)
//
// It tests whichever kernels the compiler flags select (the same macros as ggml-cpu.c's
// dispatch), on random weight rows (quantized from random floats, random bits, extremes)
// against random q8_K activations (the same three kinds), n = 256 .. 8960:
//   1. batched = alone: for k = 1 .. 32 (AVX-512: .. 40, 5 passes of 8) tokens at once,
//      each token's result has the bits it has when the kernel runs that token alone
//      (and only the k results are written, at stride bs);
//   2. AVX2/AVX kernels: each result has the bits of ggml_vec_dot_q{4,6}_K_q8_K's;
//   3. accuracy: |result - exact| <= (nb + 8) * 2^-20 * M, where exact is the sum in double
//      of ggml's dequantized weights times the q8_K values times d, and M is the sum of
//      the magnitudes of the terms the kernels add (scale part and min part apart, before
//      they cancel): 16x the float rounding the kernels' nb + ~8 rounding steps can add.
//      ggml's one-row kernel is held to the same bound.
// With AVX2 (no AVX-512) it tests the Q8_0 kernel (2: ggml's bits; test_q8_mc) and the Q5_0
// one (test_q0: 1, 3, and the bits of reame_q0_canon's arithmetic computed here, 1..11 rows).
// With AVX-512 it tests the Q8_0/Q5_0 kernels the same way (test_q0: 1 and 3), and the Q4_K
// row-range kernels (and where reame_amx_ok(), the AMX tiles'): every result, for 1..40 tokens
// and 5, 16 or 37 rows at once, has the bits reame_vec_dot_q4_K_q8_K_512 gives that row and
// token alone (test_q4_K_rows); and the Q8_0/Q5_0 prompt kernels (AMX tiles, or their plain-C
// arithmetic where there are none): every result, for 1..40 and 120..140 tokens and 5, 16 or
// 37 rows at once, has the bits of their arithmetic computed here one row and token at a time,
// within the accuracy bound (test_q0_amx).
// Prints what it checked; exit status 0 when every check passed.

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ggml-cpu.h"
#include "ggml-quants.h"  // quantize_row_q4_K_ref, dequantize_row_q4_K, ... (libggml-base)
#include "quants.h"       // ggml_vec_dot_q4_K_q8_K, quantize_row_q8_K (libggml-cpu)

// the guards under which reame-kernels.c defines its kernels and ggml-cpu.c calls them
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX__))
#define HAVE_MC 1
void reame_vec_dot_q4_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
#endif
#if defined(__x86_64__) && defined(__AVX2__) && !(defined(__AVX512F__) && defined(__AVX512BW__))
#define HAVE_Q0_MC 1
void reame_mm_q8_0_q8_0_mc(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_q8_0_avx2(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
#endif
#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX2__)
#define HAVE_512 1
void reame_vec_dot_q4_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_mm_q8_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q4_K_q8_K_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
int reame_amx_ok(void);
void reame_mm_q4_K_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q8_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
#endif

typedef void (*multi_fn)(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
typedef void (*one_fn)(int n, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by, int nrc);

struct kernel {
    const char * name;
    int q6;           // 0: Q4_K weights, 1: Q6_K
    multi_fn fn;
    int max_nc;       // the most columns a call may take
    int ggml_bits;    // each result must have the bits of ggml's one-row kernel
    long n_batched, n_ggml, n_acc;
    double worst;     // the largest error seen, as a fraction of the float rounding bound
};

#define NTOK 40       // activation rows (tokens)
#define BS 3          // the output stride the batched calls use
#define MAX_NB 35
static const int NBS[] = {1, 2, 3, 6, 11, 35};  // blocks per row (n = 256 nb; 1.5B: 6 and 35)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {  // splitmix64
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double unif(void) { return (double) (rnd() >> 11) / 9007199254740992.0; }
static double gauss(void) { return sqrt(-2.0 * log(1.0 - unif())) * cos(6.283185307179586 * unif()); }
static float rnd_scale(void) {  // a positive or negative scale, 2^-14 .. 2^-4
    const float v = (float) exp2(-14.0 + 10.0 * unif());
    return (rnd() & 1) ? v : -v;
}
static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static int n_fail = 0;
static void fail(const char * what, const char * kernel, int nb, int row, int k, int c, float got, float want) {
    if (++n_fail <= 20) {
        printf("FAIL %s: %s nb=%d row=%d k=%d token=%d: got %.9g (0x%08x), want %.9g (0x%08x)\n",
               what, kernel, nb, row, k, c, got, bits(got), want, bits(want));
    }
}

// a weight row of nb blocks: kind 0 quantized from random floats, 1 random bits, 2 extremes
static void make_weights(int q6, int kind, int nb, void * row) {
    const int n = nb * QK_K;
    if (kind == 0) {
        float * f = malloc(n * sizeof(float));
        const double scale = exp2(-6.0 + 6.0 * unif());
        for (int j = 0; j < n; ++j) f[j] = (float) (scale * gauss() * ((rnd() % 64) ? 1.0 : 8.0));  // some outliers
        if (q6) quantize_row_q6_K_ref(f, row, n); else quantize_row_q4_K_ref(f, row, n);
        free(f);
        return;
    }
    for (int i = 0; i < nb; ++i) {
        if (q6) {
            block_q6_K * b = (block_q6_K *) row + i;
            if (kind == 1) {
                for (size_t j = 0; j < sizeof(*b); ++j) ((uint8_t *) b)[j] = (uint8_t) rnd();
            } else {  // all 63 (+31 after the offset) or all 0 (-32), scales at the int8 ends
                const uint8_t q = (i % 2) ? 0x00 : 0xFF;
                memset(b->ql, q, sizeof(b->ql));
                memset(b->qh, q, sizeof(b->qh));
                for (int j = 0; j < QK_K/16; ++j) b->scales[j] = (int8_t) ((j + i) % 3 == 0 ? 127 : -128);
            }
            b->d = ggml_fp32_to_fp16(rnd_scale());
        } else {
            block_q4_K * b = (block_q4_K *) row + i;
            if (kind == 1) {
                for (size_t j = 0; j < sizeof(*b); ++j) ((uint8_t *) b)[j] = (uint8_t) rnd();
            } else {  // nibbles all 15, 6-bit scales and mins all 63
                memset(b->qs, 0xFF, sizeof(b->qs));
                memset(b->scales, 0xFF, sizeof(b->scales));
            }
            b->d = ggml_fp32_to_fp16(fabsf(rnd_scale()) * ((kind == 1 && (rnd() & 1)) ? -1.0f : 1.0f));
            b->dmin = ggml_fp32_to_fp16(rnd_scale());
        }
    }
}

// an activation row (q8_K): kind 0 quantized from random floats (quantize_row_q8_K, as
// ggml's matmul does), 1 random int8 values, 2 all -128 or all 127
static void make_acts(int kind, int nb, block_q8_K * y) {
    const int n = nb * QK_K;
    if (kind == 0) {
        float * f = malloc(n * sizeof(float));
        const double scale = exp2(-4.0 + 8.0 * unif());
        for (int j = 0; j < n; ++j) f[j] = (float) (scale * gauss());
        quantize_row_q8_K(f, y, n);
        free(f);
        return;
    }
    for (int i = 0; i < nb; ++i) {
        const int8_t v = (rnd() & 1) ? 127 : -128;
        for (int j = 0; j < QK_K; ++j) y[i].qs[j] = kind == 1 ? (int8_t) rnd() : v;
        for (int g = 0; g < QK_K/16; ++g) {
            int sum = 0;
            for (int j = 0; j < 16; ++j) sum += y[i].qs[16*g + j];
            y[i].bsums[g] = (int16_t) sum;
        }
        y[i].d = fabsf(rnd_scale()) * 64.0f * ((rnd() & 1) ? 1.0f : -1.0f);
    }
}

// the exact dot product (double) and the magnitude M of the terms the kernels add
static void reference(int q6, int nb, const void * x, const block_q8_K * y, double * exact, double * mag) {
    const int n = nb * QK_K;
    float * w = malloc(n * sizeof(float)), * sc = malloc(n * sizeof(float)), * mn = malloc(n * sizeof(float));
    void * t = malloc(nb * (q6 ? sizeof(block_q6_K) : sizeof(block_q4_K)));
    memcpy(t, x, nb * (q6 ? sizeof(block_q6_K) : sizeof(block_q4_K)));
    if (q6) {
        dequantize_row_q6_K(x, w, n);
        for (int i = 0; i < nb; ++i) {  // all stored values 63: w = d * scale * 31
            memset(((block_q6_K *) t)[i].ql, 0xFF, QK_K/2);
            memset(((block_q6_K *) t)[i].qh, 0xFF, QK_K/4);
        }
        dequantize_row_q6_K(t, sc, n);
        for (int j = 0; j < n; ++j) { sc[j] = fabsf(sc[j]) / 31.0f * 96.0f; mn[j] = 0.0f; }  // |stored| + 32 <= 96
    } else {
        dequantize_row_q4_K(x, w, n);
        block_q4_K * b = t;
        for (int i = 0; i < nb; ++i) { memset(b[i].qs, 0xFF, QK_K/2); b[i].dmin = ggml_fp32_to_fp16(0.0f); }
        dequantize_row_q4_K(t, sc, n);   // d * scale * 15
        memcpy(t, x, nb * sizeof(block_q4_K));
        for (int i = 0; i < nb; ++i) b[i].d = ggml_fp32_to_fp16(0.0f);
        dequantize_row_q4_K(t, mn, n);   // -dmin * min
    }
    double e = 0.0, m = 0.0;
    for (int j = 0; j < n; ++j) {
        const double a = (double) y[j / QK_K].d * y[j / QK_K].qs[j % QK_K];
        e += (double) w[j] * a;
        m += (fabs((double) sc[j]) + fabs((double) mn[j])) * fabs(a);
    }
    *exact = e;
    *mag = m;
    free(w); free(sc); free(mn); free(t);
}

static int check_acc(struct kernel * K, const char * name, int nb, int row, int c, float got, double exact, double mag) {
    const double bound = (nb + 8) * exp2(-24.0) * mag;
    const double err = fabs((double) got - exact);
    if (K && bound > 0 && err / bound > K->worst) K->worst = err / bound;
    if (!(err <= 16.0 * bound)) {
        fail("accuracy", name, nb, row, 1, c, got, (float) exact);
        return 0;
    }
    return 1;
}

#if defined(HAVE_512) || defined(HAVE_Q0_MC)
// a q8_0 token row of nb blocks: kind 0 quantized from random floats, 1 random values in
// -127..127 (as quantize_row_q8_0 makes), 2 extremes; f: n floats of scratch
static void make_q0_token(int kind, int nb, block_q8_0 * y, float * f) {
    const int n = nb * 32;
    if (kind == 0) {
        const double scale = exp2(-4.0 + 8.0 * unif());
        for (int j = 0; j < n; ++j) f[j] = (float) (scale * gauss());
        quantize_row_q8_0(f, y, n);
        return;
    }
    for (int i = 0; i < nb; ++i) {
        const int8_t v = (rnd() & 1) ? 127 : -127;
        for (int j = 0; j < 32; ++j) y[i].qs[j] = kind == 1 ? (int8_t) (rnd() % 255 - 127) : v;
        y[i].d = ggml_fp32_to_fp16(rnd_scale() * 64.0f);
    }
}
// a Q8_0 or Q5_0 weight row of nb blocks (block size xs): kind 0 quantized from random
// floats (a few 8x outliers), 1 random bits, 2 extremes; each with a random scale
static void make_q0_row(int q5, int kind, int nb, char * row, float * f) {
    const int n = nb * 32;
    const size_t xs = q5 ? sizeof(block_q5_0) : sizeof(block_q8_0);
    if (kind == 0) {
        const double scale = exp2(-6.0 + 6.0 * unif());
        for (int j = 0; j < n; ++j) f[j] = (float) (scale * gauss() * ((rnd() % 64) ? 1.0 : 8.0));
        if (q5) quantize_row_q5_0_ref(f, (block_q5_0 *) row, n); else quantize_row_q8_0_ref(f, (block_q8_0 *) row, n);
        return;
    }
    for (size_t j = 0; j < nb * xs; ++j) row[j] = (char) (kind == 1 ? rnd() : (j % 2 ? 0x80 : 0x7F));
    for (int i = 0; i < nb; ++i) {
        const ggml_half d = ggml_fp32_to_fp16(rnd_scale());
        memcpy(row + i * xs, &d, sizeof(d));
    }
}

#endif

#if defined(HAVE_512) || defined(HAVE_Q0_MC)
static int q0_int(const char * row, int q5, int i, int j) {  // weight j of block i, as an integer
    if (!q5) return ((const block_q8_0 *) row)[i].qs[j];
    const block_q5_0 * x = (const block_q5_0 *) row + i;
    const int lo = x->qs[j % 16], nib = j < 16 ? lo & 15 : lo >> 4;
    return nib + 16 * ((x->qh[j / 8] >> (j % 8)) & 1) - 16;
}
// The arithmetic of every Q8_0/Q5_0 kernel (reame-kernels.c, reame_q0_canon), per (row,
// token), stated here on its own: S_i = the exact integer sum of block i, four accumulators
// a_e = fma((float) S_i * dx_i, dy_i, a_e) with e = (i / 4) mod 4 for i = 0 .. nb - 1 in
// order, and the result (a_0 + a_2) + (a_1 + a_3)
static float q0_ref(const char * row, int q5, int nb, const block_q8_0 * y) {
    const size_t xs = q5 ? sizeof(block_q5_0) : sizeof(block_q8_0);
    float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = 0; i < nb; ++i) {
        int32_t S = 0;
        for (int j = 0; j < 32; ++j) S += q0_int(row, q5, i, j) * y[i].qs[j];
        ggml_half dh;
        memcpy(&dh, row + i * xs, sizeof(dh));
        a[(i / 4) % 4] = fmaf((float) S * ggml_fp16_to_fp32(dh), ggml_fp16_to_fp32(y[i].d), a[(i / 4) % 4]);
    }
    return (a[0] + a[2]) + (a[1] + a[3]);
}
// A Q8_0/Q5_0 kernel of reame_q0_canon's arithmetic (reame_mm_*_0_q8_0_512; AVX2:
// reame_mm_q5_0_q8_0_avx2, any nb) on nr rows of nb blocks (n = 32 nb; 0.5B: 28 and 152; 300:
// past the AVX2 kernel's 32-block unpacking and its 64-token passes) against 40 q8_0 tokens:
// kind 0 quantized from random floats, 1 random bits (q8_0 tokens: random values in
// -127..127, as quantize_row_q8_0 makes), 2 extremes. Checks 1 (k = 1..40 tokens, and nr rows
// against one at a time) and 3 above, and that each result is that arithmetic's.
#define Q0_ROWS 11  // the most rows a call (AVX2: past a group of 8 rows)
typedef void (*q0_fn)(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
static void test_q0(int q5, q0_fn fn, const char * name, int nr, int any_nb) {
    static const int even_nbs[] = {2, 4, 6, 28, 152}, any_nbs[] = {1, 3, 5, 17, 28, 33, 152, 300};
    const int * nbs = any_nb ? any_nbs : even_nbs;
    const size_t n_nbs = any_nb ? sizeof(any_nbs) / sizeof(any_nbs[0]) : sizeof(even_nbs) / sizeof(even_nbs[0]);
    const size_t xs = q5 ? sizeof(block_q5_0) : sizeof(block_q8_0);
    struct kernel K = {name, q5, NULL, NTOK, 0, 0, 0, 0, 0.0};  // (q6: here Q5_0 or Q8_0)
    long n_ref = 0;
    for (size_t inb = 0; inb < n_nbs; ++inb) {
        const int nb = nbs[inb], n = nb * 32;
        const size_t by = nb * sizeof(block_q8_0);
        block_q8_0 * acts = malloc(NTOK * by);
        char * w = malloc(Q0_ROWS * nb * xs);
        float * f = malloc(n * sizeof(float)), * wf = malloc(n * sizeof(float));
        float * one = malloc(NTOK * Q0_ROWS * sizeof(float)), * out = malloc(NTOK * BS * Q0_ROWS * sizeof(float));
        for (int c = 0; c < NTOK; ++c) make_q0_token(c % 5 == 4 ? 2 : c % 2, nb, (block_q8_0 *) ((char *) acts + c * by), f);
        for (int rep = 0; rep < 12; ++rep) {
            const int kind = rep % 3;
            for (int r = 0; r < nr; ++r) make_q0_row(q5, (kind + r) % 3, nb, w + r * nb * xs, f);
            for (int r = 0; r < nr; ++r) {  // one row, one token at a time; accuracy
                const char * row = w + r * nb * xs;
                if (q5) dequantize_row_q5_0((const block_q5_0 *) row, wf, n); else dequantize_row_q8_0((const block_q8_0 *) row, wf, n);
                for (int c = 0; c < NTOK; ++c) {
                    const block_q8_0 * y = (const block_q8_0 *) ((const char *) acts + c * by);
                    float got;
                    fn(n, 1, 1, &got, 1, row, nb * xs, y, by);
                    one[c * Q0_ROWS + r] = got;
                    const float want = q0_ref(row, q5, nb, y);
                    if (bits(got) == bits(want)) n_ref++;
                    else fail("= the arithmetic of reame_q0_canon", name, nb, rep, 1, c, got, want);
                    double e = 0.0, m = 0.0;
                    for (int j = 0; j < n; ++j) {
                        const double a = (double) ggml_fp16_to_fp32(y[j / 32].d) * y[j / 32].qs[j % 32];
                        e += (double) wf[j] * a;
                        m += fabs((double) wf[j] * a);
                    }
                    K.n_acc += check_acc(&K, name, nb, rep, c, got, e, m);
                }
            }
            for (int k = 1; k <= NTOK; ++k) {  // all rows, k tokens at once (two windows of the 40)
                const int offs[2] = {0, NTOK - k};
                for (int o_i = 0; o_i < (offs[1] > 0 ? 2 : 1); ++o_i) {
                    const int o = offs[o_i];
                    const size_t bs = BS * Q0_ROWS;  // token c's row r at out[r + c * bs]
                    for (int j = 0; j < NTOK * BS * Q0_ROWS; ++j) out[j] = NAN;
                    fn(n, nr, k, out, bs, w, nb * xs, (const char *) acts + o * by, by);
                    for (int j = 0; j < NTOK * BS * Q0_ROWS; ++j) {
                        const int c = j / bs, r = j % bs;
                        if (r < nr && c < k) {
                            if (bits(out[j]) == bits(one[(o + c) * Q0_ROWS + r])) K.n_batched++;
                            else fail("batched = alone", name, nb, rep, k, o + c, out[j], one[(o + c) * Q0_ROWS + r]);
                        } else if (!isnan(out[j])) {
                            fail("wrote outside its k results", name, nb, rep, k, c, out[j], NAN);
                        }
                    }
                }
            }
        }
        free(acts); free(w); free(f); free(wf); free(one); free(out);
    }
    printf("  %-28s %6ld batched results (k = 1..%d tokens, %d rows) bit-equal to one token and row at a time, "
           "%ld of those bit-equal to their arithmetic computed here, %ld within the accuracy bound (worst error "
           "%.3f of the float rounding bound)\n", name, K.n_batched, NTOK, nr, n_ref, K.n_acc, K.worst);
}
#endif

#ifdef HAVE_Q0_MC
// The AVX2 Q8_0 kernel (reame_mm_q8_0_q8_0_mc: nr rows at once) on 3 rows of nb blocks
// (0.5B: 28 and 152; 300: past the scale table) against 40 q8_0 tokens: each result, one row
// and token alone and 3 rows x k = 1..40 tokens at once, has the bits of ggml_vec_dot_q8_0_q8_0
// for that row and token (checks 1 and 2 above; the accuracy is ggml's).
#define MC_ROWS 3
static void test_q8_mc(void) {
    static const int nbs[] = {1, 2, 4, 28, 152, 300};
    const int q5 = 0;
    const char * name = "reame_mm_q8_0_q8_0_mc";
    void (*fn)(int, int, int, float *, size_t, const void *, size_t, const void *, size_t) = reame_mm_q8_0_q8_0_mc;
    const one_fn ggml = ggml_vec_dot_q8_0_q8_0;
    const size_t xs = sizeof(block_q8_0), bs = BS * MC_ROWS;
    const uint32_t SENTINEL = 0x7fc0beefu;
    long n_ggml = 0, n_batched = 0;
    for (size_t inb = 0; inb < sizeof(nbs) / sizeof(nbs[0]); ++inb) {
        const int nb = nbs[inb], n = nb * 32;
        const size_t by = nb * sizeof(block_q8_0);
        block_q8_0 * acts = malloc(NTOK * by);
        char * w = malloc(MC_ROWS * nb * xs);
        float * f = malloc(n * sizeof(float)), * out = malloc(NTOK * bs * sizeof(float));
        float want[NTOK * MC_ROWS];
        for (int c = 0; c < NTOK; ++c) make_q0_token(c % 5 == 4 ? 2 : c % 2, nb, (block_q8_0 *) ((char *) acts + c * by), f);
        for (int rep = 0; rep < 12; ++rep) {
            for (int r = 0; r < MC_ROWS; ++r) make_q0_row(q5, (rep + r) % 3, nb, w + r * nb * xs, f);
            for (int r = 0; r < MC_ROWS; ++r) {  // one row and token at a time, against ggml's one-row kernel
                for (int c = 0; c < NTOK; ++c) {
                    const char * y = (const char *) acts + c * by, * row = w + r * nb * xs;
                    float got;
                    ggml(n, &want[c * MC_ROWS + r], 0, row, xs, y, by, 1);
                    fn(n, 1, 1, &got, 1, row, nb * xs, y, by);
                    if (bits(got) == bits(want[c * MC_ROWS + r])) n_ggml++;
                    else fail("bits of ggml's one-row kernel", name, nb, rep, 1, c, got, want[c * MC_ROWS + r]);
                }
            }
            for (int k = 1; k <= NTOK; ++k) {  // all rows, k tokens at once, two windows of the 40
                const int offs[2] = {0, NTOK - k};
                for (int o_i = 0; o_i < (offs[1] > 0 ? 2 : 1); ++o_i) {
                    const int o = offs[o_i];
                    for (size_t j = 0; j < NTOK * bs; ++j) memcpy(&out[j], &SENTINEL, 4);
                    fn(n, MC_ROWS, k, out, bs, w, nb * xs, (const char *) acts + o * by, by);
                    for (size_t j = 0; j < NTOK * bs; ++j) {
                        const int c = (int) (j / bs), r = (int) (j % bs);
                        if (r < MC_ROWS && c < k) {
                            if (bits(out[j]) == bits(want[(o + c) * MC_ROWS + r])) n_batched++;
                            else fail("batched = ggml's one-row kernel", name, nb, rep, k, o + c, out[j], want[(o + c) * MC_ROWS + r]);
                        } else if (bits(out[j]) != SENTINEL) {
                            fail("wrote outside its rows and k results", name, nb, rep, k, c, out[j], NAN);
                        }
                    }
                }
            }
        }
        free(acts); free(w); free(f); free(out);
    }
    printf("  %-28s %6ld results (k = 1..%d tokens, %d rows a call) and %ld alone bit-equal to %s\n", name,
           n_batched, NTOK, MC_ROWS, n_ggml, "ggml_vec_dot_q8_0_q8_0");
}
#endif


#ifdef HAVE_512
// The prompt-chunk kernels reame_mm_{q8,q5}_0_amx (AMX tiles where reame_amx_ok(), else the
// same arithmetic in plain C) against this file's own statement of their arithmetic: per
// (row, token), S_i = the exact integer sum of block i, acc = fma((float) S_i * dx_i, dy_i, acc)
// for i = 0 .. nb - 1. 37 rows, 140 tokens (passes of 128, tiles of 16 and their
// remainders), 37, 16 or 5 rows and k = 1..40 or 120..140 tokens a call; and accuracy.
#define Q0A_ROWS 37
#define Q0A_TOK 140
static void test_q0_amx(int q5) {
    static const int nbs[] = {1, 2, 3, 28, 152};
    static const int nrs[] = {Q0A_ROWS, 16, 5};
    const char * name = q5 ? "reame_mm_q5_0_amx" : "reame_mm_q8_0_amx";
    const size_t xs = q5 ? sizeof(block_q5_0) : sizeof(block_q8_0);
    struct kernel K = {name, q5, NULL, Q0A_TOK, 0, 0, 0, 0, 0.0};
    for (size_t inb = 0; inb < sizeof(nbs) / sizeof(nbs[0]); ++inb) {
        const int nb = nbs[inb], n = nb * 32;
        const size_t by = nb * sizeof(block_q8_0), bs = BS * Q0A_ROWS;
        block_q8_0 * acts = malloc(Q0A_TOK * by);
        char * w = malloc(Q0A_ROWS * nb * xs);
        float * f = malloc(n * sizeof(float)), * wf = malloc(n * sizeof(float));
        float * want = malloc(Q0A_TOK * Q0A_ROWS * sizeof(float)), * out = malloc(Q0A_TOK * bs * sizeof(float));
        for (int c = 0; c < Q0A_TOK; ++c) make_q0_token(c % 3, nb, (block_q8_0 *) ((char *) acts + c * by), f);
        for (int r = 0; r < Q0A_ROWS; ++r) {
            char * row = w + r * nb * xs;
            make_q0_row(q5, r % 3, nb, row, f);
            if (q5) dequantize_row_q5_0((const block_q5_0 *) row, wf, n); else dequantize_row_q8_0((const block_q8_0 *) row, wf, n);
            for (int c = 0; c < Q0A_TOK; ++c) {
                const block_q8_0 * y = (const block_q8_0 *) ((const char *) acts + c * by);
                const float acc = q0_ref(row, q5, nb, y);
                double e = 0.0, m = 0.0;
                for (int j = 0; j < n; ++j) {
                    const double a = (double) ggml_fp16_to_fp32(y[j / 32].d) * y[j / 32].qs[j % 32];
                    e += (double) wf[j] * a;
                    m += fabs((double) wf[j] * a);
                }
                want[c * Q0A_ROWS + r] = acc;
                K.n_acc += check_acc(&K, name, nb, r, c, acc, e, m);
            }
        }
        for (size_t inr = 0; inr < sizeof(nrs) / sizeof(nrs[0]); ++inr) {
            const int nr = nrs[inr], r0 = Q0A_ROWS - nr;  // the last nr rows
            for (int k = 1; k <= Q0A_TOK; k = k == 40 ? 120 : k + 1) {
                const int o = Q0A_TOK - k;  // the last k tokens
                for (size_t j = 0; j < Q0A_TOK * bs; ++j) out[j] = NAN;
                (q5 ? reame_mm_q5_0_amx : reame_mm_q8_0_amx)(n, nr, k, out, bs, w + r0 * nb * xs, nb * xs,
                                                             (const char *) acts + o * by, by);
                for (size_t j = 0; j < Q0A_TOK * bs; ++j) {
                    const int c = (int) (j / bs), r = (int) (j % bs);
                    if (r < nr && c < k) {
                        const float wv = want[(o + c) * Q0A_ROWS + r0 + r];
                        if (bits(out[j]) == bits(wv)) K.n_batched++;
                        else fail("prompt kernel = its arithmetic, one row and token alone", name, nb, r0 + r, k, o + c, out[j], wv);
                    } else if (!isnan(out[j])) {
                        fail("wrote outside its rows and k results", name, nb, r, k, c, out[j], NAN);
                    }
                }
            }
        }
        free(acts); free(w); free(f); free(wf); free(want); free(out);
    }
    printf("  %-28s %6ld results (k = 1..40 and 120..%d tokens, %d, 16 and 5 rows a call; %s) bit-equal to "
           "their arithmetic computed one row and token at a time, %ld of it within the accuracy bound "
           "(worst error %.3f of the float rounding bound)\n", name, K.n_batched, Q0A_TOK, Q0A_ROWS,
           reame_amx_ok() ? "AMX tiles" : "no AMX here: the kernel's plain-C arithmetic", K.n_acc, K.worst);
}

// The row-range Q4_K kernels, reame_mm_q4_K_q8_K_512 and (where reame_amx_ok()) the AMX tiles'
// reame_mm_q4_K_amx, against reame_vec_dot_q4_K_q8_K_512 one row and token at a time (which,
// where AMX is usable, takes the AMX kernel's arithmetic): 37 weight rows of each kind, 40
// tokens, every k = 1..40 and 37, 16 or 5 rows a call (pairs of rows and a last odd one;
// tiles of 16 rows, 16 tokens, passes of 32 tokens, and their remainders).
#define Q4_ROWS 37
typedef void (*rows_fn)(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
static void test_q4_K_rows(void) {
    const int amx = reame_amx_ok();
    const char * names[2] = {"reame_mm_q4_K_q8_K_512", "reame_mm_q4_K_amx"};
    const rows_fn fns[2] = {reame_mm_q4_K_q8_K_512, reame_mm_q4_K_amx};
    static const int nrs[] = {Q4_ROWS, 16, 5};
    long n_same[2] = {0, 0};
    // NBS, and 261 blocks: past the 256 whose token side the one-token kernel lays out once
    static const int nbs[] = {1, 2, 3, 6, 11, 35, 261};
    for (size_t inb = 0; inb < sizeof(nbs) / sizeof(nbs[0]); ++inb) {
        const int nb = nbs[inb], n = nb * QK_K;
        const size_t row_size = nb * sizeof(block_q8_K), xs = nb * sizeof(block_q4_K), bs = BS * Q4_ROWS;
        block_q8_K * acts = malloc(NTOK * row_size);
        char * w = malloc(Q4_ROWS * xs);
        float * one = malloc(NTOK * Q4_ROWS * sizeof(float)), * out = malloc(NTOK * bs * sizeof(float));
        for (int c = 0; c < NTOK; ++c) make_acts(c % 5 == 4 ? 2 : c % 2, nb, (block_q8_K *) ((char *) acts + c * row_size));
        for (int r = 0; r < Q4_ROWS; ++r) make_weights(0, r % 3, nb, w + r * xs);
        for (int r = 0; r < Q4_ROWS; ++r)
            for (int c = 0; c < NTOK; ++c)
                reame_vec_dot_q4_K_q8_K_512(n, 1, &one[c * Q4_ROWS + r], 1, w + r * xs, (const char *) acts + c * row_size, row_size);
        for (int f = 0; f < 1 + amx; ++f) {
            for (size_t inr = 0; inr < sizeof(nrs) / sizeof(nrs[0]); ++inr) {
                const int nr = nrs[inr], r0 = Q4_ROWS - nr;  // the last nr rows
                for (int k = 1; k <= NTOK; ++k) {
                    const int o = NTOK - k;  // the last k tokens
                    for (size_t j = 0; j < NTOK * bs; ++j) out[j] = NAN;
                    fns[f](n, nr, k, out, bs, w + r0 * xs, xs, (const char *) acts + o * row_size, row_size);
                    for (size_t j = 0; j < NTOK * bs; ++j) {
                        const int c = (int) (j / bs), r = (int) (j % bs);
                        if (r < nr && c < k) {
                            const float want = one[(o + c) * Q4_ROWS + r0 + r];
                            if (bits(out[j]) == bits(want)) n_same[f]++;
                            else fail("rows at once = one row and token alone", names[f], nb, r0 + r, k, o + c, out[j], want);
                        } else if (!isnan(out[j])) {
                            fail("wrote outside its rows and k results", names[f], nb, r, k, c, out[j], NAN);
                        }
                    }
                }
            }
        }
        free(acts); free(w); free(one); free(out);
    }
    for (int f = 0; f < 2; ++f) {
        if (f && !amx) {
            printf("  %-28s not run: this CPU has no AMX-INT8 tiles, or Linux does not let this process use them "
                   "(reame_amx_ok() = 0: the 512-bit kernels take every Q4_K matmul)\n", names[f]);
            continue;
        }
        printf("  %-28s %6ld results (k = 1..%d tokens, %d, 16 and 5 rows a call) bit-equal to "
               "reame_vec_dot_q4_K_q8_K_512 one token and row at a time\n", names[f], n_same[f], NTOK, Q4_ROWS);
    }
}
#endif

int main(int argc, char ** argv) {
    if (argc > 1) rng_state = strtoull(argv[1], NULL, 0);
    ggml_cpu_init();  // fp16 tables, for builds without F16C

    struct kernel kernels[4];
    int nk = 0;
#ifdef HAVE_MC
    kernels[nk++] = (struct kernel) {"reame_vec_dot_q4_K_q8_K_mc", 0, reame_vec_dot_q4_K_q8_K_mc, 32, 1, 0, 0, 0, 0.0};
    kernels[nk++] = (struct kernel) {"reame_vec_dot_q6_K_q8_K_mc", 1, reame_vec_dot_q6_K_q8_K_mc, 32, 1, 0, 0, 0, 0.0};
#endif
#ifdef HAVE_512
    kernels[nk++] = (struct kernel) {"reame_vec_dot_q4_K_q8_K_512", 0, reame_vec_dot_q4_K_q8_K_512, 40, 0, 0, 0, 0, 0.0};
    kernels[nk++] = (struct kernel) {"reame_vec_dot_q6_K_q8_K_512", 1, reame_vec_dot_q6_K_q8_K_512, 40, 0, 0, 0, 0, 0.0};
#endif
    printf("test_kernels: seed 0x%llx; compiled for%s%s%s%s%s%s\n", (unsigned long long) rng_state,
#if defined(__x86_64__)
           " x86-64",
#else
           " not x86-64",
#endif
#if defined(__AVX__)
           " AVX",
#else
           "",
#endif
#if defined(__AVX2__)
           " AVX2",
#else
           "",
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
           " AVX-512(F,BW)",
#else
           "",
#endif
#if defined(__AVX512VNNI__)
           " VNNI",
#else
           "",
#endif
           nk ? "" : ": no reame kernels here (they need x86-64 with AVX); ggml's one-row kernel only");

    struct kernel ggml_k[2] = {{"ggml_vec_dot_q4_K_q8_K", 0, NULL, 1, 0, 0, 0, 0, 0.0},
                               {"ggml_vec_dot_q6_K_q8_K", 1, NULL, 1, 0, 0, 0, 0, 0.0}};
    const one_fn ggml_dot[2] = {ggml_vec_dot_q4_K_q8_K, ggml_vec_dot_q6_K_q8_K};
    const size_t wsize[2] = {sizeof(block_q4_K), sizeof(block_q6_K)};

    block_q8_K * acts = malloc((size_t) NTOK * MAX_NB * sizeof(block_q8_K));
    void * wrow = malloc(MAX_NB * sizeof(block_q6_K));
    float * out = malloc(NTOK * BS * sizeof(float));
    float one[NTOK], ggml_one[NTOK];
    double exact[NTOK], mag[NTOK];
    const uint32_t SENTINEL = 0x7fc0beefu;
    int row_id = 0;

    for (size_t inb = 0; inb < sizeof(NBS) / sizeof(NBS[0]); ++inb) {
        const int nb = NBS[inb], n = nb * QK_K;
        const size_t row_size = nb * sizeof(block_q8_K);  // the q8_K row stride ggml-cpu.c passes
        for (int c = 0; c < NTOK; ++c) {
            make_acts(c % 5 == 4 ? 2 : c % 2, nb, (block_q8_K *) ((char *) acts + c * row_size));
        }
        for (int q6 = 0; q6 < 2; ++q6) {
            for (int rep = 0; rep < 12; ++rep, ++row_id) {
                make_weights(q6, rep % 3, nb, wrow);
                for (int c = 0; c < NTOK; ++c) {
                    const block_q8_K * y = (const block_q8_K *) ((const char *) acts + c * row_size);
                    reference(q6, nb, wrow, y, &exact[c], &mag[c]);
                    ggml_dot[q6](n, &ggml_one[c], 0, wrow, wsize[q6], y, row_size, 1);
                    ggml_k[q6].n_acc += check_acc(&ggml_k[q6], ggml_k[q6].name, nb, row_id, c, ggml_one[c], exact[c], mag[c]);
                }
                for (int ik = 0; ik < nk; ++ik) {
                    struct kernel * K = &kernels[ik];
                    if (K->q6 != q6) continue;
                    for (int c = 0; c < NTOK; ++c) {  // one token at a time
                        K->fn(n, 1, &one[c], 1, wrow, (const char *) acts + c * row_size, row_size);
                        K->n_acc += check_acc(K, K->name, nb, row_id, c, one[c], exact[c], mag[c]);
                        if (K->ggml_bits) {
                            if (bits(one[c]) == bits(ggml_one[c])) K->n_ggml++;
                            else fail("bits of ggml's one-row kernel", K->name, nb, row_id, 1, c, one[c], ggml_one[c]);
                        }
                    }
                    for (int k = 1; k <= K->max_nc; ++k) {  // k tokens at once, two windows of the 40
                        const int offs[2] = {0, NTOK - k};
                        for (int w = 0; w < (offs[1] > 0 ? 2 : 1); ++w) {
                            const int o = offs[w];
                            for (int j = 0; j < NTOK * BS; ++j) memcpy(&out[j], &SENTINEL, 4);
                            K->fn(n, k, out, BS, wrow, (const char *) acts + o * row_size, row_size);
                            for (int j = 0; j < NTOK * BS; ++j) {
                                const int c = j / BS;
                                if (j % BS == 0 && c < k) {
                                    if (bits(out[j]) == bits(one[o + c])) K->n_batched++;
                                    else fail("batched = alone", K->name, nb, row_id, k, o + c, out[j], one[o + c]);
                                } else if (bits(out[j]) != SENTINEL) {
                                    fail("wrote outside its k results", K->name, nb, row_id, k, c, out[j], NAN);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    for (int q6 = 0; q6 < 2; ++q6) {
        printf("  %-28s %6ld results within the accuracy bound (worst error %.3f of the float rounding bound)\n",
               ggml_k[q6].name, ggml_k[q6].n_acc, ggml_k[q6].worst);
    }
    for (int ik = 0; ik < nk; ++ik) {
        const struct kernel * K = &kernels[ik];
        printf("  %-28s %6ld batched results (k = 1..%d) bit-equal to one token at a time", K->name, K->n_batched, K->max_nc);
        if (K->ggml_bits) printf(", %ld bit-equal to %s", K->n_ggml, ggml_k[K->q6].name);
        printf(", %ld within the accuracy bound (worst error %.3f of the float rounding bound)\n", K->n_acc, K->worst);
    }
#ifdef HAVE_Q0_MC
    test_q8_mc();
    test_q0(1, reame_mm_q5_0_q8_0_avx2, "reame_mm_q5_0_q8_0_avx2", Q0_ROWS, 1);
#endif
#ifdef HAVE_512
    test_q0(0, reame_mm_q8_0_q8_0_512, "reame_mm_q8_0_q8_0_512", 3, 0);
    test_q0(1, reame_mm_q5_0_q8_0_512, "reame_mm_q5_0_q8_0_512", 3, 0);
    test_q0_amx(0);
    test_q0_amx(1);
    test_q4_K_rows();
#endif
    if (n_fail) {
        printf("test_kernels: FAILED (%d failed checks)\n", n_fail);
        return 1;
    }
    printf("test_kernels: PASS\n");
    free(acts); free(wrow); free(out);
    return 0;
}
