/* The U-Net decoder's bilinear x2 upsampling (align_corners=False) and the concatenation
 * with the encoder's skip after it, forward and backward, for float32 channels_last fields:
 * out = cat([upsample(x), skip], channel axis). Forward reads x and skip once and writes the
 * concatenation (eager writes the upsampled field, then reads it back for torch.cat);
 * backward reads the concatenation's gradient once and writes both inputs' gradients dense.
 * Built and loaded by diffnet/kernels/upcat.py.
 *
 * The arithmetic is ATen's: the same source indices and weights (w = lambda_row * lambda_col),
 * each output the same fused multiply-add chain over its four sources, and each input
 * gradient the same sum, term for term in ATen's order (output pixels in raster order, then
 * the four corners in turn), written as a gather so that every thread writes its own rows.
 * No result depends on the number of threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16 /* floats in one 512-bit vector */
#define READ 5   /* output rows (columns) that read one input row (column), at most */

/* Source rows (columns) of output row o of a x2 upsampling from n, and their weights: ATen's
 * area_pixel_compute_source_index with scale 1/2, clamped at 0, the second index clamped at
 * n - 1. */
static inline void source(int64_t o, int64_t n, int64_t *i0, int64_t *i1, float *l0,
                          float *l1) {
    float real = 0.5f * ((float)o + 0.5f) - 0.5f;
    real = real < 0.0f ? 0.0f : real;
    *i0 = (int64_t)real;
    *i1 = *i0 + (*i0 < n - 1 ? 1 : 0);
    *l1 = real - (float)*i0;
    *l0 = 1.0f - *l1;
}

/* x (B, h, w, cu), skip (B, 2h, 2w, cs) -> out (B, 2h, 2w, cu + cs). */
int upcat_forward(const float *restrict x, const float *restrict skip, int64_t batch,
                  int64_t h, int64_t w, int64_t cu, int64_t cs, float *restrict out,
                  int threads) {
    const int64_t H = 2 * h, W = 2 * w, c = cu + cs;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < batch * H; row++) {
        const int64_t b = row / H, oh = row % H;
        int64_t ih0, ih1;
        float h0, h1;
        source(oh, h, &ih0, &ih1, &h0, &h1);
        const float *xb = x + b * h * w * cu;
        for (int64_t ow = 0; ow < W; ow++) {
            int64_t iw0, iw1;
            float w0, w1;
            source(ow, w, &iw0, &iw1, &w0, &w1);
            const float w00 = h0 * w0, w01 = h0 * w1, w10 = h1 * w0, w11 = h1 * w1;
            const float *x00 = xb + (ih0 * w + iw0) * cu, *x01 = xb + (ih0 * w + iw1) * cu;
            const float *x10 = xb + (ih1 * w + iw0) * cu, *x11 = xb + (ih1 * w + iw1) * cu;
            float *restrict o = out + (row * W + ow) * c;
            for (int64_t k = 0; k < cu; k++)
                o[k] = fmaf(x00[k], w00, fmaf(x01[k], w01, fmaf(x11[k], w11, x10[k] * w10)));
            const float *restrict from = skip + (row * W + ow) * cs;
            for (int64_t k = 0; k < cs; k++)
                o[cu + k] = from[k];
        }
    }
    return 0;
}

/* The output rows (columns) of a x2 upsampling from n that read input row i, ascending: each
 * with the weights of those of its two sources that are i (both at the last row; a weight of
 * 0 counts too, so that an inf or NaN gradient spreads as in ATen: output row 0 reads row 1
 * with weight 0). Returns how many (at most READ). */
typedef struct {
    int64_t o;
    int n;
    float l[2];
} reader_t;

static int readers(int64_t i, int64_t n, reader_t *r) {
    int k = 0;
    for (int64_t o = 2 * i - 2; o <= 2 * i + 2; o++) {
        if (o < 0 || o >= 2 * n)
            continue;
        int64_t src[2];
        float l[2];
        source(o, n, &src[0], &src[1], &l[0], &l[1]);
        r[k].o = o;
        r[k].n = 0;
        for (int s = 0; s < 2; s++)
            if (src[s] == i)
                r[k].l[r[k].n++] = l[s];
        k += r[k].n > 0;
    }
    return k;
}

typedef float vec_t __attribute__((vector_size(4 * LANES)));

/* v = LANES floats from p, unaligned (a macro: a function returning a vector would change
 * the ABI where the host has no 512-bit registers) */
#define LOAD(v, p) memcpy(&(v), (p), sizeof(v))

/* One input pixel's cu channels of gradient from its n terms (offset into g, weight), added in
 * the order given, each with one fused multiply-add (a * w + acc on vectors is contracted to
 * one: -O3 with an FMA unit, checked bit for bit by the tests). The sums of two blocks of
 * LANES channels stay in registers at a time, so a pixel's adds form two chains, not one. */
static inline void gather(const float *restrict g, const int64_t *off, const float *wt, int n,
                          int64_t cu, float *restrict gx) {
    int64_t k0 = 0;
    for (; k0 + 2 * LANES <= cu; k0 += 2 * LANES) {
        vec_t a = {0}, b = {0}, ga, gb;
        for (int m = 0; m < n; m++) {
            LOAD(ga, g + off[m] + k0);
            LOAD(gb, g + off[m] + k0 + LANES);
            a = ga * wt[m] + a;
            b = gb * wt[m] + b;
        }
        memcpy(gx + k0, &a, sizeof a);
        memcpy(gx + k0 + LANES, &b, sizeof b);
    }
    for (; k0 + LANES <= cu; k0 += LANES) {
        vec_t a = {0}, ga;
        for (int m = 0; m < n; m++) {
            LOAD(ga, g + off[m] + k0);
            a = ga * wt[m] + a;
        }
        memcpy(gx + k0, &a, sizeof a);
    }
    for (int64_t k = k0; k < cu; k++) {
        float acc = 0.0f;
        for (int m = 0; m < n; m++)
            acc = fmaf(g[off[m] + k], wt[m], acc);
        gx[k] = acc;
    }
}

/* The terms of one input pixel read by output rows ``rows`` and columns ``cols``: (offset into
 * g, weight) in ATen's order of adding them (output row, output column, row corner, column
 * corner). Returns how many. */
static inline int terms(const reader_t *rows, int nr, const reader_t *cols, int nc,
                        int64_t row_stride, int64_t c, int64_t *off, float *wt) {
    int n = 0;
    for (int a = 0; a < nr; a++)
        for (int e = 0; e < nc; e++)
            for (int s = 0; s < rows[a].n; s++)
                for (int t = 0; t < cols[e].n; t++) {
                    off[n] = rows[a].o * row_stride + cols[e].o * c;
                    wt[n++] = rows[a].l[s] * cols[e].l[t];
                }
    return n;
}

/* g (B, 2h, 2w, cu + cs) -> gx (B, h, w, cu), gskip (B, 2h, 2w, cs); either may be NULL. Each
 * input pixel's gradient adds every (output pixel, corner) that read it, in ATen's order:
 * output pixels in raster order, then the corners 00, 01, 10, 11. So every sum is ATen's, and
 * each thread writes only its own rows. Returns 1 if a work buffer cannot be allocated. */
int upcat_backward(const float *restrict g, int64_t batch, int64_t h, int64_t w, int64_t cu,
                   int64_t cs, float *restrict gx, float *restrict gskip, int threads) {
    const int64_t H = 2 * h, W = 2 * w, c = cu + cs;
    reader_t *cols = malloc((size_t)w * READ * sizeof *cols);
    int *ncols = malloc((size_t)w * sizeof *ncols);
    /* an interior row i (2 <= i < h - 1) is read by output rows 2i-1 .. 2i+2, one corner each,
     * so its pixels' terms are the same but for the row's offset: built once per column */
    int *nmid = malloc((size_t)w * sizeof *nmid);
    int64_t *offmid = malloc((size_t)w * READ * READ * sizeof *offmid);
    float *wtmid = malloc((size_t)w * READ * READ * sizeof *wtmid);
    if (!cols || !ncols || !nmid || !offmid || !wtmid) {
        free(cols), free(ncols), free(nmid), free(offmid), free(wtmid);
        return 1;
    }
    reader_t mid[READ];
    const int nm = h >= 4 ? readers(2, h, mid) : 0;
    for (int m = 0; m < nm; m++)
        mid[m].o -= 3; /* output rows relative to 2i - 1, i = 2 */
    for (int64_t j = 0; j < w; j++) {
        ncols[j] = readers(j, w, cols + j * READ);
        nmid[j] = terms(mid, nm, cols + j * READ, ncols[j], W * c, c, offmid + j * READ * READ,
                        wtmid + j * READ * READ);
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t row = 0; row < batch * h; row++) {
        const int64_t b = row / h, i = row % h;
        const float *restrict gb = g + b * H * W * c;
        if (gskip)
            for (int64_t p = 2 * i * W; p < (2 * i + 2) * W; p++) {
                float *restrict to = gskip + (b * H * W + p) * cs;
                const float *restrict from = gb + p * c + cu;
                for (int64_t k = 0; k < cs; k++)
                    to[k] = from[k];
            }
        if (!gx)
            continue;
        if (i >= 2 && i < h - 1 && nm == 4) {
            const float *first = gb + (2 * i - 1) * W * c;
            for (int64_t j = 0; j < w; j++)
                gather(first, offmid + j * READ * READ, wtmid + j * READ * READ, nmid[j], cu,
                       gx + (row * w + j) * cu);
            continue;
        }
        reader_t rows[READ];
        const int nr = readers(i, h, rows);
        for (int64_t j = 0; j < w; j++) {
            int64_t off[READ * READ];
            float wt[READ * READ];
            const int n = terms(rows, nr, cols + j * READ, ncols[j], W * c, c, off, wt);
            gather(gb, off, wt, n, cu, gx + (row * w + j) * cu);
        }
    }
    free(cols), free(ncols), free(nmid), free(offmid), free(wtmid);
    return 0;
}
