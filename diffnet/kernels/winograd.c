/* 3x3 convolutions with stride 1 and padding 1 by Winograd's F(2x2, 3x3), forward, data
 * gradient and weight gradient, for float32 channels_last fields with channel counts that are
 * multiples of 16 and even sides (the caller checks). Built and loaded by
 * diffnet/kernels/winograd.py.
 *
 * Each 2x2 output tile is y = A^T [ (G g G^T) . (B^T d B) ] A, d its 4x4 input patch and g
 * the 3x3 kernel: 16 multiplications per tile and channel pair where the direct form does 36.
 * The products over the channels are, per patch position p, one matrix product M[p] = V[p]
 * U[p] (tiles x Cin by Cin x Cout), blocked so that a register block of tiles x output
 * channels stays in registers while the input channels stream. The data gradient is the same
 * forward with the kernel rotated and transposed; the weight gradient is the forward's
 * adjoint, G^T (sum over tiles of V[p]^T (A dY A^T)[p]) G.
 *
 * The transforms round differently from the direct sum (the terms are combined before they are
 * multiplied): about 2-4e-7 relative in float32 at these widths, oneDNN's own 1-8e-7. No result
 * depends on the number of threads: the weight gradient's partial sums are fixed by the shape.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One vector register of floats: the code is written in GCC's vector extension at the
 * register's own width (a wider type would be split into several registers by the compiler,
 * and spilled in the register blocks below). */
#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vec __attribute__((vector_size(LANES * 4), aligned(4), may_alias));
#define TILES 48 /* tiles per block: a multiple of every register block's rows */

/* U[p][ci][co] = (G g G^T)[p], G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1], from the kernel
 * g laid out as k[i][j][ci][co] (3, 3, cin, cout): the forward's from w.permute(2, 3, 1, 0),
 * the data gradient's from w.flip(2, 3).permute(2, 3, 0, 1). Vectorised over co. */
void wino_weights(const float *k, int64_t cin, int64_t cout, float *u) {
    const int64_t plane = cin * cout;
    for (int64_t ci = 0; ci < cin; ci++)
        for (int64_t co = 0; co < cout; co += LANES) {
            vec g[3][3], t[4][3];
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++)
                    g[i][j] = *(const vec *)(k + (i * 3 + j) * plane + ci * cout + co);
            for (int j = 0; j < 3; j++) {
                t[0][j] = g[0][j];
                t[1][j] = 0.5f * (g[0][j] + g[1][j] + g[2][j]);
                t[2][j] = 0.5f * (g[0][j] - g[1][j] + g[2][j]);
                t[3][j] = g[2][j];
            }
            for (int i = 0; i < 4; i++) {
                float *o = u + (i * 4) * plane + ci * cout + co;
                *(vec *)(o) = t[i][0];
                *(vec *)(o + plane) = 0.5f * (t[i][0] + t[i][1] + t[i][2]);
                *(vec *)(o + 2 * plane) = 0.5f * (t[i][0] - t[i][1] + t[i][2]);
                *(vec *)(o + 3 * plane) = t[i][2];
            }
        }
}

/* V[p][t][ci] for the tiles first .. first + TILES - 1 (flat index over batch, tile rows, tile
 * columns); tiles past the last are zero. */
static void transform_input(const float *x, int64_t n, int64_t h, int64_t w, int64_t c,
                            int64_t first, float *vb) {
    const int64_t th = h / 2, tw = w / 2, total = n * th * tw;
    const vec zero = {0};
    for (int64_t t = 0; t < TILES; t++) {
        const int64_t tile = first + t;
        if (tile >= total) {
            for (int p = 0; p < 16; p++)
                memset(vb + (p * TILES + t) * c, 0, c * sizeof(float));
            continue;
        }
        const int64_t b = tile / (th * tw), ty = tile / tw % th, tx = tile % tw;
        const float *rows[4];
        int cols[4];
        for (int i = 0; i < 4; i++) {
            const int64_t y = 2 * ty - 1 + i, xx = 2 * tx - 1 + i;
            rows[i] = (y >= 0 && y < h) ? x + ((b * h + y) * w) * c : NULL;
            cols[i] = xx >= 0 && xx < w;
        }
        for (int64_t k = 0; k < c; k += LANES) {
            vec d[4][4], e[4][4];
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++)
                    d[i][j] = rows[i] && cols[j]
                                  ? *(const vec *)(rows[i] + (2 * tx - 1 + j) * c + k) : zero;
            for (int j = 0; j < 4; j++) {
                e[0][j] = d[0][j] - d[2][j];
                e[1][j] = d[1][j] + d[2][j];
                e[2][j] = d[2][j] - d[1][j];
                e[3][j] = d[1][j] - d[3][j];
            }
            for (int i = 0; i < 4; i++) {
                float *o = vb + ((i * 4) * TILES + t) * c + k;
                const int64_t step = TILES * c;
                *(vec *)(o) = e[i][0] - e[i][2];
                *(vec *)(o + step) = e[i][1] + e[i][2];
                *(vec *)(o + 2 * step) = e[i][2] - e[i][1];
                *(vec *)(o + 3 * step) = e[i][1] - e[i][3];
            }
        }
    }
}

/* M[t][co] = sum_ci V[t][ci] U[ci][co] for one position: R tiles x NV vectors in registers. */
#define GEMM_BLOCK(R, NV)                                                                   \
    static void gemm_##R##_##NV(const float *v, const float *u, float *m, int64_t cin,     \
                                int64_t cout) {                                            \
        for (int64_t co = 0; co < cout; co += NV * LANES)                                  \
            for (int64_t t = 0; t < TILES; t += R) {                                       \
                vec acc[R][NV];                                                            \
                for (int r = 0; r < R; r++)                                                \
                    for (int q = 0; q < NV; q++)                                           \
                        acc[r][q] = (vec){0};                                              \
                for (int64_t ci = 0; ci < cin; ci++) {                                     \
                    vec b[NV];                                                             \
                    for (int q = 0; q < NV; q++)                                           \
                        b[q] = *(const vec *)(u + ci * cout + co + q * LANES);             \
                    for (int r = 0; r < R; r++) {                                          \
                        const float a = v[(t + r) * cin + ci];                             \
                        for (int q = 0; q < NV; q++)                                       \
                            acc[r][q] += a * b[q];                                         \
                    }                                                                      \
                }                                                                          \
                for (int r = 0; r < R; r++)                                                \
                    for (int q = 0; q < NV; q++)                                           \
                        *(vec *)(m + (t + r) * cout + co + q * LANES) = acc[r][q];         \
            }                                                                              \
    }
/* Register blocks: AVX-512 has 32 vector registers, AVX2 and SSE 16, so the blocks of
 * accumulators (rows x vectors) are smaller there. TILES is a multiple of every block's rows. */
#ifdef __AVX512F__
GEMM_BLOCK(16, 1)
GEMM_BLOCK(12, 2)
GEMM_BLOCK(6, 4)

static void gemm(const float *v, const float *u, float *m, int64_t cin, int64_t cout) {
    if (cout % (4 * LANES) == 0)
        gemm_6_4(v, u, m, cin, cout);
    else if (cout % (2 * LANES) == 0)
        gemm_12_2(v, u, m, cin, cout);
    else
        gemm_16_1(v, u, m, cin, cout);
}
#else
GEMM_BLOCK(6, 2) /* channels are multiples of 16, so of 2 * LANES */

static void gemm(const float *v, const float *u, float *m, int64_t cin, int64_t cout) {
    gemm_6_2(v, u, m, cin, cout);
}
#endif

/* y tiles from M[p][t][co]: A^T M A with A^T = [1 1 1 0; 0 1 -1 -1], plus the bias. */
static void transform_output(const float *mb, const float *bias, int64_t n, int64_t h,
                             int64_t w, int64_t c, int64_t first, float *y) {
    const int64_t th = h / 2, tw = w / 2, total = n * th * tw;
    for (int64_t t = 0; t < TILES && first + t < total; t++) {
        const int64_t tile = first + t;
        const int64_t b = tile / (th * tw), ty = tile / tw % th, tx = tile % tw;
        float *o = y + ((b * h + 2 * ty) * w + 2 * tx) * c;
        for (int64_t k = 0; k < c; k += LANES) {
            vec m[4][4], e[2][4];
            for (int p = 0; p < 16; p++)
                m[p / 4][p % 4] = *(const vec *)(mb + (p * TILES + t) * c + k);
            for (int j = 0; j < 4; j++) {
                e[0][j] = m[0][j] + m[1][j] + m[2][j];
                e[1][j] = m[1][j] - m[2][j] - m[3][j];
            }
            const vec bb = bias ? *(const vec *)(bias + k) : (vec){0};
            for (int i = 0; i < 2; i++) {
                *(vec *)(o + i * w * c + k) = e[i][0] + e[i][1] + e[i][2] + bb;
                *(vec *)(o + (i * w + 1) * c + k) = e[i][1] - e[i][2] - e[i][3] + bb;
            }
        }
    }
}

/* x (n, h, w, cin) -> y (n, h, w, cout) with U from wino_weights. Returns 0, or 1 when the
 * scratch cannot be allocated. */
int wino_forward(const float *x, const float *u, const float *bias, int64_t n, int64_t h,
                 int64_t w, int64_t cin, int64_t cout, float *y, int threads) {
    const int64_t total = n * (h / 2) * (w / 2), blocks = (total + TILES - 1) / TILES;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *vb = aligned_alloc(64, 16 * TILES * cin * sizeof(float));
        float *mb = aligned_alloc(64, 16 * TILES * cout * sizeof(float));
        if (!vb || !mb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < blocks; blk++) {
                transform_input(x, n, h, w, cin, blk * TILES, vb);
                for (int p = 0; p < 16; p++)
                    gemm(vb + p * TILES * cin, u + p * cin * cout, mb + p * TILES * cout, cin,
                         cout);
                transform_output(mb, bias, n, h, w, cout, blk * TILES, y);
            }
        }
        free(vb);
        free(mb);
    }
    return failed;
}

/* G[p][t][co] = (A g A^T)[p] for each tile's 2x2 output gradient g, A = [1 0; 1 1; 1 -1; 0 -1]:
 * the output transform's adjoint. */
static void transform_grad(const float *g, int64_t n, int64_t h, int64_t w, int64_t c,
                           int64_t first, float *gb) {
    const int64_t th = h / 2, tw = w / 2, total = n * th * tw;
    for (int64_t t = 0; t < TILES; t++) {
        const int64_t tile = first + t;
        if (tile >= total) {
            for (int p = 0; p < 16; p++)
                memset(gb + (p * TILES + t) * c, 0, c * sizeof(float));
            continue;
        }
        const int64_t b = tile / (th * tw), ty = tile / tw % th, tx = tile % tw;
        const float *o = g + ((b * h + 2 * ty) * w + 2 * tx) * c;
        for (int64_t k = 0; k < c; k += LANES) {
            vec d[2][2], e[4][2];
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++)
                    d[i][j] = *(const vec *)(o + (i * w + j) * c + k);
            for (int j = 0; j < 2; j++) {
                e[0][j] = d[0][j];
                e[1][j] = d[0][j] + d[1][j];
                e[2][j] = d[0][j] - d[1][j];
                e[3][j] = -d[1][j];
            }
            for (int i = 0; i < 4; i++) {
                float *q = gb + ((i * 4) * TILES + t) * c + k;
                const int64_t step = TILES * c;
                *(vec *)(q) = e[i][0];
                *(vec *)(q + step) = e[i][0] + e[i][1];
                *(vec *)(q + 2 * step) = e[i][0] - e[i][1];
                *(vec *)(q + 3 * step) = -e[i][1];
            }
        }
    }
}

/* dU[ci][co] += sum_t V[t][ci] G[t][co] for one position: R input channels x NV vectors. */
#define GEMM_T_BLOCK(R, NV)                                                                 \
    static void gemm_t_##R##_##NV(const float *v, const float *g, float *du, int64_t cin,  \
                                  int64_t cout) {                                          \
        for (int64_t co = 0; co < cout; co += NV * LANES)                                  \
            for (int64_t ci = 0; ci < cin; ci += R) {                                      \
                vec acc[R][NV];                                                            \
                for (int r = 0; r < R; r++)                                                \
                    for (int q = 0; q < NV; q++)                                           \
                        acc[r][q] = *(const vec *)(du + (ci + r) * cout + co + q * LANES); \
                for (int64_t t = 0; t < TILES; t++) {                                      \
                    vec b[NV];                                                             \
                    for (int q = 0; q < NV; q++)                                           \
                        b[q] = *(const vec *)(g + t * cout + co + q * LANES);              \
                    for (int r = 0; r < R; r++) {                                          \
                        const float a = v[t * cin + ci + r];                               \
                        for (int q = 0; q < NV; q++)                                       \
                            acc[r][q] += a * b[q];                                         \
                    }                                                                      \
                }                                                                          \
                for (int r = 0; r < R; r++)                                                \
                    for (int q = 0; q < NV; q++)                                           \
                        *(vec *)(du + (ci + r) * cout + co + q * LANES) = acc[r][q];       \
            }                                                                              \
    }
#ifdef __AVX512F__
GEMM_T_BLOCK(16, 1)
GEMM_T_BLOCK(8, 2)
GEMM_T_BLOCK(4, 4)

static void gemm_t(const float *v, const float *g, float *du, int64_t cin, int64_t cout) {
    if (cout % (4 * LANES) == 0)
        gemm_t_4_4(v, g, du, cin, cout);
    else if (cout % (2 * LANES) == 0)
        gemm_t_8_2(v, g, du, cin, cout);
    else
        gemm_t_16_1(v, g, du, cin, cout);
}
#else
GEMM_T_BLOCK(4, 2)

static void gemm_t(const float *v, const float *g, float *du, int64_t cin, int64_t cout) {
    gemm_t_4_2(v, g, du, cin, cout);
}
#endif

#define CHUNKS 8 /* at most this many partial sums of the weight gradient */

/* Partial sums of the weight gradient: fixed by the shape alone, so that no result depends on
 * the number of threads; few enough that each partial's tiles carry 8x its size in data. */
static int64_t chunk_count(int64_t blocks, int64_t cin, int64_t cout) {
    const int64_t per_block = TILES * (cin + cout), partial = cin * cout;
    int64_t chunks = blocks * per_block / (8 * partial);
    chunks = chunks < 1 ? 1 : chunks;
    chunks = chunks > CHUNKS ? CHUNKS : chunks;
    return chunks > blocks ? blocks : chunks;
}

/* dw (cout, cin, 3, 3) = G^T dU G summed over every tile of x (n, h, w, cin) and the output
 * gradient g (n, h, w, cout). Work items are (partial, group of positions): when there are
 * fewer partials than threads, the threads split the 16 positions and each transforms the
 * blocks itself. Returns 0, or 1 when the scratch cannot be allocated. */
int wino_weight_grad(const float *x, const float *g, int64_t n, int64_t h, int64_t w,
                     int64_t cin, int64_t cout, float *dw, int threads) {
    const int64_t total = n * (h / 2) * (w / 2), blocks = (total + TILES - 1) / TILES;
    const int64_t chunks = chunk_count(blocks, cin, cout), size = 16 * cin * cout;
    const int64_t groups = chunks >= threads ? 1 : (threads + chunks - 1) / chunks;
    float *du = aligned_alloc(64, chunks * size * sizeof(float));
    if (!du)
        return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *vb = aligned_alloc(64, 16 * TILES * cin * sizeof(float));
        float *gb = aligned_alloc(64, 16 * TILES * cout * sizeof(float));
        if (!vb || !gb) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < chunks * groups; item++) {
                const int64_t k = item / groups, q = item % groups;
                const int p0 = (int)(q * 16 / groups), p1 = (int)((q + 1) * 16 / groups);
                float *part = du + k * size;
                memset(part + p0 * cin * cout, 0, (p1 - p0) * cin * cout * sizeof(float));
                for (int64_t blk = k * blocks / chunks; blk < (k + 1) * blocks / chunks; blk++) {
                    transform_input(x, n, h, w, cin, blk * TILES, vb);
                    transform_grad(g, n, h, w, cout, blk * TILES, gb);
                    for (int p = p0; p < p1; p++)
                        gemm_t(vb + p * TILES * cin, gb + p * TILES * cout, part + p * cin * cout,
                               cin, cout);
                }
            }
#pragma omp for schedule(static)
            for (int64_t i = 0; i < size; i++)
                for (int64_t k = 1; k < chunks; k++)
                    du[i] += du[k * size + i];
#pragma omp for schedule(static)
            for (int64_t co = 0; co < cout; co++)
                for (int64_t ci = 0; ci < cin; ci++) {
                    float m[4][4], t[3][4];
                    for (int p = 0; p < 16; p++)
                        m[p / 4][p % 4] = du[(p * cin + ci) * cout + co];
                    for (int j = 0; j < 4; j++) {
                        t[0][j] = m[0][j] + 0.5f * (m[1][j] + m[2][j]);
                        t[1][j] = 0.5f * (m[1][j] - m[2][j]);
                        t[2][j] = 0.5f * (m[1][j] + m[2][j]) + m[3][j];
                    }
                    float *o = dw + (co * cin + ci) * 9;
                    for (int i = 0; i < 3; i++) {
                        o[i * 3] = t[i][0] + 0.5f * (t[i][1] + t[i][2]);
                        o[i * 3 + 1] = 0.5f * (t[i][1] - t[i][2]);
                        o[i * 3 + 2] = 0.5f * (t[i][1] + t[i][2]) + t[i][3];
                    }
                }
        }
        free(vb);
        free(gb);
    }
    free(du);
    return failed;
}
