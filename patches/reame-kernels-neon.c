// reame-kernels-neon.c -- multi-token Q4_K . q8_K and Q6_K . q8_K dot products for ggml's
// ARM (aarch64 NEON + dotprod) CPU backend (part of build_llama.sh's patches for aarch64;
// see patches/multi-token-kernels-neon.diff).
//
// Not a translation unit of its own: build_llama.sh copies this file to
// ggml/src/ggml-cpu/arch/arm/ and the diff #includes it at the end of quants.c there, so it
// is compiled with that file's flags and uses its includes and block types. ggml-cpu.c
// (same diff) calls the kernels for Q4_K/Q6_K matmuls of one 2-D weight and 2+ tokens.
//
// Each kernel computes, for the columns c < nc (nc <= REAME_NEON_MC_MAX, 16), s[c*bs] =
// (weight row vx) . (q8_K row at vy + c*by), n values (a multiple of QK_K). Each weight
// block is loaded and unpacked once (scales, nibbles, 6-bit values) for all nc columns.
// Each column's result is bit-identical to ggml_vec_dot_{q4,q6}_K_q8_K's NEON path for
// that column alone: the integer sums of a block are exact in int32 whatever order they
// are added in (|sum| < 2^26), and the float steps that follow are the one-row kernel's,
// written the same way in the same order (so the compiler contracts them the same way).
// patches/test_kernels_neon.c checks that on random blocks (arm_check.sh runs it under
// qemu-aarch64).

#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD) && !defined(__ARM_FEATURE_SVE)
#include <arm_neon.h>

void reame_vec_dot_q4_K_q8_K_neon(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);
void reame_vec_dot_q6_K_q8_K_neon(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by);

#define REAME_NEON_MC_MAX 16

void reame_vec_dot_q4_K_q8_K_neon(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    static const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    const block_q4_K * GGML_RESTRICT x = vx;
    const int nb = n / QK_K;
    const uint8x16_t m4b = vdupq_n_u8(0xf);
    float sumf[REAME_NEON_MC_MAX];
    for (int c = 0; c < nc; ++c) sumf[c] = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        const float dminx = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        // the 8 scales and 8 mins, decoded as ggml's one-row kernel does
        uint32_t utmp[4];
        memcpy(utmp, x[i].scales, 12);
        utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
        const uint32_t uaux = utmp[1] & kmask1;
        utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
        utmp[2] = uaux;
        utmp[0] &= kmask1;
        const uint8x16_t sm8 = vreinterpretq_u8_u32(vld1q_u32(utmp));  // scales 0-7, mins 8-15
        const int16x8_t mins = vreinterpretq_s16_u16(vmovl_high_u8(sm8));
        const uint16x8_t sc16 = vmovl_u8(vget_low_u8(sm8));
        const int32x4_t sc_lo = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(sc16)));   // chunks 0-3
        const int32x4_t sc_hi = vreinterpretq_s32_u32(vmovl_high_u16(sc16));            // chunks 4-7
        // 8 chunks of 32 values (2 vectors each): chunk 2j = low nibbles of qs[32j..], 2j+1 = high
        int8x16_t w[16];
        for (int j = 0; j < 4; ++j) {
            const uint8x16x2_t q4bits = vld1q_u8_x2(x[i].qs + 32*j);
            w[4*j+0] = vreinterpretq_s8_u8(vandq_u8(q4bits.val[0], m4b));
            w[4*j+1] = vreinterpretq_s8_u8(vandq_u8(q4bits.val[1], m4b));
            w[4*j+2] = vreinterpretq_s8_u8(vshrq_n_u8(q4bits.val[0], 4));
            w[4*j+3] = vreinterpretq_s8_u8(vshrq_n_u8(q4bits.val[1], 4));
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) ((const char *) vy + c*by) + i;
            const float d = y->d * dx;
            const float dmin = y->d * dminx;
            // mins . (pairwise sums of bsums): ggml's prod, summed exactly
            const int16x8_t q8sums = vpaddq_s16(vld1q_s16(y->bsums), vld1q_s16(y->bsums + 8));
            const int32x4_t prod = vmlal_high_s16(vmull_s16(vget_low_s16(q8sums), vget_low_s16(mins)), q8sums, mins);
            sumf[c] -= dmin * vaddvq_s32(prod);
            const int8x16x4_t q8a = vld1q_s8_x4(y->qs);         // chunks 0, 1
            const int8x16x4_t q8b = vld1q_s8_x4(y->qs + 64);    // chunks 2, 3
            const int8x16x4_t q8c = vld1q_s8_x4(y->qs + 128);   // chunks 4, 5
            const int8x16x4_t q8d = vld1q_s8_x4(y->qs + 192);   // chunks 6, 7
            // chunk k's 32 products in 4 lanes, then its sum times its scale (pairwise adds
            // gather chunks 0-3 and 4-7 into one vector each)
            const int32x4_t z = vdupq_n_s32(0);
            const int32x4_t p0 = vdotq_s32(vdotq_s32(z, w[0], q8a.val[0]), w[1], q8a.val[1]);
            const int32x4_t p1 = vdotq_s32(vdotq_s32(z, w[2], q8a.val[2]), w[3], q8a.val[3]);
            const int32x4_t p2 = vdotq_s32(vdotq_s32(z, w[4], q8b.val[0]), w[5], q8b.val[1]);
            const int32x4_t p3 = vdotq_s32(vdotq_s32(z, w[6], q8b.val[2]), w[7], q8b.val[3]);
            const int32x4_t s03 = vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3));
            const int32x4_t p4 = vdotq_s32(vdotq_s32(z, w[8], q8c.val[0]), w[9], q8c.val[1]);
            const int32x4_t p5 = vdotq_s32(vdotq_s32(z, w[10], q8c.val[2]), w[11], q8c.val[3]);
            const int32x4_t p6 = vdotq_s32(vdotq_s32(z, w[12], q8d.val[0]), w[13], q8d.val[1]);
            const int32x4_t p7 = vdotq_s32(vdotq_s32(z, w[14], q8d.val[2]), w[15], q8d.val[3]);
            const int32x4_t s47 = vpaddq_s32(vpaddq_s32(p4, p5), vpaddq_s32(p6, p7));
            const int32_t sumi = vaddvq_s32(vmlaq_s32(vmulq_s32(s03, sc_lo), s47, sc_hi));  // ggml's sumi1 + sumi2
            sumf[c] += d * sumi;
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = sumf[c];
}

void reame_vec_dot_q6_K_q8_K_neon(int n, int nc, float * s, size_t bs, const void * vx, const void * vy, size_t by) {
    const block_q6_K * GGML_RESTRICT x = vx;
    const int nb = n / QK_K;
    const uint8x16_t m4b = vdupq_n_u8(0xF);
    const uint8x16_t mone = vdupq_n_u8(3);
    float sum[REAME_NEON_MC_MAX];
    for (int c = 0; c < nc; ++c) sum[c] = 0.0f;
    for (int i = 0; i < nb; ++i) {
        const float d_all = GGML_CPU_FP16_TO_FP32(x[i].d);
        const int8x16_t scales = vld1q_s8(x[i].scales);
        const int16x8_t sc16_lo = vmovl_s8(vget_low_s8(scales));
        const int16x8_t sc16_hi = vmovl_high_s8(scales);
        int32x4_t sc[4];  // the 16 scales as int32, 4 per vector
        sc[0] = vmovl_s16(vget_low_s16(sc16_lo));
        sc[1] = vmovl_high_s16(sc16_lo);
        sc[2] = vmovl_s16(vget_low_s16(sc16_hi));
        sc[3] = vmovl_high_s16(sc16_hi);
        // 16 chunks of 16 values (6-bit, stored +32), unpacked as ggml's one-row kernel does;
        // chunk k goes with scale k and q8 values 16k..16k+15
        int8x16_t w[16];
        for (int j = 0; j < 2; ++j) {
            const uint8x16x2_t qhbits = vld1q_u8_x2(x[i].qh + 32*j);
            const uint8x16x4_t q6bits = vld1q_u8_x4(x[i].ql + 64*j);
            w[8*j+0] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q6bits.val[0], m4b), vshlq_n_u8(vandq_u8(mone, qhbits.val[0]), 4)));
            w[8*j+1] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q6bits.val[1], m4b), vshlq_n_u8(vandq_u8(mone, qhbits.val[1]), 4)));
            w[8*j+2] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q6bits.val[2], m4b), vshlq_n_u8(vandq_u8(mone, vshrq_n_u8(qhbits.val[0], 2)), 4)));
            w[8*j+3] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q6bits.val[3], m4b), vshlq_n_u8(vandq_u8(mone, vshrq_n_u8(qhbits.val[1], 2)), 4)));
            w[8*j+4] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q6bits.val[0], 4), vshlq_n_u8(vandq_u8(mone, vshrq_n_u8(qhbits.val[0], 4)), 4)));
            w[8*j+5] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q6bits.val[1], 4), vshlq_n_u8(vandq_u8(mone, vshrq_n_u8(qhbits.val[1], 4)), 4)));
            w[8*j+6] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q6bits.val[2], 4), vshlq_n_u8(vshrq_n_u8(qhbits.val[0], 6), 4)));
            w[8*j+7] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(q6bits.val[3], 4), vshlq_n_u8(vshrq_n_u8(qhbits.val[1], 6), 4)));
        }
        for (int c = 0; c < nc; ++c) {
            const block_q8_K * GGML_RESTRICT y = (const block_q8_K *) ((const char *) vy + c*by) + i;
            // scales . bsums: ggml's isum_mins, summed exactly
            const int16x8x2_t q8sums = vld1q_s16_x2(y->bsums);
            int32x4_t prod = vmull_s16(vget_low_s16(q8sums.val[0]), vget_low_s16(sc16_lo));
            prod = vmlal_high_s16(prod, q8sums.val[0], sc16_lo);
            prod = vmlal_s16(prod, vget_low_s16(q8sums.val[1]), vget_low_s16(sc16_hi));
            prod = vmlal_high_s16(prod, q8sums.val[1], sc16_hi);
            const int32_t isum_mins = vaddvq_s32(prod);
            // chunk k's 16 products in 4 lanes; pairwise adds gather the sums of chunks
            // 4h .. 4h+3 into one vector, times scales 4h .. 4h+3
            const int32x4_t z = vdupq_n_s32(0);
            int32x4_t acc = z;
            for (int h = 0; h < 4; ++h) {  // 64 q8 values: chunks 4h .. 4h+3
                const int8x16x4_t q8 = vld1q_s8_x4(y->qs + 64*h);
                const int32x4_t p0 = vdotq_s32(z, w[4*h+0], q8.val[0]);
                const int32x4_t p1 = vdotq_s32(z, w[4*h+1], q8.val[1]);
                const int32x4_t p2 = vdotq_s32(z, w[4*h+2], q8.val[2]);
                const int32x4_t p3 = vdotq_s32(z, w[4*h+3], q8.val[3]);
                acc = vmlaq_s32(acc, vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3)), sc[h]);
            }
            const int32_t isum = vaddvq_s32(acc);
            sum[c] += d_all * y->d * (isum - 32 * isum_mins);
        }
    }
    for (int c = 0; c < nc; ++c) s[c*bs] = sum[c];
}
#endif
