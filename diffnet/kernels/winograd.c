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
 * The transforms round differently from the direct sum (terms are combined before they are
 * multiplied), by about as much as another summation order does: tests/test_fused_winograd.py
 * holds the error against float64 within a few times oneDNN's own. No result depends on the
 * number of threads: the weight gradient's partial sums are fixed by the shape.
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
_Static_assert(TILES % 16 == 0 && TILES % 12 == 0, "a register block's rows must divide TILES");

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

/* The batch index, tile row and tile column of flat tile `tile` (over batch, tile rows, tile
 * columns) of a field of th x tw tiles. */
static inline void locate(int64_t tile, int64_t th, int64_t tw, int64_t *b, int64_t *ty,
                          int64_t *tx) {
    *b = tile / (th * tw);
    *ty = tile / tw % th;
    *tx = tile % tw;
}

/* Zero tile t's rows of a transform buffer (16 positions x TILES x c): a tile past the last. */
static void zero_tile(float *buf, int64_t t, int64_t c) {
    for (int p = 0; p < 16; p++)
        memset(buf + (p * TILES + t) * c, 0, c * sizeof(float));
}

/* V[p][t][ci] = (B^T d B)[p] for the tiles first .. first + TILES - 1, d each tile's 4x4 input
 * patch (zero outside the field), B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]. */
static void transform_input(const float *x, int64_t n, int64_t h, int64_t w, int64_t c,
                            int64_t first, float *vb) {
    const int64_t th = h / 2, tw = w / 2, total = n * th * tw, step = TILES * c;
    const vec zero = {0};
    for (int64_t t = 0; t < TILES; t++) {
        if (first + t >= total) {
            zero_tile(vb, t, c);
            continue;
        }
        int64_t b, ty, tx;
        locate(first + t, th, tw, &b, &ty, &tx);
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
                *(vec *)(o) = e[i][0] - e[i][2];
                *(vec *)(o + step) = e[i][1] + e[i][2];
                *(vec *)(o + 2 * step) = e[i][2] - e[i][1];
                *(vec *)(o + 3 * step) = e[i][1] - e[i][3];
            }
        }
    }
}

/* G[p][t][co] = (A g A^T)[p] for each tile's 2x2 output gradient g, A = [1 0; 1 1; 1 -1; 0 -1]:
 * the output transform's adjoint. */
static void transform_grad(const float *g, int64_t n, int64_t h, int64_t w, int64_t c,
                           int64_t first, float *gb) {
    const int64_t th = h / 2, tw = w / 2, total = n * th * tw, step = TILES * c;
    for (int64_t t = 0; t < TILES; t++) {
        if (first + t >= total) {
            zero_tile(gb, t, c);
            continue;
        }
        int64_t b, ty, tx;
        locate(first + t, th, tw, &b, &ty, &tx);
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
                *(vec *)(q) = e[i][0];
                *(vec *)(q + step) = e[i][0] + e[i][1];
                *(vec *)(q + 2 * step) = e[i][0] - e[i][1];
                *(vec *)(q + 3 * step) = -e[i][1];
            }
        }
    }
}

/* y tiles from M[p][t][co]: A^T M A with A^T = [1 1 1 0; 0 1 -1 -1], plus the bias. */
static void transform_output(const float *mb, const float *bias, int64_t n, int64_t h,
                             int64_t w, int64_t c, int64_t first, float *y) {
    const int64_t th = h / 2, tw = w / 2, total = n * th * tw;
    for (int64_t t = 0; t < TILES && first + t < total; t++) {
        int64_t b, ty, tx;
        locate(first + t, th, tw, &b, &ty, &tx);
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

/* The register block of both matrix products: c[r][0 .. NV * LANES) = (c if add, else 0) +
 * sum over k < depth of a[r * ar + k * ak] b[k * ldb + ...], for r < R. The R x NV vectors of
 * c stay in registers while k streams; each sum runs in k's order whatever the block. */
#define BLOCK(R, NV)                                                                         \
    static inline __attribute__((always_inline)) void block_##R##_##NV(                      \
        const float *a, int64_t ar, int64_t ak, const float *b, int64_t ldb, int64_t depth,  \
        float *c, int64_t ldc, int add) {                                                    \
        vec acc[R][NV];                                                                      \
        for (int r = 0; r < R; r++)                                                          \
            for (int q = 0; q < NV; q++)                                                     \
                acc[r][q] = add ? *(const vec *)(c + r * ldc + q * LANES) : (vec){0};        \
        for (int64_t k = 0; k < depth; k++) {                                                \
            vec bk[NV];                                                                      \
            for (int q = 0; q < NV; q++)                                                     \
                bk[q] = *(const vec *)(b + k * ldb + q * LANES);                             \
            for (int r = 0; r < R; r++) {                                                    \
                const float s = a[r * ar + k * ak];                                          \
                for (int q = 0; q < NV; q++)                                                 \
                    acc[r][q] += s * bk[q];                                                  \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            for (int q = 0; q < NV; q++)                                                     \
                *(vec *)(c + r * ldc + q * LANES) = acc[r][q];                               \
    }

/* The forward's product for one position, M[t][co] = sum_ci V[t][ci] U[ci][co], in blocks of
 * R tiles (R divides TILES). */
#define PRODUCT(R, NV)                                                                       \
    static void product_##R##_##NV(const float *v, const float *u, float *m, int64_t cin,    \
                                   int64_t cout) {                                           \
        for (int64_t co = 0; co < cout; co += NV * LANES)                                    \
            for (int64_t t = 0; t < TILES; t += R)                                           \
                block_##R##_##NV(v + t * cin, cin, 1, u + co, cout, cin, m + t * cout + co,  \
                                 cout, 0);                                                   \
    }

/* The weight gradient's product for one position, dU[ci][co] += sum_t V[t][ci] G[t][co], in
 * blocks of R input channels (R divides 16, so every channel count). */
#define PRODUCT_T(R, NV)                                                                     \
    static void product_t_##R##_##NV(const float *v, const float *g, float *du, int64_t cin, \
                                     int64_t cout) {                                         \
        for (int64_t co = 0; co < cout; co += NV * LANES)                                    \
            for (int64_t ci = 0; ci < cin; ci += R)                                          \
                block_##R##_##NV(v + ci, 1, cin, g + co, cout, TILES, du + ci * cout + co,   \
                                 cout, 1);                                                   \
    }

/* Register blocks: AVX-512 has 32 vector registers, AVX2 and SSE 16, so the blocks of
 * accumulators (rows x vectors) are smaller there. Channels are multiples of 16, so of
 * 2 * LANES below AVX-512. */
#ifdef __AVX512F__
BLOCK(16, 1)
BLOCK(12, 2)
BLOCK(6, 4)
BLOCK(8, 2)
BLOCK(4, 4)
PRODUCT(16, 1)
PRODUCT(12, 2)
PRODUCT(6, 4)
PRODUCT_T(16, 1)
PRODUCT_T(8, 2)
PRODUCT_T(4, 4)

static void product(const float *v, const float *u, float *m, int64_t cin, int64_t cout) {
    if (cout % (4 * LANES) == 0)
        product_6_4(v, u, m, cin, cout);
    else if (cout % (2 * LANES) == 0)
        product_12_2(v, u, m, cin, cout);
    else
        product_16_1(v, u, m, cin, cout);
}

static void product_t(const float *v, const float *g, float *du, int64_t cin, int64_t cout) {
    if (cout % (4 * LANES) == 0)
        product_t_4_4(v, g, du, cin, cout);
    else if (cout % (2 * LANES) == 0)
        product_t_8_2(v, g, du, cin, cout);
    else
        product_t_16_1(v, g, du, cin, cout);
}
#else
BLOCK(6, 2)
BLOCK(4, 2)
PRODUCT(6, 2)
PRODUCT_T(4, 2)

static void product(const float *v, const float *u, float *m, int64_t cin, int64_t cout) {
    product_6_2(v, u, m, cin, cout);
}

static void product_t(const float *v, const float *g, float *du, int64_t cin, int64_t cout) {
    product_t_4_2(v, g, du, cin, cout);
}
#endif

/* A convolution's fields and shape: what every work item reads. */
struct job {
    const float *x, *u, *bias, *g; /* input; U (forward); bias or NULL; output gradient */
    float *y, *du;                 /* forward output; the weight gradient's partial sums */
    int64_t n, h, w, cin, cout, blocks, chunks, groups;
};

/* Run fn(job, item, scratch) for items 0 .. count - 1 over the threads, each thread with its
 * own scratch for the transforms of one block of tiles (16 x TILES x (cin + cout) floats).
 * Returns 0, or 1 when a scratch cannot be allocated (then no item runs). */
static int over_items(const struct job *job, int64_t count, int threads,
                      void (*fn)(const struct job *, int64_t, float *)) {
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *s = aligned_alloc(64, 16 * TILES * (job->cin + job->cout) * sizeof(float));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < count; i++)
                fn(job, i, s);
        }
        free(s);
    }
    return failed;
}

/* One block of the forward: transform, 16 products, inverse transform into y. */
static void forward_block(const struct job *j, int64_t blk, float *vb) {
    float *mb = vb + 16 * TILES * j->cin;
    transform_input(j->x, j->n, j->h, j->w, j->cin, blk * TILES, vb);
    for (int p = 0; p < 16; p++)
        product(vb + p * TILES * j->cin, j->u + p * j->cin * j->cout, mb + p * TILES * j->cout,
                j->cin, j->cout);
    transform_output(mb, j->bias, j->n, j->h, j->w, j->cout, blk * TILES, j->y);
}

/* x (n, h, w, cin) -> y (n, h, w, cout) with U from wino_weights. Returns 0, or 1 when the
 * scratch cannot be allocated. */
int wino_forward(const float *x, const float *u, const float *bias, int64_t n, int64_t h,
                 int64_t w, int64_t cin, int64_t cout, float *y, int threads) {
    const int64_t total = n * (h / 2) * (w / 2), blocks = (total + TILES - 1) / TILES;
    const struct job job = {.x = x, .u = u, .bias = bias, .y = y, .n = n, .h = h, .w = w,
                            .cin = cin, .cout = cout, .blocks = blocks};
    return over_items(&job, blocks, threads, forward_block);
}

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

/* One item of the weight gradient: partial k's sum over its blocks, for group q of the 16
 * positions (the groups split the positions when there are fewer partials than threads, each
 * transforming the blocks itself). */
static void weight_grad_item(const struct job *j, int64_t item, float *vb) {
    const int64_t k = item / j->groups, q = item % j->groups, plane = j->cin * j->cout;
    const int p0 = (int)(q * 16 / j->groups), p1 = (int)((q + 1) * 16 / j->groups);
    float *gb = vb + 16 * TILES * j->cin, *part = j->du + k * 16 * plane;
    memset(part + p0 * plane, 0, (p1 - p0) * plane * sizeof(float));
    for (int64_t blk = k * j->blocks / j->chunks; blk < (k + 1) * j->blocks / j->chunks; blk++) {
        transform_input(j->x, j->n, j->h, j->w, j->cin, blk * TILES, vb);
        transform_grad(j->g, j->n, j->h, j->w, j->cout, blk * TILES, gb);
        for (int p = p0; p < p1; p++)
            product_t(vb + p * TILES * j->cin, gb + p * TILES * j->cout, part + p * plane,
                      j->cin, j->cout);
    }
}

/* dw[co][ci] (3x3) = G^T dU[ci][co] G (4x4 -> 3x3), G^T = [1 .5 .5 0; 0 .5 -.5 0; 0 .5 .5 1]. */
static void weights_back(const float *du, int64_t cin, int64_t cout, int64_t co, int64_t ci,
                         float *dw) {
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

/* dw (cout, cin, 3, 3) = G^T dU G summed over every tile of x (n, h, w, cin) and the output
 * gradient g (n, h, w, cout): the partials, their sum in a fixed order, the back transform.
 * Returns 0, or 1 when the scratch cannot be allocated. */
int wino_weight_grad(const float *x, const float *g, int64_t n, int64_t h, int64_t w,
                     int64_t cin, int64_t cout, float *dw, int threads) {
    const int64_t total = n * (h / 2) * (w / 2), blocks = (total + TILES - 1) / TILES;
    const int64_t chunks = chunk_count(blocks, cin, cout), size = 16 * cin * cout;
    const int64_t groups = chunks >= threads ? 1 : (threads + chunks - 1) / chunks;
    float *du = aligned_alloc(64, chunks * size * sizeof(float));
    if (!du)
        return 1;
    const struct job job = {.x = x, .g = g, .du = du, .n = n, .h = h, .w = w, .cin = cin,
                            .cout = cout, .blocks = blocks, .chunks = chunks, .groups = groups};
    const int failed = over_items(&job, chunks * groups, threads, weight_grad_item);
    if (!failed) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < size; i++)
            for (int64_t k = 1; k < chunks; k++)
                du[i] += du[k * size + i];
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t co = 0; co < cout; co++)
            for (int64_t ci = 0; ci < cin; ci++)
                weights_back(du, cin, cout, co, ci, dw);
    }
    free(du);
    return failed;
}
