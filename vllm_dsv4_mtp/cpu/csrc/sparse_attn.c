/* DeepSeek-V4's sparse_attn(q, kv, sink, topk_idxs, scale) on CPU: each query attends to the rows of kv that
 * its own index list names (-1: no key), read in place (kv is the paged cache's piece table).
 *
 * For query t and head h, over the keys j with topk_idxs[t, j] >= 0, with the latent as key and value:
 *
 *     o = sum_j exp(l_j) k_j / (sum_j exp(l_j) + exp(sink_h)),   l_j = scale * q . k_j
 *
 * Rows are float32 or bfloat16 (widened exactly); scores, probabilities and sums are float32 and the output is
 * rounded once (bfloat16: to nearest even). Built and called by vllm_dsv4_mtp/cpu/sparse_attn.py, which
 * states the arguments' shapes. Returns 0, or 1 (out of memory), 2 (an index outside kv), 3 (a head size
 * this file does not take).
 *
 * It includes no header and links no library but OpenMP's (the compiler's own type macros; malloc, free and
 * memset come from the process that loads it), so a compiler alone builds it: no C library headers or start
 * files (a slim image's gcc without libc6-dev will do).
 */
typedef __INT64_TYPE__ int64_t;
typedef __INT32_TYPE__ int32_t;
typedef __UINT32_TYPE__ uint32_t;
typedef __UINT16_TYPE__ uint16_t;
typedef __UINT8_TYPE__ uint8_t;
void *malloc(__SIZE_TYPE__ size);
void free(void *ptr);

#define VL 16                 /* floats per vector */
#define MAX_NV 32             /* head sizes up to 512 */
typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vf_u __attribute__((vector_size(VL * 4), aligned(4)));
typedef uint16_t vh_u __attribute__((vector_size(VL * 2), aligned(2)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

/* channels 16 i .. 16 i + 15 of a row, as float32 */
static inline vf load16(const char *row, int bf16, int i) {
    if (bf16) return (vf)(__builtin_convertvector(*(const vh_u *)(row + 2 * VL * i), vu) << 16);
    return *(const vf_u *)(row + 4 * VL * i);
}

static inline float hsum(vf v) {
    vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
          + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* max(a, b) that keeps a NaN a (the comparison is false for it) */
static inline vf vmax(vf a, vf b) {
    vi m = a < b;
    return (vf)(((vi)b & m) | ((vi)a & ~m));
}

/* e^x for x <= 0, NaN kept: 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2 (ln 2 in two parts, so r is exact
 * to float32), e^r by its Taylor series to degree 7 (truncation under 6e-9 relative); 2^n as two normal factors
 * so that n down to -150 (x >= -104, where e^x is below float32's range) needs no special case */
static inline vf vexp(vf x) {
    x = vmax(x, (vf){0} - 104.f);
    vi ni = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* truncation: round to nearest for x <= 0 */
    vf n = __builtin_convertvector(ni, vf);
    vf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    vi h = ni >> 1;
    return p * (vf)((h + 127) << 23) * (vf)((ni - h + 127) << 23);
}

static inline uint16_t to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

typedef struct {
    const char *q, *pieces;
    int64_t q_stride, row_bytes;
    int bf16, H, d, K;
    const int64_t *idx;
    const float *sink;
    float scale;
    char *out;
} Args;

typedef struct { const char **rows; float *p, *denom; vf_u *qv; } Scratch;

/* one query row: its visible keys' rows, the scores of every head (four heads per pass over the keys), the
 * probabilities with the sink in the denominator, then the values (two heads per pass) */
static void attend_row(const Args *a, Scratch *w, int64_t bs) {
    const int nv = a->d / VL, H = a->H, ld = ((a->K + VL - 1) / VL) * VL;
    const char **rows = w->rows;
    float *p = w->p;
    vf_u *qv = w->qv;
    int n = 0;
    for (int j = 0; j < a->K; j++)
        if (a->idx[bs * a->K + j] >= 0) rows[n++] = a->pieces + a->idx[bs * a->K + j] * a->row_bytes;
    const char *qrow = a->q + bs * a->q_stride * (a->bf16 ? 2 : 4);
    for (int h = 0; h < H; h++)
        for (int i = 0; i < nv; i++) qv[h * nv + i] = load16(qrow + h * a->row_bytes, a->bf16, i) * a->scale;
    for (int h0 = 0; h0 < H; h0 += 4) {
        const int hn = H - h0 < 4 ? H - h0 : 4;
        const vf_u *q0 = qv + h0 * nv, *q1 = qv + (h0 + (hn > 1 ? 1 : 0)) * nv;
        const vf_u *q2 = qv + (h0 + (hn > 2 ? 2 : 0)) * nv, *q3 = qv + (h0 + (hn > 3 ? 3 : 0)) * nv;
        for (int t = 0; t < n; t++) {
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int i = 0; i < nv; i++) {
                vf kk = load16(rows[t], a->bf16, i);
                a0 += q0[i] * kk;
                a1 += q1[i] * kk;
                a2 += q2[i] * kk;
                a3 += q3[i] * kk;
            }
            float four[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            for (int hh = 0; hh < hn; hh++) p[(h0 + hh) * ld + t] = four[hh];
        }
    }
    for (int h = 0; h < H; h++) {
        float *ph = p + h * ld, m = a->sink[h];
        for (int t = 0; t < n; t++) m = ph[t] > m ? ph[t] : m;
        for (int t = n; t < ld; t++) ph[t] = -1e30f; /* the last vector's spare lanes: e^x = 0 */
        vf l = {0};
        for (int t = 0; t < n; t += VL) {
            vf e = vexp(*(vf_u *)(ph + t) - m);
            *(vf_u *)(ph + t) = e;
            l += e;
        }
        w->denom[h] = hsum(l) + vexp((vf){0} + (a->sink[h] - m))[0];
    }
    for (int h0 = 0; h0 < H; h0 += 2) {
        const int two = h0 + 1 < H;
        vf o0[MAX_NV], o1[MAX_NV];
        for (int i = 0; i < nv; i++) o0[i] = o1[i] = (vf){0};
        const float *p0 = p + h0 * ld, *p1 = p + (two ? h0 + 1 : h0) * ld;
        for (int t = 0; t < n; t++) {
            const float w0 = p0[t], w1 = p1[t];
            for (int i = 0; i < nv; i++) {
                vf kk = load16(rows[t], a->bf16, i);
                o0[i] += w0 * kk;
                o1[i] += w1 * kk;
            }
        }
        for (int hh = 0; hh <= two; hh++) {
            const float r = 1.f / w->denom[h0 + hh];
            const vf *o = hh ? o1 : o0;
            char *dst = a->out + (bs * H + h0 + hh) * a->row_bytes;
            for (int i = 0; i < nv; i++) {
                vf v = o[i] * r;
                if (a->bf16)
                    for (int c = 0; c < VL; c++) ((uint16_t *)dst)[i * VL + c] = to_bf16(v[c]);
                else
                    *(vf_u *)(dst + 4 * VL * i) = v;
            }
        }
    }
}

/* q: query t at q + t q_stride elements, its heads d apart; kv: n_kv rows of d; topk_idxs [T, K] (-1: no
 * key); sink [H]; out [T, H, d] contiguous; bf16: kv, q and out are bfloat16, else float32 */
int dsv4_sparse_attn(const void *q, int64_t q_stride, const void *kv, int64_t n_kv, int bf16, int T, int H, int d,
                     const int64_t *topk_idxs, int K, const float *sink, float scale, void *out) {
    if (d % VL || d / VL > MAX_NV || H < 1) return 3;
    for (int64_t i = 0; i < (int64_t)T * K; i++)
        if (topk_idxs[i] < -1 || topk_idxs[i] >= n_kv) return 2;
    const Args a = {(const char *)q, (const char *)kv, q_stride, (int64_t)d * (bf16 ? 2 : 4), bf16, H, d, K,
                    topk_idxs, sink, scale, (char *)out};
    const int ld = ((K + VL - 1) / VL) * VL;
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        Scratch w = {malloc(sizeof(char *) * (__SIZE_TYPE__)(K + 1)), malloc(sizeof(float) * (__SIZE_TYPE__)H * ld),
                     malloc(sizeof(float) * (__SIZE_TYPE__)H), malloc(sizeof(vf) * (__SIZE_TYPE__)H * (d / VL))};
        failed = !w.rows || !w.p || !w.denom || !w.qv;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < (int64_t)T; t++)
            if (!failed) attend_row(&a, &w, t);
        free(w.rows);
        free(w.p);
        free(w.denom);
        free(w.qv);
    }
    return failed ? 1 : 0;
}
