/* Affine instance norm followed by the exact (erf) GELU, forward and backward, for float32
 * channels_last activations viewed as (B, N, C) rows: one pass over the field for the
 * statistics and one for the output (two and two in backward), where eager PyTorch makes
 * about ten. Built and loaded by diffnet/kernels/__init__.py.
 *
 * Sums are taken over fixed blocks of ROWS rows in double and then added block by block in
 * order, so the result does not depend on the number of threads. The forward's erf is a
 * rational function (no exp); the backward's is the Abramowitz-Stegun 7.1.26 form ATen's
 * vectorised GELU uses (|error| < 1.5e-7), which shares one exp(-z^2 / 2) with the derivative.
 * Both agree with erf to float32 rounding, so the backward is that of the forward.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 256

/* exp(x) for x <= 0 (Cephes' single-precision polynomial, ~1 ulp), branch-free and without a
 * float-to-int conversion so that gcc vectorises it. Below -87 it returns exp(-87) ~ 1.6e-38
 * instead of underflowing further. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* n = x log2(e) rounded to nearest: adding 1.5 * 2^23 leaves n in the low mantissa bits */
    const float shifted = x * 1.44269504088896341f + 12582912.0f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    const float n = shifted - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    bits = (bits - 0x4B400000 + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* 0.5 * (1 + erf(z / sqrt 2)) given e = exp(-z^2 / 2). */
static inline float gelu_cdf(float z, float e) {
    const float u = fabsf(z) * 0.70710678118654752f;
    const float t = 1.0f / (1.0f + 0.3275911f * u);
    float p = 1.061405429f;
    p = p * t - 1.453152027f;
    p = p * t + 1.421413741f;
    p = p * t - 0.284496736f;
    p = p * t + 0.254829592f;
    const float erf_abs = 1.0f - p * t * e;
    return 0.5f + 0.5f * copysignf(erf_abs, z);
}


/* erf(x) as Eigen's rational approximation on [-4, 4] (a few ulp; |x| > 4 gives +-1). */
static inline float erf_rational(float x) {
    x = x < -4.0f ? -4.0f : x;
    x = x > 4.0f ? 4.0f : x;
    const float x2 = x * x;
    float p = -2.72614225801306e-10f;
    p = p * x2 + 2.77068142495902e-08f;
    p = p * x2 - 2.10102402082508e-06f;
    p = p * x2 - 5.69250639462346e-05f;
    p = p * x2 - 7.34990630326855e-04f;
    p = p * x2 - 2.95459980854025e-03f;
    p = p * x2 - 1.60960333262415e-02f;
    float q = -1.45660718464996e-05f;
    q = q * x2 - 2.13374055278905e-04f;
    q = q * x2 - 1.68282697438203e-03f;
    q = q * x2 - 7.37332916720468e-03f;
    q = q * x2 - 1.42647390514189e-02f;
    return x * p / q;
}

static int64_t blocks_of(int64_t n) { return (n + ROWS - 1) / ROWS; }

/* One past the last row of block k. */
static int64_t block_end(int64_t k, int64_t n) { return (k + 1) * ROWS < n ? (k + 1) * ROWS : n; }

/* Sample b's totals over its nb blocks of the two per-block sums of channel c (part holds, per
 * (sample, block), C first sums then C second sums), added in block order. */
static void block_totals(const double *part, int64_t b, int64_t nb, int64_t C, int64_t c,
                         double *first, double *second) {
    double s1 = 0.0, s2 = 0.0;
    for (int64_t k = 0; k < nb; k++) {
        s1 += part[(b * nb + k) * 2 * C + c];
        s2 += part[(b * nb + k) * 2 * C + C + c];
    }
    *first = s1;
    *second = s2;
}

/* Per (sample, block): sums of (x - shift) and (x - shift)^2 over the block's rows, shift =
 * the sample's first row. */
static void moments(const float *x, int64_t B, int64_t N, int64_t C, double *part, int nt) {
    const int64_t nb = blocks_of(N);
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t task = 0; task < B * nb; task++) {
        const int64_t b = task / nb, k = task % nb;
        const float *xs = x + b * N * C, *shift = xs;
        double *s1 = part + task * 2 * C, *s2 = s1 + C;
        memset(s1, 0, 2 * C * sizeof(double));
        const int64_t end = block_end(k, N);
        for (int64_t i = k * ROWS; i < end; i++) {
            const float *row = xs + i * C;
            for (int64_t c = 0; c < C; c++) {
                const double d = (double)row[c] - (double)shift[c];
                s1[c] += d;
                s2[c] += d * d;
            }
        }
    }
}

/* y = gelu((x - mean) * a + bias) with a = weight * rstd, per (sample, channel). The mean is
 * kept as shift + m1 (shift: the sample's first row, m1 small) and x - mean taken as
 * (x - shift) - m1, so a mean far from zero does not cancel in float32. Writes m1 and rstd
 * (B, C) for the backward. */
int norm_gelu_forward(const float *x, const float *weight, const float *bias, float eps,
                      int64_t B, int64_t N, int64_t C, float *y, float *m1, float *rstd,
                      int nt) {
    const int64_t nb = blocks_of(N);
    double *part = malloc((size_t)(B * nb * 2 * C) * sizeof(double));
    float *coef = malloc((size_t)(B * 2 * C) * sizeof(float));
    if (!part || !coef) { free(part); free(coef); return 1; }
    moments(x, B, N, C, part, nt);
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++) {
            double s1, s2;
            block_totals(part, b, nb, C, c, &s1, &s2);
            const double d = s1 / N, var = fmax(s2 / N - d * d, 0.0);
            const double r = 1.0 / sqrt(var + eps);
            m1[b * C + c] = (float)d;
            rstd[b * C + c] = (float)r;
            coef[b * 2 * C + c] = (float)(weight[c] * r);
        }
    free(part);
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t task = 0; task < B * nb; task++) {
        const int64_t b = task / nb, k = task % nb;
        const float *a = coef + b * 2 * C, *shift = x + b * N * C, *mu = m1 + b * C;
        const int64_t end = block_end(k, N);
        for (int64_t i = k * ROWS; i < end; i++) {
            const float *row = x + (b * N + i) * C;
            float *out = y + (b * N + i) * C;
            #pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                const float z = ((row[c] - shift[c]) - mu[c]) * a[c] + bias[c];
                out[c] = 0.5f * z * (1.0f + erf_rational(z * 0.70710678118654752f));
            }
        }
    }
    free(coef);
    return 0;
}

/* d gelu(z) / dz * g, with z = x * a + o. */
static inline float gelu_grad(float z, float g) {
    const float e = exp_nonpositive(-0.5f * z * z);
    return g * (gelu_cdf(z, e) + z * e * 0.3989422804014327f);
}

/* The backward of norm_gelu_forward: gx (may be NULL), gw and gb (C, summed over samples). */
int norm_gelu_backward(const float *x, const float *gy, const float *weight, const float *bias,
                       const float *m1, const float *rstd, int64_t B, int64_t N, int64_t C, float *gx,
                       float *gw, float *gb, int nt) {
    /* gx (when asked for) first holds d gelu / dz * g, the second pass's input */
    const int64_t nb = blocks_of(N);
    double *part = malloc((size_t)(B * nb * 2 * C) * sizeof(double));
    float *coef = malloc((size_t)(B * 4 * C) * sizeof(float));
    if (!part || !coef) { free(part); free(coef); return 1; }
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++) coef[b * 4 * C + c] = weight[c] * rstd[b * C + c];
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t task = 0; task < B * nb; task++) {
        const int64_t b = task / nb, k = task % nb;
        const float *a = coef + b * 4 * C, *shift = x + b * N * C, *mu = m1 + b * C;
        double *sg = part + task * 2 * C, *sgd = sg + C;
        memset(sg, 0, 2 * C * sizeof(double));
        const int64_t end = block_end(k, N);
        for (int64_t i = k * ROWS; i < end; i++) {
            const float *row = x + (b * N + i) * C, *grow = gy + (b * N + i) * C;
            float *gzrow = gx ? gx + (b * N + i) * C : NULL;
            for (int64_t c = 0; c < C; c++) {
                const float d = (row[c] - shift[c]) - mu[c];
                const float gz = gelu_grad(d * a[c] + bias[c], grow[c]);
                if (gzrow) gzrow[c] = gz;
                sg[c] += gz;
                sgd[c] += (double)gz * (double)d;
            }
        }
    }
    for (int64_t c = 0; c < C; c++) {
        double sum_w = 0.0, sum_b = 0.0;
        for (int64_t b = 0; b < B; b++) {
            double sg, sgd;
            block_totals(part, b, nb, C, c, &sg, &sgd);
            const double r = rstd[b * C + c], sgxh = sgd * r, a = weight[c] * r;
            sum_w += sgxh;
            sum_b += sg;
            coef[b * 4 * C + 2 * C + c] = (float)(-a * r * sgxh / N);
            coef[b * 4 * C + 3 * C + c] = (float)(-a * sg / N);
        }
        gw[c] = (float)sum_w;
        gb[c] = (float)sum_b;
    }
    free(part);
    if (!gx) { free(coef); return 0; }
    #pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t task = 0; task < B * nb; task++) {
        const int64_t b = task / nb, k = task % nb;
        const float *a = coef + b * 4 * C, *k1 = a + 2 * C, *k0 = a + 3 * C;
        const float *shift = x + b * N * C, *mu = m1 + b * C;
        const int64_t end = block_end(k, N);
        for (int64_t i = k * ROWS; i < end; i++) {
            const float *row = x + (b * N + i) * C;
            float *out = gx + (b * N + i) * C;
            #pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                out[c] = a[c] * out[c] + k1[c] * ((row[c] - shift[c]) - mu[c]) + k0[c];
            }
        }
    }
    free(coef);
    return 0;
}
