/* The W4A4 activation rounding: vllm_dsv4_mtp.formats.mxfp4.fake_quant, bit for bit, as one loop.
 *
 * Per block of 32 values along a row: the E8M0 scale of the block's largest magnitude (the "even" rule: a power
 * of two, 2^-127 .. 2^127), each value divided by it, rounded to the E2M1 grid (spacing s = 0.5 below 2, 1 below
 * 4, 2 up to 6) half to even by (v + C) - C with C = 1.5 s 2^23, saturated at +-6, times the scale. A block with a
 * NaN is NaN. Built and called by vllm_dsv4_mtp/cpu/mxfp4_round.py. Returns 0, or 3 (a row length that is not
 * a multiple of 32). No header, no library (see cpu/compiled.py).
 */
typedef __INT64_TYPE__ int64_t;
typedef __INT32_TYPE__ int32_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT16_TYPE__ uint16_t;

#define BLOCK 32

static inline float from_bits(uint32_t u) { union { uint32_t u; float f; } x; x.u = u; return x.f; }
static inline uint32_t to_bits(float f) { union { uint32_t u; float f; } x; x.f = f; return x.u; }

static inline uint16_t to_bf16(float f) {
    uint32_t u = to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void round_block(const float *restrict v, float *restrict q) {
    float amax = 0.f;
    int nan = 0;
    for (int i = 0; i < BLOCK; i++) {
        float a = from_bits(to_bits(v[i]) & 0x7fffffffu);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    if (nan) {
        for (int i = 0; i < BLOCK; i++) q[i] = from_bits(0x7fc00000u);
        return;
    }
    /* the power of two of bits(amax) + 2^21's binade, times 1/4, within [2^-127, 2^127] */
    float scale = from_bits((to_bits(amax) + (1u << 21)) & 0x7f800000u) * 0.25f;
    scale = scale < 0x1p-127f ? 0x1p-127f : scale;
    scale = scale > 0x1p127f ? 0x1p127f : scale;
    for (int i = 0; i < BLOCK; i++) {
        float x = v[i] / scale;
        int32_t e = (int32_t)(to_bits(x) & 0x7f800000u);
        e = e < (127 << 23) ? (127 << 23) : e;
        e = e > (129 << 23) ? (129 << 23) : e;
        float c = from_bits((uint32_t)e + ((22u << 23) | (1u << 22)));
        float r = (x + c) - c;
        r = r < -6.f ? -6.f : r;
        r = r > 6.f ? 6.f : r;
        q[i] = r * scale;
    }
}

/* x, out: [rows, k] contiguous, k a multiple of 32; bf16: bfloat16, else float32 */
int dsv4_mxfp4_round(const void *x, void *out, int64_t rows, int64_t k, int bf16) {
    if (k % BLOCK) return 3;
    const int64_t blocks = rows * (k / BLOCK);
#pragma omp parallel for schedule(static) if (blocks > 4096)
    for (int64_t b = 0; b < blocks; b++) {
        float v[BLOCK], q[BLOCK];
        if (bf16) {
            const uint16_t *src = (const uint16_t *)x + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) v[i] = from_bits((uint32_t)src[i] << 16);
        } else {
            const float *src = (const float *)x + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) v[i] = src[i];
        }
        round_block(v, q);
        if (bf16) {
            uint16_t *dst = (uint16_t *)out + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) dst[i] = to_bf16(q[i]);
        } else {
            float *dst = (float *)out + b * BLOCK;
            for (int i = 0; i < BLOCK; i++) dst[i] = q[i];
        }
    }
    return 0;
}
