// reame-kernels.c -- multi-token Q4_K . q8_K, Q6_K . q8_K (and Q8_0/Q5_0 . q8_0) dot products for ggml's x86
// CPU backend (part of build_llama.sh's patches; see patches/multi-token-kernels.diff).
//
// Not a translation unit of its own: build_llama.sh copies this file to
// ggml/src/ggml-cpu/arch/x86/ and the diff #includes it at the end of quants.c there,
// so it is compiled with that file's flags and uses its includes, block types and
// helpers (hsum_float_8, get_scale_shuffle, get_scale_shuffle_k4, MM256_SET_M128I,
// GGML_CPU_FP16_TO_FP32). ggml-cpu.c (same diff) calls the kernels for Q4_K/Q6_K
// matmuls of one 2-D weight.
//
// Each kernel computes, for the columns c < nc, s[c*bs] = (weight row vx) . (q8_K row at
// vy + c*by), n values (a multiple of QK_K):
//   reame_vec_dot_{q4,q6}_K_q8_K_mc    AVX2 or AVX; nc <= REAME_MC_MAX (32). Each column's
//                                      result is bit-identical to ggml_vec_dot_{q4,q6}_K_q8_K
//                                      for that column alone.
//   reame_mm_q8_0_q8_0_mc              AVX2 without AVX-512: Q8_0 weights against q8_0 tokens,
//                                      nr rows at once (row r at vx + r*bx; s[r + c*bs]), any
//                                      nc. Each result is bit-identical to
//                                      ggml_vec_dot_q8_0_q8_0 for that row and token alone.
//   reame_mm_q5_0_q8_0_avx2            AVX2 without AVX-512: Q5_0 weights against q8_0 tokens,
//                                      nr rows, any n (a multiple of 32) and nc, one token or
//                                      many. Its arithmetic is reame_q0_canon's (the 512-bit and
//                                      AMX kernels' bits), so a token's result does not depend
//                                      on nc, nr or the other tokens.
//   reame_mm_q0_avx2                   AVX2 without AVX-512: which of the two above a Q8_0/Q5_0
//                                      matmul block takes (ggml-cpu.c's mul_mat and mul_mat_id).
//   reame_vec_dot_{q4,q6}_K_q8_K_512   AVX-512 F+BW (VNNI when there); any nc. A column's
//                                      result does not depend on nc or on the other columns.
//   reame_mm_{q8,q5}_0_q8_0_512        AVX-512 F+BW, Q8_0/Q5_0 weights against q8_0 tokens,
//                                      nr rows at once (row r at vx + r*bx; s[r + c*bs]),
//                                      n a multiple of 64, any nc. As the _512 kernels: a
//                                      column's result does not depend on nc. Their arithmetic
//                                      is reame_q0_canon's, the AMX tiles' too.
//   reame_mm_q4_K_amx                  Q4_K with Intel AMX tiles (Linux), nr rows and nc tokens
//                                      at once; worth it from 8 tokens (REAME_AMX_MIN). Where
//                                      reame_amx_ok() (the CPU has AMX-INT8 and the kernel lets
//                                      this process use the tiles), reame_vec_dot_q4_K_q8_K_512
//                                      takes the same arithmetic (see "canonical" below), so a
//                                      token's bits are the same through either, alone or batched.
//                                      ggml-cpu.c also gives it Q4_K prompt chunks (in place of
//                                      ggml's tiled kernel): past 32 tokens it lays out a 16-row
//                                      tile's weights once for all its passes of 32.
//   reame_mm_{q8,q5}_0_amx             Q8_0/Q5_0 with AMX tiles, nr rows and nc tokens: decode
//                                      steps of 8+ tokens (REAME_AMX_MIN) and prompt chunks
//                                      (ggml-cpu.c: in place of llamafile's sgemm). The same
//                                      arithmetic as the 512-bit kernel (reame_q0_canon, which
//                                      runs where the tiles cannot), so a token's bits do not
//                                      depend on nr, nc, or which of them ran.
// patches/test_kernels.c checks these claims on random blocks (test_reame.py runs it).

// the kernels defined below (ggml-cpu.c, which calls them, declares them too)
void reame_vec_dot_q4_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_mc(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_mm_q8_0_q8_0_mc(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_q8_0_avx2(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
int reame_mm_q0_avx2(int type, int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_vec_dot_q4_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_mm_q8_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q4_K_q8_K_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
int reame_amx_ok(void);
void reame_mm_q4_K_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q8_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);
void reame_mm_q5_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by);

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
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
// reame: Q8_0 weights against q8_0 tokens, AVX2 (with AVX-512 the _512 kernels below take
// them): each weight block loaded once for up to 8 tokens, each token's result computed with
// ggml_vec_dot_q8_0_q8_0's AVX2 operations (mul_sum_i8_pairs_float, one fused multiply-add
// per block into eight lanes, hsum_float_8), so its bits are that kernel's.
// one row's results for g (<= 8) tokens; dyt: the tokens' scales, dyt[8*i + c] for block i
// (NULL: converted where used)
static inline __attribute__((always_inline)) void reame_q8_mc_cols(const int g, int nb, float * s, size_t bs,
        const char * xr, const char * vy, size_t by, const float * dyt) {
    __m256 acc[8];
    for (int c = 0; c < g; ++c) acc[c] = _mm256_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        const block_q8_0 * x = (const block_q8_0 *) xr + i;
        const float dx = GGML_CPU_FP16_TO_FP32(x->d);
        const __m256i qx = _mm256_loadu_si256((const __m256i *) x->qs);
        float d[8];  // dx * dy, as ggml's kernel rounds it (one product)
        if (dyt) {
            _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_set1_ps(dx), _mm256_loadu_ps(dyt + 8*i)));
        } else {
            for (int c = 0; c < g; ++c) d[c] = dx * GGML_CPU_FP16_TO_FP32(((const block_q8_0 *) (vy + c*by))[i].d);
        }
        for (int c = 0; c < g; ++c) {
            const block_q8_0 * y = (const block_q8_0 *) (vy + c*by) + i;
            const __m256 q = mul_sum_i8_pairs_float(qx, _mm256_loadu_si256((const __m256i *) y->qs));
            acc[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(d + c), q, acc[c]);
        }
    }
    for (int c = 0; c < g; ++c) s[c*bs] = hsum_float_8(acc[c]);
}
#define REAME_Q8_MC_NB 1024  // scales the table holds: 32 tokens x 256 blocks (32 KiB of stack)
void reame_mm_q8_0_q8_0_mc(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    const int nb = n / QK8_0, ng = (nc + 7) / 8;
    float table[8 * REAME_Q8_MC_NB];  // group j's block i: table[8*(j*nb + i) + c]
    const int tabled = ng * nb <= REAME_Q8_MC_NB;
    for (int j = 0; tabled && j < ng; ++j)  // the tokens' scales, once for all rows
        for (int i = 0; i < nb; ++i)
            for (int c = 0; c < 8; ++c)
                table[8*(j*nb + i) + c] = 8*j + c < nc ?
                    GGML_CPU_FP16_TO_FP32(((const block_q8_0 *) ((const char *) vy + (8*j + c)*by))[i].d) : 0.0f;
    for (int r = 0; r < nr; ++r) {  // a row's groups in turn: its blocks stay in L1
        const char * xr = (const char *) vx + r*bx;
        for (int j = 0; j < ng; ++j) {  // groups of 8 tokens: their accumulators stay in registers
            const char * y = (const char *) vy + 8*j*by;
            float * sc = s + r + 8*j*bs;
            const float * dyt = tabled ? table + 8*j*nb : NULL;
            switch (nc - 8*j < 8 ? nc - 8*j : 8) {
                case 1: reame_q8_mc_cols(1, nb, sc, bs, xr, y, by, dyt); break;
                case 2: reame_q8_mc_cols(2, nb, sc, bs, xr, y, by, dyt); break;
                case 3: reame_q8_mc_cols(3, nb, sc, bs, xr, y, by, dyt); break;
                case 4: reame_q8_mc_cols(4, nb, sc, bs, xr, y, by, dyt); break;
                case 5: reame_q8_mc_cols(5, nb, sc, bs, xr, y, by, dyt); break;
                case 6: reame_q8_mc_cols(6, nb, sc, bs, xr, y, by, dyt); break;
                case 7: reame_q8_mc_cols(7, nb, sc, bs, xr, y, by, dyt); break;
                default: reame_q8_mc_cols(8, nb, sc, bs, xr, y, by, dyt); break;
            }
        }
    }
}
// reame: Q5_0 weights against q8_0 tokens, AVX2, one token or many, with the arithmetic of
// reame_q0_canon (the 512-bit and AMX kernels' bits): S_i, block i's exact integer sum; four
// accumulators a_e = fma((float) S_i * dx_i, dy_i, a_e) for e = i / 4 mod 4; the result
// (a_0 + a_2) + (a_1 + a_3). A register holds 8 rows (lane r: row r), so a lane owns one
// (row, token) and nothing is summed across lanes: 8 rows' blocks are transposed once for all
// the tokens (dword j of a lane: the row's values 4j .. 4j + 3, unsigned: w + 16 = nibble +
// 16 x high bit, 0..31), and a token's 4 bytes are broadcast against each (vpmaddubsw, no sign
// trick: 4 pair sums of at most 2 x 31 x 128 fit an int16), less 16 x the token's block sum.
// ggml's one-row kernel takes 6-7 vector operations a block and token after unpacking; this
// one about 4 for 8 rows, and one unpacking serves every token.
// block i of 8 rows -> w[j] (the rows' values 4j .. 4j + 3, unsigned) and dx (their scales).
// The rows' 16 bytes of nibbles are transposed as they are (dword j: values 4j.. in its low
// nibbles, 16 + 4j.. in its high ones), then the high bits put in: byte j / 2 of each row's
// qh, one bit a byte.
static inline __attribute__((always_inline)) void reame_q5_prep8(const block_q5_0 * const xr[8], int i, __m256i w[8], __m256 * dx) {
    __m256i q[4];
    for (int r = 0; r < 4; ++r)  // rows r (low lane) and 4 + r (high)
        q[r] = MM256_SET_M128I(_mm_loadu_si128((const __m128i *) xr[4 + r][i].qs), _mm_loadu_si128((const __m128i *) xr[r][i].qs));
    const __m256i t0 = _mm256_unpacklo_epi32(q[0], q[1]), t1 = _mm256_unpackhi_epi32(q[0], q[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(q[2], q[3]), t3 = _mm256_unpackhi_epi32(q[2], q[3]);
    const __m256i Q[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),  // dword j of rows 0..7
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    uint32_t h[8];
    ggml_half dh[8];
    for (int r = 0; r < 8; ++r) {
        memcpy(&h[r], xr[r][i].qh, 4);
        dh[r] = xr[r][i].d;
    }
    const __m256i H = _mm256_loadu_si256((const __m256i *) h);
    *dx = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) dh));
    const __m256i m4 = _mm256_set1_epi8(0x0F), b4 = _mm256_set1_epi8(0x10);
    const __m256i lanes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C);
    for (int j = 0; j < 8; ++j) {
        const __m256i nib = j < 4 ? _mm256_and_si256(Q[j], m4) : _mm256_and_si256(_mm256_srli_epi16(Q[j - 4], 4), m4);
        // each byte m of a lane: byte j / 2 of its row's qh, and bit (4j + m) mod 8 of that
        const __m256i hb = _mm256_shuffle_epi8(H, _mm256_add_epi8(lanes, _mm256_set1_epi8((char) (j / 2))));
        const __m256i bit = _mm256_set1_epi32((int) (0x08040201u << (4 * (j & 1))));
        w[j] = _mm256_or_si256(nib, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit), b4));
    }
}
// 16 x the sum of a q8_0 block's 32 values
static inline int32_t reame_q8_sum16(const block_q8_0 * y) {
    return 16 * hsum_i32_8(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), _mm256_loadu_si256((const __m256i *) y->qs)),
                                             _mm256_set1_epi16(1)));
}
// g (1..4) tokens (y[t]; sy, dy: their tables, nb a token) against 8 rows' blocks b0 .. b0 +
// bc - 1 (w, dx: reame_q5_prep8's); acc[t][e]: token t's accumulator e, 8 rows
static inline __attribute__((always_inline)) void reame_q5_toks(const int g, int nb, int b0, int bc, const __m256i (*w)[8],
        const __m256 * dx, const block_q8_0 * const * y, const int32_t * sy, const float * dy, __m256 (*acc)[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b4 = 0; b4 < bc; b4 += 4) {  // 4 blocks a run (b0 is a multiple of 4): one accumulator
        const int e = ((b0 + b4) >> 2) & 3, be = b4 + 4 < bc ? b4 + 4 : bc;
        __m256 a[4];
        for (int t = 0; t < g; ++t) a[t] = acc[t][e];
        for (int b = b4; b < be; ++b) {
            const int i = b0 + b;
            for (int t = 0; t < g; ++t) {  // a token's 8 products in turn: few registers live
                const int32_t * q = (const int32_t *) y[t][i].qs;
                __m256i p0 = _mm256_maddubs_epi16(w[b][0], _mm256_set1_epi32(q[0]));  // values 0..15
                __m256i p1 = _mm256_maddubs_epi16(w[b][4], _mm256_set1_epi32(q[4]));  // 16..31
                for (int j = 1; j < 4; ++j) {
                    p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(w[b][j], _mm256_set1_epi32(q[j])));
                    p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(w[b][4 + j], _mm256_set1_epi32(q[4 + j])));
                }
                const __m256i S = _mm256_sub_epi32(_mm256_add_epi32(_mm256_madd_epi16(p0, ones), _mm256_madd_epi16(p1, ones)),
                                                   _mm256_set1_epi32(sy[t*nb + i]));
                a[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S), dx[b]), _mm256_set1_ps(dy[t*nb + i]), a[t]);
            }
        }
        for (int t = 0; t < g; ++t) acc[t][e] = a[t];
    }
}
#define REAME_Q5_TOK 64  // the most tokens sharing one unpacking of the rows
#define REAME_Q5_BC 32   // blocks of 8 rows unpacked at a time (9 KiB)
// up to 8 rows (xr[r]; past nrow, copies whose results are not stored) against ms tokens;
// pf: pf_len bytes (the rows that come next) to prefetch meanwhile, or NULL. The rows' blocks
// are read 8 rows abreast, which the hardware prefetcher does not follow as it does one row.
static void reame_q5_rows8(int nb, const block_q5_0 * const xr[8], int nrow, int ms, const block_q8_0 * const * y,
                           const int32_t * sy, const float * dy, float * s, size_t bs, const char * pf, size_t pf_len) {
    const int pf_lines = pf ? (int) ((pf_len + 63) / 64) : 0, pf_per_block = (pf_lines + nb - 1) / nb;
    __m256i w[REAME_Q5_BC][8];
    __m256 dx[REAME_Q5_BC];
    __m256 acc[REAME_Q5_TOK][4];
    for (int c = 0; c < ms; ++c)
        for (int e = 0; e < 4; ++e) acc[c][e] = _mm256_setzero_ps();
    for (int b0 = 0; b0 < nb; b0 += REAME_Q5_BC) {
        const int bc = nb - b0 < REAME_Q5_BC ? nb - b0 : REAME_Q5_BC;
        for (int b = 0; b < bc; ++b) {
            for (int l = (b0 + b) * pf_per_block; l < (b0 + b + 1) * pf_per_block && l < pf_lines; ++l)
                _mm_prefetch(pf + 64 * (size_t) l, _MM_HINT_T0);
            reame_q5_prep8(xr, b0 + b, w[b], &dx[b]);
        }
        for (int c0 = 0; c0 < ms; c0 += 4) {  // 4 tokens at a time: 4 chains of fused steps
            switch (ms - c0 < 4 ? ms - c0 : 4) {
                case 1: reame_q5_toks(1, nb, b0, bc, w, dx, y + c0, sy + c0*nb, dy + c0*nb, acc + c0); break;
                case 2: reame_q5_toks(2, nb, b0, bc, w, dx, y + c0, sy + c0*nb, dy + c0*nb, acc + c0); break;
                case 3: reame_q5_toks(3, nb, b0, bc, w, dx, y + c0, sy + c0*nb, dy + c0*nb, acc + c0); break;
                default: reame_q5_toks(4, nb, b0, bc, w, dx, y + c0, sy + c0*nb, dy + c0*nb, acc + c0); break;
            }
        }
    }
    for (int c = 0; c < ms; ++c) {
        float o[8];
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_add_ps(acc[c][0], acc[c][2]), _mm256_add_ps(acc[c][1], acc[c][3])));
        for (int r = 0; r < nrow; ++r) s[c*bs + r] = o[r];
    }
}
void reame_mm_q5_0_q8_0_avx2(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    const int nb = n / QK8_0;
    // tokens a pass: their tables (8 bytes a block) within 64 KiB of stack
    const int tp = 8192 / nb < 4 ? 4 : 8192 / nb > REAME_Q5_TOK ? REAME_Q5_TOK : 8192 / nb;
    for (int cs = 0; cs < nc; cs += tp) {
        const int ms = nc - cs < tp ? nc - cs : tp;
        int32_t sy[ms * nb];  // 16 x each token's block sums
        float dy[ms * nb];    // its block scales
        const block_q8_0 * y[REAME_Q5_TOK];
        for (int c = 0; c < ms; ++c) {
            y[c] = (const block_q8_0 *) ((const char *) vy + (cs + c)*by);
            for (int i = 0; i < nb; ++i) {
                sy[c*nb + i] = reame_q8_sum16(y[c] + i);
                dy[c*nb + i] = GGML_CPU_FP16_TO_FP32(y[c][i].d);
            }
        }
        for (int r0 = 0; r0 < nr; r0 += 8) {
            const int nrow = nr - r0 < 8 ? nr - r0 : 8;
            const block_q5_0 * xr[8];
            for (int r = 0; r < 8; ++r)
                xr[r] = (const block_q5_0 *) ((const char *) vx + (r0 + (r < nrow ? r : nrow - 1))*bx);
            const int pf0 = r0 + 8, pfn = nr - pf0 < 8 ? nr - pf0 : 8;  // the next 8 rows (2 groups ahead: no faster)
            reame_q5_rows8(nb, xr, nrow, ms, y, sy, dy, s + r0 + cs*bs, bs,
                           pfn > 0 ? (const char *) vx + pf0*bx : NULL, pfn > 0 ? (size_t) pfn * bx : 0);
        }
    }
}
// The AVX2 rule for Q8_0/Q5_0 weights, the one place mul_mat and mul_mat_id (ggml-cpu.c)
// ask: Q5_0 at any number of tokens, Q8_0 from two tokens (one token keeps ggml's kernel,
// whose bits reame_mm_q8_0_q8_0_mc computes). 1: computed here; 0: the caller's path.
int reame_mm_q0_avx2(int type, int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    if (type == GGML_TYPE_Q5_0) {
        reame_mm_q5_0_q8_0_avx2(n, nr, nc, s, bs, vx, bx, vy, by);
        return 1;
    }
    if (type == GGML_TYPE_Q8_0 && nc > 1) {
        reame_mm_q8_0_q8_0_mc(n, nr, nc, s, bs, vx, bx, vy, by);
        return 1;
    }
    return 0;
}
#endif
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
// with their sums in registers (a 9th starts another pass). A token's float steps per
// block are three on all 16 lanes (the block's scales on the weights' side, its own d
// broadcast from memory), with no halving of the register: on the Sapphire Rapids guest
// that took a Q4_K block-token from 3.6 to 3.3 ns. Integer sums are exact and
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
// w[m+1]'s), times the scales sc[0], sc[1] laid out to match; 16 int32 lanes (each half
// a partial sum of the block: the halves are added at the end, in float)
static inline __m512i reame_dot4(const __m512i * w, const __m512i * sc, const int8_t * q8) {
    const __m512i * q = (const __m512i *) q8;
    const __m512i p01 = _mm512_packs_epi32(REAME_DPBUSD512(w[0], _mm512_loadu_si512(q + 0)),
                                           REAME_DPBUSD512(w[1], _mm512_loadu_si512(q + 1)));
    const __m512i p23 = _mm512_packs_epi32(REAME_DPBUSD512(w[2], _mm512_loadu_si512(q + 2)),
                                           REAME_DPBUSD512(w[3], _mm512_loadu_si512(q + 3)));
    return REAME_DPWSSD512(REAME_DPWSSD512(_mm512_setzero_si512(), p01, sc[0]), p23, sc[1]);
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
    __m512 acc[REAME_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = _mm512_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        REAME_PREFETCH_BLOCK(x + i);
        const __m512 dx = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[i].d));
        const __m512 dminx = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[i].dmin));
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
            // (sums * dx - mins * dmin) * d: the mins' 8 sums go in the low half
            const __m512i pm = _mm512_zextsi256_si512(_mm256_madd_epi16(mins2, _mm256_loadu_si256((const __m256i *) y->bsums)));
            const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(reame_dot4(w, sc, y->qs)), dx, _mm512_mul_ps(_mm512_cvtepi32_ps(pm), dminx));
            acc[c] = _mm512_fmadd_ps(t, _mm512_set1_ps(y->d), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = _mm512_reduce_add_ps(acc[c]);
}
static inline __attribute__((always_inline)) void reame_q6_K_512_cols(
        int nb, const block_q6_K * x, const block_q8_K * y0, size_t by, float * s, size_t bs, const int nc) {
    __m512 acc[REAME_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = _mm512_setzero_ps();
    for (int i = 0; i < nb; ++i) {
        REAME_PREFETCH_BLOCK(x + i);
        const __m512 dx = _mm512_set1_ps(GGML_CPU_FP16_TO_FP32(x[i].d));
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
            // (the 8 sums to take off go in the low half)
            const __m512i q8sclsub = _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) y->bsums), scales), 5));
            const __m512i sumi = _mm512_sub_epi32(reame_dot4(w, sc, y->qs), q8sclsub);
            acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sumi), dx), _mm512_set1_ps(y->d), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = _mm512_reduce_add_ps(acc[c]);
}
// a constant column count per call, so the compiler keeps the sums in registers
#define REAME_COLS_DISPATCH(m, fn, ...) do { switch (m) { \
    case 1: fn(__VA_ARGS__, 1); break;  case 2: fn(__VA_ARGS__, 2); break; \
    case 3: fn(__VA_ARGS__, 3); break;  case 4: fn(__VA_ARGS__, 4); break; \
    case 5: fn(__VA_ARGS__, 5); break;  case 6: fn(__VA_ARGS__, 6); break; \
    case 7: fn(__VA_ARGS__, 7); break;  default: fn(__VA_ARGS__, 8); break; } } while (0)
// reame: the canonical Q4_K arithmetic, shared by the AMX kernel and, where AMX is used, by
// reame_vec_dot_q4_K_q8_K_512. Per (weight block, token): S = sum over the 8 chunks of
// scale * (chunk . q8) and M = sum of min * (the chunk's q8 sum), both exact integers, then
// t = S * dx - (M * dminx) (one fused rounding after M * dminx's) and acc[i % 4] += t * d
// (fused), four accumulators by block index mod 4, added as (acc0 + acc1) + (acc2 + acc3) at
// the end. Every step is the same whatever computes the integers, so AMX tiles (integer sums
// over 64 values per row and token) and the 512-bit kernel (reame_dot4's 16 lanes, summed per
// block) agree bit for bit. The 512-bit kernels sum four (block, token) pairs at once, so
// the shuffles of the four reductions are shared: four blocks of a row and one token, two
// blocks of two rows (the rows' last blocks), or two blocks and two tokens.
// [S_a, M_a, S_c, M_c, S_b, M_b, S_d, M_d] of four pairs, from reame_dot4's lanes (d*) and the
// mins' 8 lanes (p*)
static inline __attribute__((always_inline)) __m256i reame_q4_K_sums4(
        __m512i da, __m512i db, __m512i dc, __m512i dd, __m256i pa, __m256i pb, __m256i pc, __m256i pd) {
    const __m512i zab = _mm512_add_epi32(_mm512_shuffle_i64x2(da, db, 0x44), _mm512_shuffle_i64x2(da, db, 0xEE));
    const __m512i zcd = _mm512_add_epi32(_mm512_shuffle_i64x2(dc, dd, 0x44), _mm512_shuffle_i64x2(dc, dd, 0xEE));
    const __m512i mab = _mm512_inserti64x4(_mm512_castsi256_si512(pa), pb, 1);
    const __m512i mcd = _mm512_inserti64x4(_mm512_castsi256_si512(pc), pd, 1);
    // S's pairs in the even lanes, M's in the odd (shifts: not the shuffle port)
    const __m512i vab = _mm512_mask_blend_epi32(0xAAAA, _mm512_add_epi32(zab, _mm512_srli_epi64(zab, 32)),
                                                _mm512_add_epi32(mab, _mm512_slli_epi64(mab, 32)));
    const __m512i vcd = _mm512_mask_blend_epi32(0xAAAA, _mm512_add_epi32(zcd, _mm512_srli_epi64(zcd, 32)),
                                                _mm512_add_epi32(mcd, _mm512_slli_epi64(mcd, 32)));
    const __m512i w = _mm512_add_epi32(_mm512_unpacklo_epi64(vab, vcd), _mm512_unpackhi_epi64(vab, vcd));
    const __m512i w2 = _mm512_add_epi32(w, _mm512_shuffle_i64x2(w, w, _MM_PERM_CDAB));
    return _mm512_castsi512_si256(_mm512_permutexvar_epi64(_mm512_set_epi64(0, 0, 0, 0, 5, 4, 1, 0), w2));
}
// [S_a, M_a, S_b, M_b] of two pairs (a group of two, or one: a == b)
static inline __attribute__((always_inline)) __m128i reame_q4_K_sums2(__m512i da, __m512i db, __m256i pa, __m256i pb) {
    const __m512i z = _mm512_add_epi32(_mm512_shuffle_i64x2(da, db, 0x44), _mm512_shuffle_i64x2(da, db, 0xEE));
    const __m512i m = _mm512_inserti64x4(_mm512_castsi256_si512(pa), pb, 1);
    const __m512i v = _mm512_mask_blend_epi32(0xAAAA, _mm512_add_epi32(z, _mm512_srli_epi64(z, 32)),
                                              _mm512_add_epi32(m, _mm512_slli_epi64(m, 32)));
    const __m512i v2 = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
    const __m512i v3 = _mm512_add_epi32(v2, _mm512_shuffle_i64x2(v2, v2, _MM_PERM_CDAB));
    return _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_set_epi32(0,0,0,0, 0,0,0,0, 0,0,0,0, 9,8,1,0), v3));
}
// t = S * dx - M * dminx in lanes 0, 2, 4, 6 (x: [dx, dminx] of each pair's block)
static inline __attribute__((always_inline)) __m256 reame_q4_K_t4(__m256i g, __m256 x) {
    const __m256 f = _mm256_cvtepi32_ps(g);
    return _mm256_fmsub_ps(f, x, _mm256_movehdup_ps(_mm256_mul_ps(f, x)));
}
// the same for two pairs, in lanes 0 and 2 of the low half
static inline __attribute__((always_inline)) __m256 reame_q4_K_t2(__m128i g, __m128 x) {
    const __m128 f = _mm_cvtepi32_ps(g);
    return _mm256_castps128_ps256(_mm_fmsub_ps(f, x, _mm_movehdup_ps(_mm_mul_ps(f, x))));
}
static const int32_t reame_lanes_04[8] = {0, 0, 0, 0, 2, 2, 2, 2};  // lanes 0, 2 -> 0, 4 (where sums4's a and b are)
// the integer sums of one (block, token) pair
#define REAME_Q4_DOT(u, y) reame_dot4((u).w, (u).sc, (y)->qs)
#define REAME_Q4_MIN(u, y) _mm256_madd_epi16((u).mins2, _mm256_loadu_si256((const __m256i *) (y)->bsums))
// a Q4_K block's weight side, unpacked once for the tokens
typedef struct { __m512i w[4], sc[2]; __m256i mins2; } reame_q4w;
static inline __attribute__((always_inline)) void reame_q4_K_unpack(const block_q4_K * x, reame_q4w * u) {
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m128i mins;
    const __m512i scales = _mm512_castsi256_si512(reame_q4_K_scales_mins(x, &mins));
    u->mins2 = _mm256_shuffle_epi8(MM256_SET_M128I(mins, mins), _mm256_loadu_si256((const __m256i *) reame_q4_K_min_dup));
    u->sc[0] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const __m512i *) reame_q4_K_sc_idx), scales);
    u->sc[1] = _mm512_permutexvar_epi16(_mm512_loadu_si512((const __m512i *) (reame_q4_K_sc_idx + 32)), scales);
    for (int j = 0; j < 4; ++j) {
        const __m512i q4bits = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (x->qs + 32*j)));
        u->w[j] = _mm512_and_si512(_mm512_srlv_epi16(q4bits, shift), m4);
    }
}
static inline int reame_q4_K_dm(const block_q4_K * x) {  // d and dmin, two halves
    uint32_t h;
    memcpy(&h, &x->d, 4);
    return (int) h;
}
// one (row, block) pair of one token: its integer sums
#define REAME_Q4_PAIR(xb, yb, d, p) do { reame_q4w u_; reame_q4_K_unpack((xb), &u_); \
    d = REAME_Q4_DOT(u_, (yb)); p = REAME_Q4_MIN(u_, (yb)); } while (0)
// one token's four blocks i..i+3 of a row into acc (lanes 0, 4, 2, 6: classes 0..3)
static inline __attribute__((always_inline)) __m256 reame_q4_K_row4(const block_q4_K * x, const block_q8_K * y,
                                                                   int i, const float * dy, __m256 acc) {
    __m512i da, db, dc, dd;
    __m256i pa, pb, pc, pd;
    REAME_PREFETCH_BLOCK(x + i); REAME_PREFETCH_BLOCK(x + i + 1); REAME_PREFETCH_BLOCK(x + i + 2); REAME_PREFETCH_BLOCK(x + i + 3);
    REAME_Q4_PAIR(x + i, y + i, da, pa);
    REAME_Q4_PAIR(x + i + 1, y + i + 1, db, pb);
    REAME_Q4_PAIR(x + i + 2, y + i + 2, dc, pc);
    REAME_Q4_PAIR(x + i + 3, y + i + 3, dd, pd);
    const __m256 xd = _mm256_cvtph_ps(_mm_set_epi32(reame_q4_K_dm(x + i + 3), reame_q4_K_dm(x + i + 1),
                                                    reame_q4_K_dm(x + i + 2), reame_q4_K_dm(x + i)));
    const __m256 t = reame_q4_K_t4(reame_q4_K_sums4(da, db, dc, dd, pa, pb, pc, pd), xd);
    return _mm256_mask3_fmadd_ps(t, _mm256_loadu_ps(dy), acc, 0x55);
}
// (class 0 + class 1) + (class 2 + class 3): lanes (0 + 4) + (2 + 6)
static inline float reame_q4_K_acc_sum(__m256 acc) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehl_ps(h, h)));
}
// the token's d for blocks i..i+3 as reame_q4_K_row4's lanes take them (0 past the row)
static inline const float * reame_q4_K_dy4(const block_q8_K * y, int nb, int i, float * d) {
    static const int lane[4] = {0, 4, 2, 6};
    for (int l = 0; l < 8; ++l) d[l] = 0.0f;
    for (int k = 0; k < 4 && i + k < nb; ++k) d[lane[k]] = y[i + k].d;
    return d;
}
// one token against nr rows (row r at vx + r*bx, its result at s[r]): four blocks of a row at
// a time (reame_q4_K_row4); the last one to three blocks of two rows together: two blocks
// i, i+1 of rows r, r+1 in lanes 0, 4, 2, 6 (r+1's moved to 0, 4), a last odd block of both
// as a pair (moved to its class's lane); a last odd row as two. The token's d as the lanes
// take it: laid out once per call for rows of up to 256 blocks, else per group as it comes.
#define REAME_DY_GROUPS 64
static void reame_q4_K_512c_rows(int nb, int nr, float * s, const char * vx, size_t bx, const block_q8_K * y) {
    float dy[REAME_DY_GROUPS * 8], tmp[8];
    const int ng = (nb + 3) / 4, main = nb & ~3, pre = ng <= REAME_DY_GROUPS;
    for (int g = 0; pre && g < ng; ++g) reame_q4_K_dy4(y, nb, 4 * g, dy + 8 * g);
#define REAME_DY(i) (pre ? dy + 2 * (i) : reame_q4_K_dy4(y, nb, (i), tmp))
    const int odd = (nb - main) & 1, io = nb - 1, lo = odd && io > main ? 2 : 0;  // a last odd block, its lane
    for (int r = 0; r < nr; r += 2) {
        const block_q4_K * x0 = (const block_q4_K *) (vx + (size_t) r * bx);
        const block_q4_K * x1 = r + 1 < nr ? (const block_q4_K *) (vx + (size_t) (r + 1) * bx) : x0;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int j = 0; j < main; j += 4) {
            const float * dj = REAME_DY(j);
            acc0 = reame_q4_K_row4(x0, y, j, dj, acc0);
            if (r + 1 < nr) acc1 = reame_q4_K_row4(x1, y, j, dj, acc1);
        }
        const __m256 d = main < nb ? _mm256_loadu_ps(REAME_DY(main)) : _mm256_setzero_ps();
        if (nb - main >= 2) {  // blocks main, main + 1 (classes 0, 1) of both rows
            const int i = main;
            __m512i da, db, dc, dd;
            __m256i pa, pb, pc, pd;
            REAME_Q4_PAIR(x0 + i, y + i, da, pa);
            REAME_Q4_PAIR(x0 + i + 1, y + i + 1, db, pb);
            REAME_Q4_PAIR(x1 + i, y + i, dc, pc);
            REAME_Q4_PAIR(x1 + i + 1, y + i + 1, dd, pd);
            const __m256 xd = _mm256_cvtph_ps(_mm_set_epi32(reame_q4_K_dm(x1 + i + 1), reame_q4_K_dm(x0 + i + 1),
                                                            reame_q4_K_dm(x1 + i), reame_q4_K_dm(x0 + i)));
            const __m256 t = reame_q4_K_t4(reame_q4_K_sums4(da, db, dc, dd, pa, pb, pc, pd), xd);
            acc0 = _mm256_mask3_fmadd_ps(t, d, acc0, 0x11);
            acc1 = _mm256_mask3_fmadd_ps(_mm256_permutexvar_ps(_mm256_setr_epi32(2, 2, 2, 2, 6, 6, 6, 6), t), d, acc1, 0x11);  // (r+1's)
        }
        if (odd) {  // the last block (class 0 or 2) of both rows: t in lanes 0 (row r), 2 (r + 1)
            __m512i da, db;
            __m256i pa, pb;
            REAME_Q4_PAIR(x0 + io, y + io, da, pa);
            REAME_Q4_PAIR(x1 + io, y + io, db, pb);
            const __m128 x2 = _mm_cvtph_ps(_mm_set_epi32(0, 0, reame_q4_K_dm(x1 + io), reame_q4_K_dm(x0 + io)));
            const __m256 t = reame_q4_K_t2(reame_q4_K_sums2(da, db, pa, pb), x2);
            const __m256i to0 = _mm256_set1_epi32(0), to2 = _mm256_set1_epi32(2);
            acc0 = _mm256_mask3_fmadd_ps(_mm256_permutexvar_ps(to0, t), d, acc0, (__mmask8) (1 << lo));
            acc1 = _mm256_mask3_fmadd_ps(_mm256_permutexvar_ps(to2, t), d, acc1, (__mmask8) (1 << lo));
        }
        s[r] = reame_q4_K_acc_sum(acc0);
        if (r + 1 < nr) s[r + 1] = reame_q4_K_acc_sum(acc1);
    }
#undef REAME_DY
}
// nc (1..REAME_COLS) tokens against one weight row: blocks in pairs (i, i+1: classes k, k+1,
// k = i % 4 = 0 or 2), tokens in pairs (t, u): the four sums together, t's in lanes 0 (block
// i) and 4 (i+1), u's in 2 and 6 of acc[pair][k / 2]; a last token alone: lanes 0 and 4 of
// acc[pair][k / 2]; a last block alone (nb odd): lanes 0 (t) and 2 (u), or 0
static inline __attribute__((always_inline)) void reame_q4_K_512c_cols(
        int nb, const block_q4_K * x, const block_q8_K * y0, size_t by, float * s, size_t bs, const int nc) {
    enum { NP = (REAME_COLS + 1) / 2 };
    const int np = (nc + 1) / 2;
    __m256 acc[NP][2];
    for (int p = 0; p < np; ++p) acc[p][0] = acc[p][1] = _mm256_setzero_ps();
    const block_q8_K * y[NP * 2];
    for (int c = 0; c < np * 2; ++c) y[c] = (const block_q8_K *) ((const char *) y0 + (c < nc ? c : c - 1)*by);
    int i = 0;
    for (; i + 1 < nb; i += 2) {
        const int h = (i >> 1) & 1;  // (classes 0, 1 or 2, 3)
        REAME_PREFETCH_BLOCK(x + i);
        REAME_PREFETCH_BLOCK(x + i + 1);
        reame_q4w ua, ub;
        reame_q4_K_unpack(x + i, &ua);
        reame_q4_K_unpack(x + i + 1, &ub);
        const int dma = reame_q4_K_dm(x + i), dmb = reame_q4_K_dm(x + i + 1);
        const __m256 x4 = _mm256_cvtph_ps(_mm_set_epi32(dmb, dmb, dma, dma));
        const __m128 x2 = _mm_cvtph_ps(_mm_set_epi32(0, 0, dmb, dma));
        for (int p = 0; p < np; ++p) {
            const block_q8_K * yt = y[2*p] + i, * yu = y[2*p+1] + i;
            if (2*p + 1 < nc) {
                const __m256 dy = _mm256_setr_ps(yt[0].d, 0.0f, yu[0].d, 0.0f, yt[1].d, 0.0f, yu[1].d, 0.0f);
                const __m256 t = reame_q4_K_t4(reame_q4_K_sums4(REAME_Q4_DOT(ua, yt), REAME_Q4_DOT(ub, yt + 1),
                                                                REAME_Q4_DOT(ua, yu), REAME_Q4_DOT(ub, yu + 1),
                                                                REAME_Q4_MIN(ua, yt), REAME_Q4_MIN(ub, yt + 1),
                                                                REAME_Q4_MIN(ua, yu), REAME_Q4_MIN(ub, yu + 1)), x4);
                acc[p][h] = _mm256_fmadd_ps(t, dy, acc[p][h]);
            } else {
                const __m256 dy = _mm256_setr_ps(yt[0].d, 0.0f, 0.0f, 0.0f, yt[1].d, 0.0f, 0.0f, 0.0f);
                const __m256 t = reame_q4_K_t2(reame_q4_K_sums2(REAME_Q4_DOT(ua, yt), REAME_Q4_DOT(ub, yt + 1),
                                                                REAME_Q4_MIN(ua, yt), REAME_Q4_MIN(ub, yt + 1)), x2);
                acc[p][h] = _mm256_mask3_fmadd_ps(_mm256_permutexvar_ps(_mm256_loadu_si256((const __m256i *) reame_lanes_04), t),
                                                  dy, acc[p][h], 0x11);
            }
        }
    }
    if (i < nb) {  // the last block, alone (class 0 or 2: lanes 0 and 2 of acc[pair][k / 2])
        const int h = (i >> 1) & 1;
        reame_q4w ua;
        reame_q4_K_unpack(x + i, &ua);
        const __m128 x2 = _mm_cvtph_ps(_mm_set1_epi32(reame_q4_K_dm(x + i)));
        for (int p = 0; p < np; ++p) {
            const block_q8_K * yt = y[2*p] + i, * yu = 2*p + 1 < nc ? y[2*p+1] + i : yt;
            const __m256 t = reame_q4_K_t2(reame_q4_K_sums2(REAME_Q4_DOT(ua, yt), REAME_Q4_DOT(ua, yu),
                                                            REAME_Q4_MIN(ua, yt), REAME_Q4_MIN(ua, yu)), x2);
            const __m256 dy = _mm256_setr_ps(yt->d, 0.0f, yu->d, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f);
            acc[p][h] = _mm256_mask3_fmadd_ps(t, dy, acc[p][h], 2*p + 1 < nc ? 0x05 : 0x01);
        }
    }
    for (int p = 0; p < np; ++p) {
        // per token: (class 0 + class 1) + (class 2 + class 3)
        float r0[8], r1[8];
        _mm256_storeu_ps(r0, acc[p][0]);
        _mm256_storeu_ps(r1, acc[p][1]);
        s[(2*p)*bs] = (r0[0] + r0[4]) + (r1[0] + r1[4]);
        if (2*p + 1 < nc) s[(2*p + 1)*bs] = (r0[2] + r0[6]) + (r1[2] + r1[6]);
    }
}
void reame_vec_dot_q4_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    const int canonical = reame_amx_ok();  // (the AMX kernel's arithmetic where it runs)
    if (canonical && nc == 1) {
        reame_q4_K_512c_rows(n / QK_K, 1, s, (const char *) vx, 0, (const block_q8_K *) vy);
        return;
    }
    for (int c0 = 0; c0 < nc; c0 += REAME_COLS) {
        if (canonical) {
            REAME_COLS_DISPATCH(nc - c0, reame_q4_K_512c_cols, n / QK_K, (const block_q4_K *) vx,
                                (const block_q8_K *) ((const char *) vy + c0*by), by, s + c0*bs, bs);
        } else {
            REAME_COLS_DISPATCH(nc - c0, reame_q4_K_512_cols, n / QK_K, (const block_q4_K *) vx,
                                (const block_q8_K *) ((const char *) vy + c0*by), by, s + c0*bs, bs);
        }
    }
}

// nr rows (row r at vx + r*bx, its results at s[r + c*bs]) by nc tokens: one token over a
// row range takes the rows kernel (the token's side laid out once)
void reame_mm_q4_K_q8_K_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    if (nc == 1 && reame_amx_ok()) {
        reame_q4_K_512c_rows(n / QK_K, nr, s, (const char *) vx, bx, (const block_q8_K *) vy);
        return;
    }
    for (int r = 0; r < nr; ++r) reame_vec_dot_q4_K_q8_K_512(n, nc, s + r, bs, (const char *) vx + (size_t) r * bx, vy, by);
}

// reame: the arithmetic of every Q8_0/Q5_0 kernel here, per (row, token), the same whatever
// the number of rows or tokens in the call and whichever kernel runs it: S_i, the exact
// integer sum of block i (32 weights times 32 token values), then four accumulators by
// block index,
//   a_e = fma((float) S_i * dx_i, dy_i, a_e)   e = (i / 4) mod 4, for i = 0, 1, ..., nb - 1
// in order, each from 0 (dx_i: the weight row's scale of block i, dy_i: the token's), and
// the result (a_0 + a_2) + (a_1 + a_3). The 512-bit kernel gets 16 block sums a register
// (four blocks per accumulator, on 128-bit quarters); the AMX tiles get one block for
// 16 rows x 16 tokens (and take the blocks accumulator by accumulator). reame_q0_canon is
// that arithmetic in plain C: the tiles' answer where they cannot run (their scratch not
// allocated, no AMX), so a token's bits never depend on which.
static inline int reame_q0_acc(int i) { return i >> 2 & 3; }  // block i's accumulator, e
static inline int reame_q0_weight(const void * vx, int q5, int i, int j) {
    if (!q5) return ((const block_q8_0 *) vx)[i].qs[j];
    const block_q5_0 * x = (const block_q5_0 *) vx + i;
    uint32_t qh;
    memcpy(&qh, x->qh, 4);
    const int nib = j < 16 ? x->qs[j] & 0xF : x->qs[j - 16] >> 4;
    return (nib | (int) ((qh >> j) & 1) << 4) - 16;
}
static void reame_q0_canon(int q5, int n, int nr, int nc, float * s, size_t bs, const char * vx, size_t bx,
                           const char * vy, size_t by) {
    const int nb = n / QK8_0;
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < nc; ++c) {
            const block_q8_0 * y = (const block_q8_0 *) (vy + (size_t) c * by);
            float a[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int i = 0; i < nb; ++i) {
                int32_t S = 0;
                for (int j = 0; j < QK8_0; ++j) S += reame_q0_weight(vx + (size_t) r * bx, q5, i, j) * y[i].qs[j];
                const float dx = GGML_CPU_FP16_TO_FP32(q5 ? ((const block_q5_0 *) (vx + (size_t) r * bx))[i].d
                                                          : ((const block_q8_0 *) (vx + (size_t) r * bx))[i].d);
                a[reame_q0_acc(i)] = fmaf((float) S * dx, GGML_CPU_FP16_TO_FP32(y[i].d), a[reame_q0_acc(i)]);
            }
            s[(size_t) c * bs + r] = (a[0] + a[2]) + (a[1] + a[3]);
        }
}
#if defined(__linux__) && (defined(__clang__) || __GNUC__ >= 11)
// reame: Q4_K with Intel AMX tiles (Sapphire Rapids and later). A tile multiply (tdpbusd)
// sums 16 weight rows x 64 values x 16 tokens of u8 x s8 products into int32 at once, where
// vpdpbusd takes 64 products. The block's 6-bit scales are folded into the weights, split
// in two so each product fits a byte: scale = 8 hi + lo (hi, lo < 8, 15 x 7 <= 255), so
// S = (weights x lo) . q8 + 8 (weights x hi) . q8, exactly. Per 16-row tile and block: the
// scaled weights are laid out (16 rows x 64 bytes per 64 values, lo and hi), the tokens
// were laid out once per call (4-byte groups, 16 tokens a tile, up to 32 tokens a pass),
// 8 or 16 tile multiplies, and the float steps of the canonical arithmetic above on 16
// tokens per register, one block behind the tiles. On the 2-core Sapphire Rapids guest
// (n = 8960, 512 rows, patches/time_kernels.c): 1.1 ns per block-token at 32 tokens, 1.5 at
// 16, 2.9 at 8, against 4.2-4.3 for the 512-bit kernel; 21 at one token (the weights' layout
// per block is the cost: it pays from 8 tokens, REAME_AMX_MIN in ggml-cpu.c).
#include <cpuid.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>
static int reame_amx_state;  // 0: not asked yet, 1: usable, -1: not
int reame_amx_ok(void) {
    int st = __atomic_load_n(&reame_amx_state, __ATOMIC_ACQUIRE);
    if (!st) {  // (two threads asking at once get the same answer)
        unsigned a, b, c, d;
        const char * off = getenv("REAME_NO_AMX");
        const int ok = !(off && *off && strcmp(off, "0") != 0) &&
                       __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
                       syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        st = ok ? 1 : -1;
        __atomic_store_n(&reame_amx_state, st, __ATOMIC_RELEASE);
    }
    return st > 0;
}
typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } reame_tilecfg;
static _Thread_local uint8_t * reame_amx_buf;  // a thread's scratch (ggml's threads live on)
static _Thread_local size_t reame_amx_cap;
// the thread's scratch, at least need bytes (64-aligned), or NULL: no memory
static uint8_t * reame_amx_scratch(size_t need) {
    if (reame_amx_cap < need) {
        free(reame_amx_buf);
        reame_amx_buf = aligned_alloc(64, (need + 63) & ~(size_t) 63);
        reame_amx_cap = reame_amx_buf ? need : 0;
    }
    return reame_amx_buf;
}
// the float steps of one block for a 16-row tile: C holds its integer sums (lo and hi tiles
// per 16 tokens), D the tokens' d, P their chunk sums in pairs, mp the rows' mins in pairs
static inline __attribute__((always_inline)) void reame_q4_K_amx_float(
        const int32_t * C, const float * D, const int32_t * P, const float * dxs, const float * dms,
        const int32_t (*mp)[4], int rows, int nt, float * acc) {
    for (int T = 0; T < nt; ++T) {
        const __m512 dv = _mm512_loadu_ps(D + 16 * T);
        const __m512i p0 = _mm512_loadu_si512(P + 0 * 32 + 16 * T);
        const __m512i p1 = _mm512_loadu_si512(P + 1 * 32 + 16 * T);
        const __m512i p2 = _mm512_loadu_si512(P + 2 * 32 + 16 * T);
        const __m512i p3 = _mm512_loadu_si512(P + 3 * 32 + 16 * T);
        const int32_t * cl = C + 512 * T, * ch = cl + 256;
        for (int r = 0; r < rows; ++r) {
            const __m512i isum = _mm512_add_epi32(_mm512_load_si512(cl + 16 * r),
                                                  _mm512_slli_epi32(_mm512_load_si512(ch + 16 * r), 3));
            __m512i ms = _mm512_madd_epi16(_mm512_set1_epi32(mp[r][0]), p0);
            ms = _mm512_add_epi32(ms, _mm512_madd_epi16(_mm512_set1_epi32(mp[r][1]), p1));
            ms = _mm512_add_epi32(ms, _mm512_madd_epi16(_mm512_set1_epi32(mp[r][2]), p2));
            ms = _mm512_add_epi32(ms, _mm512_madd_epi16(_mm512_set1_epi32(mp[r][3]), p3));
            const __m512 t = _mm512_fmsub_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dxs[r]),
                                             _mm512_mul_ps(_mm512_cvtepi32_ps(ms), _mm512_set1_ps(dms[r])));
            float * a = acc + r * 32 + 16 * T;
            _mm512_store_ps(a, _mm512_fmadd_ps(t, dv, _mm512_load_ps(a)));
        }
    }
}
// which scale word each 16-bit lane of a step's lo (even index) and hi (odd) multiplier takes:
// words 0-7 the scales' low 3 bits, 8-15 their high 3 bits; step st holds chunks 2st, 2st+1
#define REAME_R16(v) v,v,v,v,v,v,v,v,v,v,v,v,v,v,v,v
static const int16_t reame_q4_K_amx_idx[8][32] = {
    {REAME_R16(0), REAME_R16(1)}, {REAME_R16(8), REAME_R16(9)}, {REAME_R16(2), REAME_R16(3)}, {REAME_R16(10), REAME_R16(11)},
    {REAME_R16(4), REAME_R16(5)}, {REAME_R16(12), REAME_R16(13)}, {REAME_R16(6), REAME_R16(7)}, {REAME_R16(14), REAME_R16(15)} };
#undef REAME_R16
__attribute__((target("amx-tile,amx-int8")))
void reame_mm_q4_K_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    const int nb = n / QK_K;
    if (!reame_amx_ok()) {  // (tiles used before Linux granted them: SIGILL)
        reame_mm_q4_K_q8_K_512(n, nr, nc, s, bs, vx, bx, vy, by);
        return;
    }
    // per pass of up to 32 tokens (np passes, all laid out first): B tiles [nb][4 steps][2 tiles][16 groups
    // of 4 values][16 tokens x 4], D [nb][32] (the tokens' d), P [nb][4][32] (their 8 chunk sums, in int16
    // pairs). With several passes (prompt chunks), a 16-row tile's weights are laid out once for all of
    // them (A: [nb] blocks, X: their scales); with one, two blocks' worth in turn (Ab, xs), in L1.
    const int np = (nc + 31) / 32;
    const size_t b_sz = (size_t) np * nb * 8192, d_sz = (size_t) np * nb * 32 * 4, p_sz = (size_t) np * nb * 4 * 32 * 4;
    const size_t a_sz = np > 1 ? (size_t) nb * 8192 : 0, x_sz = np > 1 ? (size_t) nb * 384 : 0;
    const size_t need = b_sz + d_sz + p_sz + 2 * 4096 + 2 * 8192 + 4 * 2048 + a_sz + x_sz;
    uint8_t * B = reame_amx_scratch(need);
    if (!B) {  // (no memory: the 512-bit kernel, same bits)
        reame_mm_q4_K_q8_K_512(n, nr, nc, s, bs, vx, bx, vy, by);
        return;
    }
    float * D = (float *) (B + b_sz);
    int32_t * P = (int32_t *) ((uint8_t *) D + d_sz);
    int32_t * Cb = (int32_t *) ((uint8_t *) P + p_sz);  // 2 x 4 tiles of 16 x 16 int32 (a block's, the one before's)
    uint8_t * Ab = (uint8_t *) Cb + 2 * 4096;            // 2 x [4 steps][lo, hi][16 rows][64]
    float * acc = (float *) (Ab + 2 * 8192);             // [block index mod 4][16 rows][32 tokens]
    uint8_t * Ac = (uint8_t *) acc + 4 * 2048;           // (np > 1) [nb][4 steps][lo, hi][16 rows][64]
    float * Xf = (float *) (Ac + a_sz);                  // (np > 1) [nb]: the rows' dx[16], dmin[16]
    int32_t * Xm = (int32_t *) (Xf + (size_t) nb * 32 * (np > 1));  // (np > 1) [nb]: their mins in pairs [16][4]
    float xsf[2][32];                                    // (np == 1) the same, two blocks in turn
    int32_t xsm[2][64];
    reame_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i idx[8];
    for (int j = 0; j < 8; ++j) idx[j] = _mm512_loadu_si512((const __m512i *) reame_q4_K_amx_idx[j]);
    {
        const int ng = nc - (np - 1) * 32, nt = ng > 16 ? 2 : 1;  // the last pass
        uint8_t * Bl = B + (size_t) (np - 1) * nb * 8192;
        if (ng % 16) {  // a tile's tokens past ng: zero (their results are not written)
            for (int i = 0; i < nb; ++i)
                for (int st = 0; st < 4; ++st) memset(Bl + (size_t) i * 8192 + st * 2048 + (nt - 1) * 1024, 0, 1024);
            memset(D + (size_t) (np - 1) * nb * 32, 0, (size_t) nb * 32 * 4);
            memset(P + (size_t) (np - 1) * nb * 128, 0, (size_t) nb * 128 * 4);
        }
    }
    for (int cc = 0; cc < nc; ++cc) {
        const block_q8_K * y = (const block_q8_K *) ((const char *) vy + (size_t) cc * by);
        const int c = cc & 31;
        uint8_t * Bp = B + (size_t) (cc >> 5) * nb * 8192;
        float * Dp = D + (size_t) (cc >> 5) * nb * 32;
        int32_t * Pp = P + (size_t) (cc >> 5) * nb * 128;
        for (int i = 0; i < nb; ++i) {
            const uint32_t * q = (const uint32_t *) y[i].qs;
            uint32_t * bi = (uint32_t *) (Bp + (size_t) i * 8192 + (c >> 4) * 1024) + (c & 15);
            for (int st = 0; st < 4; ++st)
                for (int g = 0; g < 16; ++g) bi[st * 512 + g * 16] = q[16 * st + g];
            Dp[i * 32 + c] = y[i].d;
            for (int p = 0; p < 4; ++p) {  // (|a chunk's sum| <= 4096: int16)
                const int16_t b0 = y[i].bsums[4*p] + y[i].bsums[4*p+1], b1 = y[i].bsums[4*p+2] + y[i].bsums[4*p+3];
                Pp[(i * 4 + p) * 32 + c] = (int32_t) (uint16_t) b0 | ((int32_t) b1 << 16);
            }
        }
    }
    for (int r0 = 0; r0 < nr; r0 += 16) {
        const int rows = nr - r0 < 16 ? nr - r0 : 16;
        if (rows < 16) { memset(Ab, 0, 2 * 8192); memset(Ac, 0, a_sz); }
        for (int pass = 0; pass < np; ++pass) {
            const int c0 = pass * 32, ng = nc - c0 < 32 ? nc - c0 : 32, nt = ng > 16 ? 2 : 1;
            const uint8_t * Bp = B + (size_t) pass * nb * 8192;
            const float * Dp = D + (size_t) pass * nb * 32;
            const int32_t * Pp = P + (size_t) pass * nb * 128;
            memset(acc, 0, 4 * 16 * 32 * sizeof(float));
            for (int i = 0; i <= nb; ++i) {
                const int h = i & 1;
                if (i < nb) {
                    uint8_t * A = np > 1 ? Ac + (size_t) i * 8192 : Ab + h * 8192;
                    float * dxs = np > 1 ? Xf + (size_t) i * 32 : xsf[h], * dms = dxs + 16;
                    int32_t (*mp)[4] = (int32_t (*)[4]) (np > 1 ? Xm + (size_t) i * 64 : xsm[h]);
                    for (int r = 0; r < rows && pass == 0; ++r) {
                        const block_q4_K * x = (const block_q4_K *) ((const char *) vx + (size_t) (r0 + r) * bx) + i;
                        // (the next 16-row tile's block i into L2: a tile's rows are 16 streams; a row of a
                        // few blocks is done before a prefetch within it would land)
                        for (int o = 0; o < (int) sizeof(*x); o += 64) _mm_prefetch((const char *) x + 16 * bx + o, _MM_HINT_T1);
                        dxs[r] = GGML_CPU_FP16_TO_FP32(x->d);
                        dms[r] = GGML_CPU_FP16_TO_FP32(x->dmin);
                        uint32_t utmp[4];
                        reame_q4_K_scales(x->scales, utmp);
                        const uint8_t * mnb = (const uint8_t *) utmp + 8;
                        for (int p = 0; p < 4; ++p) mp[r][p] = (int32_t) mnb[2*p] | ((int32_t) mnb[2*p+1] << 16);
                        const __m128i sc8 = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) utmp));
                        const __m512i lh = _mm512_castsi256_si512(MM256_SET_M128I(_mm_srli_epi16(sc8, 3), _mm_and_si128(sc8, _mm_set1_epi16(7))));
                        for (int st = 0; st < 4; ++st) {  // (a byte times a word < 8 stays in its byte)
                            const __m512i q4bits = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (x->qs + 32*st)));
                            const __m512i wv = _mm512_and_si512(_mm512_srlv_epi16(q4bits, shift), m4);
                            _mm512_store_si512((__m512i *) (A + st * 2048 + r * 64), _mm512_mullo_epi16(wv, _mm512_permutexvar_epi16(idx[2*st], lh)));
                            _mm512_store_si512((__m512i *) (A + st * 2048 + 1024 + r * 64), _mm512_mullo_epi16(wv, _mm512_permutexvar_epi16(idx[2*st+1], lh)));
                        }
                    }
                    const uint8_t * bi = Bp + (size_t) i * 8192;
                    int32_t * C = Cb + h * 1024;
                    _tile_zero(0); _tile_zero(1); _tile_zero(4); _tile_zero(5);
                    for (int st = 0; st < 4; ++st) {
                        _tile_loadd(2, A + st * 2048, 64);
                        _tile_loadd(3, A + st * 2048 + 1024, 64);
                        _tile_loadd(6, bi + st * 2048, 64);
                        _tile_dpbusd(0, 2, 6);
                        _tile_dpbusd(1, 3, 6);
                        if (nt > 1) {
                            _tile_loadd(7, bi + st * 2048 + 1024, 64);
                            _tile_dpbusd(4, 2, 7);
                            _tile_dpbusd(5, 3, 7);
                        }
                    }
                    _tile_stored(0, C, 64);
                    _tile_stored(1, C + 256, 64);
                    if (nt > 1) { _tile_stored(4, C + 512, 64); _tile_stored(5, C + 768, 64); }
                }
                if (i > 0) {  // the block before's float steps, while this one's tiles run
                    const int g = h ^ 1;
                    const float * xg = np > 1 ? Xf + (size_t) (i - 1) * 32 : xsf[g];
                    int32_t * mg = np > 1 ? Xm + (size_t) (i - 1) * 64 : xsm[g];
                    reame_q4_K_amx_float(Cb + g * 1024, Dp + (i - 1) * 32, Pp + (i - 1) * 128, xg, xg + 16,
                                         (const int32_t (*)[4]) mg, rows, nt, acc + ((i - 1) & 3) * 512);
                }
            }
            for (int r = 0; r < rows; ++r)
                for (int c = 0; c < ng; ++c) {
                    const float * a = acc + r * 32 + c;
                    s[(size_t) (c0 + c) * bs + r0 + r] = (a[0] + a[512]) + (a[1024] + a[1536]);
                }
        }
    }
    _tile_release();
}
// the float steps of one block for 16 tokens and a 16-row tile (C: its integer sums, a
// token's 16 rows a line; dx: the rows' scales; dy: the tokens')
static inline __attribute__((always_inline)) void reame_q0_amx_float(
        const int32_t * C, const float * dx, const float * dy, __m512 acc[16]) {
    const __m512 d = _mm512_load_ps(dx);
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t)  // (unrolled: the accumulators stay in registers)
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(C + 16 * t)), d),
                                 _mm512_set1_ps(dy[t]), acc[t]);
}
// an accumulator's end: its 16 tokens' sums to A, and the registers back to 0
static inline __attribute__((always_inline)) void reame_q0_amx_flush(__m512 acc[16], float * A) {
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) {
        _mm512_store_ps(A + 16 * t, acc[t]);
        acc[t] = _mm512_setzero_ps();
    }
}
// a weight block as 32 signed bytes, and its scale
static inline __attribute__((always_inline)) __m256i reame_q0_bytes(const char * xr, int q5, int i, float * dx) {
    if (q5) {
        const block_q5_0 * x = (const block_q5_0 *) xr + i;
        const __m128i qs = _mm_loadu_si128((const __m128i *) x->qs);
        const __m256i nib = _mm256_and_si256(MM256_SET_M128I(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0xF));
        uint32_t qh;
        memcpy(&qh, x->qh, 4);
        const __m512i v = _mm512_sub_epi8(_mm512_castsi256_si512(nib), _mm512_set1_epi8(16));
        *dx = GGML_CPU_FP16_TO_FP32(x->d);
        return _mm512_castsi512_si256(_mm512_mask_add_epi8(v, (__mmask64) qh, v, _mm512_set1_epi8(16)));
    }
    const block_q8_0 * x = (const block_q8_0 *) xr + i;
    *dx = GGML_CPU_FP16_TO_FP32(x->d);
    return _mm256_loadu_si256((const __m256i *) x->qs);
}
// One tile multiply per (16 tokens, 16 rows, block): a tile's K is one block (32 values), so
// its sums are the block's own. The tokens' tile is read where they lie (a q8_0 block's 32
// values, row stride by); the weights of 16 rows are unpacked once for all the tokens into
// the tiles' 4-byte-group layout (W: [nb][8 groups][16 rows x 4], a 16 x 8 transpose in
// registers), while the tiles of the row tile before run, the next 16 rows are prefetched.
// The blocks go accumulator by accumulator (reame_q0_canon's a_e: blocks 0-3, 16-19, ...,
// then 4-7, 20-23, ...), 16 accumulators of 16 rows in registers, stored at an a_e's end.
// Two tile sets in turn: the next block's multiply is issued before this one's sums are
// stored, and its float steps run meanwhile.
__attribute__((target("amx-tile,amx-int8")))
static void reame_q0_amx(int q5, int n, int nr, int nc, float * s, size_t bs, const char * vx, size_t bx,
                         const char * vy, size_t by) {
    const int nb = n / QK8_0, nt = (nc + 15) / 16, tl = nc % 16;
    // W [nb][8][16][4]; DX [nb][16]; DY [token tiles][nb][16]; Y: a last partial token tile [nb][16][32]
    const size_t w_sz = (size_t) nb * 512, dx_sz = (size_t) nb * 64, dy_sz = (size_t) nt * nb * 64,
                 y_sz = (size_t) nb * 512, need = w_sz + dx_sz + dy_sz + y_sz + 2 * 1024 + 4 * 1024;
    if (!reame_amx_ok()) {
        reame_q0_canon(q5, n, nr, nc, s, bs, vx, bx, vy, by);
        return;
    }
    uint8_t * W = reame_amx_scratch(need);
    if (!W) {  // (no memory: the same arithmetic in plain C)
        reame_q0_canon(q5, n, nr, nc, s, bs, vx, bx, vy, by);
        return;
    }
    uint8_t * Y = W + w_sz + dx_sz + dy_sz;
    float * DX = (float *) (W + w_sz), * DY = (float *) ((uint8_t *) DX + dx_sz);
    int32_t * Cb = (int32_t *) (Y + y_sz);
    int ord[nb], last[nb];  // the blocks in accumulator order; whether the next is another's
    for (int e = 0, o = 0; e < 4; ++e)
        for (int i = 0; i < nb; ++i)
            if (reame_q0_acc(i) == e) ord[o++] = i;
    for (int o = 0; o < nb; ++o) last[o] = o + 1 == nb || reame_q0_acc(ord[o + 1]) != reame_q0_acc(ord[o]);
    float * A = (float *) (Cb + 512);  // [4 accumulators][16 tokens][16 rows]
    for (int e = 0; e < 4; ++e)
        if (4 * e >= nb) memset(A + e * 256, 0, 1024);  // (an accumulator no block reaches)
    reame_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t += 4) {
        cfg.rows[t] = 16; cfg.colsb[t] = 32;         // 0, 4 (A): 16 tokens x one block
        cfg.rows[t + 1] = 8; cfg.colsb[t + 1] = 64;  // 1, 5 (B): one block (8 groups of 4) x 16 rows
    }
    cfg.rows[2] = cfg.rows[3] = 16; cfg.colsb[2] = cfg.colsb[3] = 64;  // 2, 3 (C): 16 tokens x 16 rows, int32
    _tile_loadconfig(&cfg);
    if (tl) memset(DY + (size_t) (nt - 1) * nb * 16, 0, (size_t) nb * 64);
    for (int c = 0; c < nc; ++c) {
        const block_q8_0 * y = (const block_q8_0 *) (vy + (size_t) c * by);
        float * dt = DY + (size_t) (c >> 4) * nb * 16 + (c & 15);
        for (int i = 0; i < nb; ++i) dt[i * 16] = GGML_CPU_FP16_TO_FP32(y[i].d);
    }
    if (tl) {  // the last tile's tokens, padded with zeros (a tile load reads 16)
        memset(Y, 0, y_sz);
        for (int c = 0; c < tl; ++c) {
            const block_q8_0 * y = (const block_q8_0 *) (vy + (size_t) (nc - tl + c) * by);
            for (int i = 0; i < nb; ++i) memcpy(Y + (size_t) i * 512 + c * 32, y[i].qs, 32);
        }
    }
    const __m512i lo4 = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), hi4 = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    const int steps = nt * nb;  // block steps a row tile takes (the next tile's prefetch is spread over them)
    for (int r0 = 0; r0 < nr; r0 += 16) {
        const int rows = nr - r0 < 16 ? nr - r0 : 16;
        for (int i = 0; i < nb; ++i) {
            __m512i z[8], u[8];
            for (int k = 0; k < 8; ++k) {  // rows k and k + 8, in halves
                float d0 = 0.0f, d1 = 0.0f;
                const __m256i w0 = k < rows ? reame_q0_bytes(vx + (size_t) (r0 + k) * bx, q5, i, &d0) : _mm256_setzero_si256();
                const __m256i w1 = k + 8 < rows ? reame_q0_bytes(vx + (size_t) (r0 + k + 8) * bx, q5, i, &d1) : _mm256_setzero_si256();
                DX[i * 16 + k] = d0;
                DX[i * 16 + k + 8] = d1;
                z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
            }
            for (int k = 0; k < 8; k += 2) {  // dwords: [r0 r1 r0 r1] / [r2 r3 r2 r3]... within 128-bit lanes
                u[k] = _mm512_unpacklo_epi32(z[k], z[k + 1]);
                u[k + 1] = _mm512_unpackhi_epi32(z[k], z[k + 1]);
            }
            for (int h = 0; h < 8; h += 4) {  // a lane: 4 rows' dword j (lanes 0, 2) or j + 4 (1, 3)
                z[h + 0] = _mm512_unpacklo_epi64(u[h + 0], u[h + 2]);
                z[h + 1] = _mm512_unpackhi_epi64(u[h + 0], u[h + 2]);
                z[h + 2] = _mm512_unpacklo_epi64(u[h + 1], u[h + 3]);
                z[h + 3] = _mm512_unpackhi_epi64(u[h + 1], u[h + 3]);
            }
            uint8_t * wi = W + (size_t) i * 512;
            for (int j = 0; j < 4; ++j) {  // group j: lanes 0 of rows 0-3 and 4-7, lanes 2 of rows 8-11, 12-15
                _mm512_store_si512((__m512i *) (wi + j * 64), _mm512_permutex2var_epi64(z[j], lo4, z[j + 4]));
                _mm512_store_si512((__m512i *) (wi + (j + 4) * 64), _mm512_permutex2var_epi64(z[j], hi4, z[j + 4]));
            }
        }
        // the next 16 rows' weights into L2, a few lines a block step
        const char * pf = vx + (size_t) (r0 + 16) * bx, * pf_end = vx + (size_t) (nr < r0 + 32 ? nr : r0 + 32) * bx;
        const int per = pf < pf_end ? (int) ((pf_end - pf) / 64 / steps) + 1 : 0;
        for (int T = 0; T < nt; ++T) {
            const int tk = nc - 16 * T < 16 ? nc - 16 * T : 16;
            const char * ya = tk < 16 ? (const char *) Y : vy + (size_t) (16 * T) * by + offsetof(block_q8_0, qs);
            const size_t ys = tk < 16 ? 512 : sizeof(block_q8_0), yst = tk < 16 ? 32 : by;  // a block's step, a token's
            const float * dt = DY + (size_t) T * nb * 16;
            __m512 acc[16];
#pragma GCC unroll 16
            for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
            _tile_loadd(0, ya + ord[0] * ys, yst);
            _tile_loadd(1, W + (size_t) ord[0] * 512, 64);
            _tile_zero(2);
            _tile_dpbssd(2, 0, 1);
            for (int o = 0; o < nb; o += 2) {
                for (int k = 0; k < 2 * per && pf < pf_end; ++k, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
                if (o + 1 < nb) {
                    _tile_loadd(4, ya + ord[o + 1] * ys, yst);
                    _tile_loadd(5, W + (size_t) ord[o + 1] * 512, 64);
                    _tile_zero(3);
                    _tile_dpbssd(3, 4, 5);
                }
                _tile_stored(2, Cb, 64);
                reame_q0_amx_float(Cb, DX + ord[o] * 16, dt + ord[o] * 16, acc);
                if (last[o]) reame_q0_amx_flush(acc, A + reame_q0_acc(ord[o]) * 256);
                if (o + 1 < nb) {
                    if (o + 2 < nb) {
                        _tile_loadd(0, ya + ord[o + 2] * ys, yst);
                        _tile_loadd(1, W + (size_t) ord[o + 2] * 512, 64);
                        _tile_zero(2);
                        _tile_dpbssd(2, 0, 1);
                    }
                    _tile_stored(3, Cb + 256, 64);
                    reame_q0_amx_float(Cb + 256, DX + ord[o + 1] * 16, dt + ord[o + 1] * 16, acc);
                    if (last[o + 1]) reame_q0_amx_flush(acc, A + reame_q0_acc(ord[o + 1]) * 256);
                }
            }
            const __mmask16 m = (__mmask16) ((1u << rows) - 1);
            for (int t = 0; t < tk; ++t) {  // (a_0 + a_2) + (a_1 + a_3)
                const float * a = A + 16 * t;
                _mm512_mask_storeu_ps(s + (size_t) (16 * T + t) * bs + r0, m,
                                      _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(a), _mm512_load_ps(a + 512)),
                                                    _mm512_add_ps(_mm512_load_ps(a + 256), _mm512_load_ps(a + 768))));
            }
        }
    }
    _tile_release();
}
void reame_mm_q8_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    reame_q0_amx(0, n, nr, nc, s, bs, vx, bx, vy, by);
}
void reame_mm_q5_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    reame_q0_amx(1, n, nr, nc, s, bs, vx, bx, vy, by);
}
#else
int reame_amx_ok(void) { return 0; }
void reame_mm_q4_K_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    reame_mm_q4_K_q8_K_512(n, nr, nc, s, bs, vx, bx, vy, by);
}
void reame_mm_q8_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    reame_q0_canon(0, n, nr, nc, s, bs, vx, bx, vy, by);
}
void reame_mm_q5_0_amx(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    reame_q0_canon(1, n, nr, nc, s, bs, vx, bx, vy, by);
}
#endif // AMX
void reame_vec_dot_q6_K_q8_K_512(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    for (int c0 = 0; c0 < nc; c0 += REAME_COLS) {
        REAME_COLS_DISPATCH(nc - c0, reame_q6_K_512_cols, n / QK_K, (const block_q6_K *) vx,
                            (const block_q8_K *) ((const char *) vy + c0*by), by, s + c0*bs, bs);
    }
}
// reame: Q8_0 and Q5_0 weights (against q8_0 tokens) in 512-bit registers, one token or
// many, with the arithmetic of reame_q0_canon (four accumulators by block index, see there),
// so a token gets the same bits alone, batched, or through the AMX tiles. A register holds
// two 32-value blocks as unsigned bytes (w + 128: an xor for Q8_0); vpdpbusd against the
// token's signed bytes gives 16 dword sums, and 8 such registers (16 blocks) fold into one of
// 16 block sums (reame_q0_sums16: 14 shuffles and 7 adds), less 128 x the token's block sums
// (computed once a call) = the exact S_i. Then per 16 blocks: one conversion, one multiply
// by the rows' 16 scales (a gather, once for all the tokens) and four fused steps on 128-bit
// quarters, one per block-index accumulator. The weight side (unpacking, scales) is done once
// for up to REAME_COLS tokens.
static inline __attribute__((always_inline)) __m512i reame_q0_pair(const void * vx, int i, const int q5) {
    if (q5) {  // two blocks as w + 128 = nib + 16 h + 112
        const block_q5_0 * x = (const block_q5_0 *) vx + i;
        // value j < 16: low nibble of qs[j]; j >= 16: high nibble of qs[j - 16]
        const __m256i q01 = MM256_SET_M128I(_mm_loadu_si128((const __m128i *) x[1].qs), _mm_loadu_si128((const __m128i *) x[0].qs));
        const __m512i qq = _mm512_permutexvar_epi64(_mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0), _mm512_castsi256_si512(q01));
        const __m512i nib = _mm512_and_si512(_mm512_srlv_epi64(qq, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0xF));
        uint32_t h0, h1;
        memcpy(&h0, x[0].qh, 4);
        memcpy(&h1, x[1].qh, 4);
        const __m512i u = _mm512_add_epi8(nib, _mm512_set1_epi8(112));
        return _mm512_mask_add_epi8(u, (__mmask64) h0 | ((__mmask64) h1 << 32), u, _mm512_set1_epi8(16));
    }
    const block_q8_0 * x = (const block_q8_0 *) vx + i;
    return _mm512_xor_si512(reame_pair(_mm256_loadu_si256((const __m256i *) x[0].qs), _mm256_loadu_si256((const __m256i *) x[1].qs)),
                            _mm512_set1_epi8((char) 0x80));
}
// a token's blocks i and i + 1, 64 signed bytes
static inline __m512i reame_q0_tok(const block_q8_0 * y, int i) {
    return reame_pair(_mm256_loadu_si256((const __m256i *) y[i].qs), _mm256_loadu_si256((const __m256i *) y[i + 1].qs));
}
// R[j]: 16 dword sums of blocks 2j (lanes 0-7) and 2j + 1 (8-15) -> the 16 blocks' sums,
// lane 4k + e holding block 4e + k (so 128-bit quarter k: blocks k, 4 + k, 8 + k, 12 + k)
static inline __attribute__((always_inline)) __m512i reame_q0_sums16(const __m512i R[8]) {
    __m512i P[4];
    for (int m = 0; m < 4; ++m)  // quarter k of P[m]: block 4m + k, 4 sums
        P[m] = _mm512_add_epi32(_mm512_shuffle_i32x4(R[2 * m], R[2 * m + 1], 0x88),
                                _mm512_shuffle_i32x4(R[2 * m], R[2 * m + 1], 0xDD));
    // quarter k: blocks k and 4 + k (Q0), 8 + k and 12 + k (Q1), 2 sums each
    const __m512i Q0 = _mm512_add_epi32(_mm512_unpacklo_epi64(P[0], P[1]), _mm512_unpackhi_epi64(P[0], P[1]));
    const __m512i Q1 = _mm512_add_epi32(_mm512_unpacklo_epi64(P[2], P[3]), _mm512_unpackhi_epi64(P[2], P[3]));
    const __m512 a = _mm512_castsi512_ps(Q0), b = _mm512_castsi512_ps(Q1);
    return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, 0x88)), _mm512_castps_si512(_mm512_shuffle_ps(a, b, 0xDD)));
}
// the block in lane l of reame_q0_sums16's result, and as byte offsets (blocks of xs bytes)
static const int reame_q0_lane_block[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
static inline __m512i reame_q0_lane_offsets(size_t xs) {
    return _mm512_mullo_epi32(_mm512_loadu_si512(reame_q0_lane_block), _mm512_set1_epi32((int) xs));
}
// a token's per-call tables, in reame_q0_sums16's lane order, 16 lanes a group of 16 blocks
// (zeros past nb): dy, its block scales; sy, 128 x its block sums
static void reame_q0_token_tables(int nb, const block_q8_0 * y, float * dy, int32_t * sy) {
    for (int g = 0; g < (nb + 15) / 16; ++g) {
        const int i0 = 16 * g, np = nb - i0 >= 16 ? 8 : (nb - i0) / 2;
        __m512i R[8];
        for (int j = 0; j < 8; ++j)
            R[j] = j < np ? REAME_DPBUSD512(_mm512_set1_epi8(1), reame_q0_tok(y, i0 + 2 * j)) : _mm512_setzero_si512();
        _mm512_storeu_si512(sy + 16 * g, _mm512_slli_epi32(reame_q0_sums16(R), 7));
        for (int l = 0; l < 16; ++l) {
            const int p = reame_q0_lane_block[l];
            dy[16 * g + l] = i0 + p < nb ? GGML_CPU_FP16_TO_FP32(y[i0 + p].d) : 0.0f;
        }
    }
}
// the four accumulators (128-bit lanes e = block index / 4 mod 4) summed as reame_q0_canon does
static inline float reame_q0_total(__m128 a) {
    const __m128 h = _mm_add_ps(a, _mm_movehl_ps(a, a));  // a0 + a2, a1 + a3
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
// nc (1..REAME_COLS) tokens against one weight row of nb blocks (nb even); dy, sy: the
// tokens' tables (reame_q0_token_tables), ng16 floats / ints a token
static inline __attribute__((always_inline)) void reame_q0_512_cols(
        int nb, const void * vx, const int q5, const block_q8_0 * y0, size_t by, const float * dy, const int32_t * sy,
        size_t ng16, float * s, size_t bs, const int nc) {
    const size_t xs = q5 ? sizeof(block_q5_0) : sizeof(block_q8_0);
    const __m512i offs = reame_q0_lane_offsets(xs);
    __m128 acc[REAME_COLS];
    for (int c = 0; c < nc; ++c) acc[c] = _mm_setzero_ps();
    for (int i0 = 0; i0 < nb; i0 += 16) {
        const int np = nb - i0 >= 16 ? 8 : (nb - i0) / 2;
        // the lanes whose blocks are in the row (the others get S = 0, dx = 0 and dy = 0, and add
        // +0 to an accumulator, which changes none: it is never -0, the products being far
        // above float's smallest)
        const __mmask16 live = _mm512_cmplt_epi32_mask(offs, _mm512_set1_epi32((int) ((nb - i0) * xs)));
        __m512i w[8];
        for (int j = 0; j < 8; ++j) {
            for (int o = 0; o < (int) (2 * xs); o += 64) _mm_prefetch((const char *) vx + (i0 + 2 * j + REAME_PREFETCH) * xs + o, _MM_HINT_T0);
            w[j] = j < np ? reame_q0_pair(vx, i0 + 2 * j, q5) : _mm512_setzero_si512();
        }
        const __m512i dh = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, offs, (const char *) vx + i0 * xs, 1);
        const __m512 dx = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh));
        for (int c = 0; c < nc; ++c) {
            const block_q8_0 * y = (const block_q8_0 *) ((const char *) y0 + c*by);
            __m512i R[8];
            for (int j = 0; j < 8; ++j) R[j] = j < np ? REAME_DPBUSD512(w[j], reame_q0_tok(y, i0 + 2 * j)) : _mm512_setzero_si512();
            const size_t g = (size_t) c * ng16 + i0;
            const __m512i S = _mm512_sub_epi32(reame_q0_sums16(R), _mm512_loadu_si512(sy + g));
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(S), dx);
            const float * d = dy + g;
            // quarter k: blocks 4e + k for e = 0..3, into accumulator e
            acc[c] = _mm_fmadd_ps(_mm512_castps512_ps128(t), _mm_loadu_ps(d), acc[c]);
            acc[c] = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 1), _mm_loadu_ps(d + 4), acc[c]);
            acc[c] = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 2), _mm_loadu_ps(d + 8), acc[c]);
            acc[c] = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 3), _mm_loadu_ps(d + 12), acc[c]);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = reame_q0_total(acc[c]);
}
// up to 16 tokens share a pass over the rows (a row stays in L1 for their groups of REAME_COLS)
static void reame_q0_512_rows(int q5, int n, int nr, int nc, float * s, size_t bs, const char * vx, size_t bx,
                              const char * vy, size_t by) {
    const int nb = n / QK8_0;
    const size_t ng16 = (size_t) (nb + 15) / 16 * 16;
    for (int cs = 0; cs < nc; cs += 16) {
        const int ms = nc - cs < 16 ? nc - cs : 16;
        float dy[16 * ng16];
        int32_t sy[16 * ng16];
        for (int c = 0; c < ms; ++c)
            reame_q0_token_tables(nb, (const block_q8_0 *) (vy + (cs + c)*by), dy + c*ng16, sy + c*ng16);
        for (int r = 0; r < nr; ++r) {
            const char * xr = vx + r*bx;
            for (int c0 = 0; c0 < ms; c0 += REAME_COLS) {
                const block_q8_0 * y = (const block_q8_0 *) (vy + (cs + c0)*by);
                const float * d = dy + c0*ng16;
                const int32_t * sc = sy + c0*ng16;
                float * sr = s + r + (cs + c0)*bs;
                if (q5) REAME_COLS_DISPATCH(ms - c0, reame_q0_512_cols, nb, xr, 1, y, by, d, sc, ng16, sr, bs);
                else REAME_COLS_DISPATCH(ms - c0, reame_q0_512_cols, nb, xr, 0, y, by, d, sc, ng16, sr, bs);
            }
        }
    }
}
void reame_mm_q8_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    reame_q0_512_rows(0, n, nr, nc, s, bs, vx, bx, vy, by);
}
void reame_mm_q5_0_q8_0_512(int n, int nr, int nc, float * s, size_t bs, const void * vx, size_t bx, const void * vy, size_t by) {
    reame_q0_512_rows(1, n, nr, nc, s, bs, vx, bx, vy, by);
}
#endif // reame AVX-512
