/* matmul_checksum's four checks of a plain product, each in one read of every matrix it needs
 * (detectors/native_checksum.py describes the tensors and calls these; detectors/
 * checksum_kernels.py holds the same arithmetic in torch, the reference; detectors/
 * product_bounds.py the bound).
 *
 * A matrix is read a row at a time as float32: in place where its row is contiguous float32,
 * else widened (bfloat16: a shift) or cast as an autocast kernel casts it (float32 rounded to
 * bfloat16, nearest even) into a row of scratch that stays in the first-level cache. Each row's
 * sums run in float32 lanes, as the eager path's float32 reductions; a figure over many rows
 * (a Frobenius norm) gathers them in float64. Up to two batch dimensions with their own
 * strides (attention's [batch, heads] views), a broadcast operand's stride 0. Plain C with the
 * compiler's vector extensions: no torch headers, built in a fraction of a second. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
typedef float floats __attribute__((vector_size(LANES * 4)));

enum { FLOAT32 = 0, BFLOAT16 = 1, FLOAT32_AS_BFLOAT16 = 2 };

typedef struct {
    const void *data;
    int64_t type;                /* the enum above */
    int64_t batch[2], bstride[2]; /* batch sizes and strides, in elements */
    int64_t rows, cols, rstride, cstride;
} matrix;

/* The bound's coefficients (product_bounds.Bound) and whether rows' norms are read (nonzero). */
typedef struct {
    double row, fro, sums, floor, rows;
} bound;

static int64_t batches(const matrix *m) { return m->batch[0] * m->batch[1]; }

static float widen(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* float32 to bfloat16, nearest even, as torch rounds it (a NaN stays a NaN). */
static float as_bfloat16(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    if ((w & 0x7fffffffu) > 0x7f800000u)
        return f;
    w = (w + 0x7fffu + ((w >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &w, sizeof f);
    return f;
}

/* Batch matrix b of m: its rows' description, with its first element's offset worked out once
 * (a division per row costs as much as reading a short one). */
typedef struct {
    const matrix *m;
    int64_t at;
} batch_matrix;

static batch_matrix batch_of(const matrix *m, int64_t b) {
    batch_matrix bm = {m, (b / m->batch[1]) * m->bstride[0] + (b % m->batch[1]) * m->bstride[1]};
    return bm;
}

/* Row r of a batch matrix as float32 values: in place, or through `scratch`. */
static inline const float *row_of(batch_matrix bm, int64_t r, float *scratch) {
    const matrix *m = bm.m;
    int64_t at = bm.at + r * m->rstride, n = m->cols, s = m->cstride;
    if (m->type == BFLOAT16) {
        const uint16_t *p = (const uint16_t *)m->data + at;
        if (s == 1)
            for (int64_t c = 0; c < n; c++)
                scratch[c] = widen(p[c]);
        else
            for (int64_t c = 0; c < n; c++)
                scratch[c] = widen(p[c * s]);
        return scratch;
    }
    const float *p = (const float *)m->data + at;
    if (m->type == FLOAT32) {
        if (s == 1)
            return p;
        for (int64_t c = 0; c < n; c++)
            scratch[c] = p[c * s];
        return scratch;
    }
    if (s == 1)
        for (int64_t c = 0; c < n; c++)
            scratch[c] = as_bfloat16(p[c]);
    else
        for (int64_t c = 0; c < n; c++)
            scratch[c] = as_bfloat16(p[c * s]);
    return scratch;
}

static floats load(const float *p) {
    floats x;
    memcpy(&x, p, sizeof x);
    return x;
}

typedef float eight __attribute__((vector_size(32)));
typedef float four __attribute__((vector_size(16)));

/* The lanes' sum, halves added pairwise (register extracts, no trip through memory), in the
 * same order on every CPU. */
static inline float total(floats x) {
    eight low, high;
    memcpy(&low, &x, sizeof low);
    memcpy(&high, (const char *)&x + sizeof low, sizeof high);
    eight e = low + high;
    four a, b;
    memcpy(&a, &e, sizeof a);
    memcpy(&b, (const char *)&e + sizeof a, sizeof b);
    four f = a + b;
    return (f[0] + f[2]) + (f[1] + f[3]);
}

/* A row's dot product with v, its sum and its sum of squares: those `want` asks for (a constant
 * at each call, so that the others are never computed). */
enum { DOT = 1, SUM = 2, SQUARES = 4 };

typedef struct {
    float dot, sum, squares, norm; /* norm: sqrt(squares), or |x| for a row of one, as torch's
                                      vector_norm (whose square may overflow where |x| does not) */
} figures;

static inline __attribute__((always_inline)) figures row_figures(const float *x, const float *v,
                                                                 int64_t n, int want) {
    /* Two sets of accumulators, so that consecutive additions do not wait on each other. */
    floats dot[2] = {{0}}, sum[2] = {{0}}, sq[2] = {{0}};
    int64_t body = n - n % (2 * LANES), c = 0;
    for (; c < body; c += 2 * LANES)
        for (int k = 0; k < 2; k++) {
            floats a = load(x + c + k * LANES);
            if (want & DOT)
                dot[k] += a * load(v + c + k * LANES);
            if (want & SUM)
                sum[k] += a;
            if (want & SQUARES)
                sq[k] += a * a;
        }
    figures f = {0.0f, 0.0f, 0.0f, 0.0f};
    if (want & DOT)
        f.dot = total(dot[0] + dot[1]);
    if (want & SUM)
        f.sum = total(sum[0] + sum[1]);
    if (want & SQUARES)
        f.squares = total(sq[0] + sq[1]);
    for (; c < n; c++) {
        if (want & DOT)
            f.dot += x[c] * v[c];
        f.sum += x[c];
        f.squares += x[c] * x[c];
    }
    if (want & SQUARES)
        f.norm = n == 1 ? fabsf(x[0]) : sqrtf(f.squares);
    return f;
}

/* A product's own row's norm, as the bound reads it (detectors/norms.py): where its float32 sum
 * of squares overflowed (a 16-bit fault of 2^64 and more), summed again in float64, so that an
 * infinite norm does not widen the row's bound to infinity and hide the fault; at most
 * float32's largest. */
static float own_norm(const float *x, int64_t n, figures f) {
    if (n == 1 || isfinite(f.squares))
        return f.norm;
    double squares = 0.0;
    for (int64_t c = 0; c < n; c++)
        squares += (double)x[c] * x[c];
    double norm = sqrt(squares);
    return norm > FLT_MAX ? FLT_MAX : (float)norm;
}

/* acc += w x over `count` rows (at most BLOCK) at once: one load and store of acc for them all
 * (a row at a time, the accumulator's traffic is three times the row's). */
#define BLOCK 4
static void accumulate(float *acc, const float *const *x, const float *w, int count, int64_t n) {
    if (count == BLOCK)
        for (int64_t c = 0; c < n; c++)
            acc[c] += (w[0] * x[0][c] + w[1] * x[1][c]) + (w[2] * x[2][c] + w[3] * x[3][c]);
    else
        for (int r = 0; r < count; r++)
            for (int64_t c = 0; c < n; c++)
                acc[c] += w[r] * x[r][c];
}

/* squares += x * x, elementwise, over `count` rows at once. */
static void accumulate_squares(float *squares, const float *const *x, int count, int64_t n) {
    if (count == BLOCK)
        for (int64_t c = 0; c < n; c++)
            squares[c] += (x[0][c] * x[0][c] + x[1][c] * x[1][c]) +
                          (x[2][c] * x[2][c] + x[3][c] * x[3][c]);
    else
        for (int r = 0; r < count; r++)
            for (int64_t c = 0; c < n; c++)
                squares[c] += x[r][c] * x[r][c];
}

/* Batch matrix b's rows weighed by w (or by one each, w NULL) and summed into `across`, into
 * `squares` their squares where given, into `along` each row's own sum where given, and into
 * `total` their sum of squares where given; scratch holds BLOCK rows. */
static void across_rows(const matrix *m, int64_t b, const float *w, float *across,
                        float *squares, float *along, double *total, float *scratch) {
    static const float ones[BLOCK] = {1.0f, 1.0f, 1.0f, 1.0f};
    batch_matrix bm = batch_of(m, b);
    memset(across, 0, m->cols * sizeof *across);
    if (squares)
        memset(squares, 0, m->cols * sizeof *squares);
    for (int64_t r = 0; r < m->rows; r += BLOCK) {
        int count = m->rows - r < BLOCK ? (int)(m->rows - r) : BLOCK;
        const float *x[BLOCK];
        for (int k = 0; k < count; k++) {
            x[k] = row_of(bm, r + k, scratch + k * m->cols);
            if (along) {
                figures f = row_figures(x[k], NULL, m->cols, SUM | SQUARES);
                along[r + k] = f.sum;
                if (total)
                    *total += f.squares;
            } else if (total)
                *total += row_figures(x[k], NULL, m->cols, SQUARES).squares;
        }
        accumulate(across, x, w ? w + r : ones, count, m->cols);
        if (squares)
            accumulate_squares(squares, x, count, m->cols);
    }
}

/* Batch matrix b's sums along its rows (into `along`, one per row) and across them (into
 * `across`, one per column), and its sum of squares added to `squares`, those given, in one
 * read; scratch holds BLOCK rows. */
static void sums_of(const matrix *m, int64_t b, float *along, float *across, double *squares,
                    float *scratch) {
    if (across) {
        across_rows(m, b, NULL, across, NULL, along, squares, scratch);
        return;
    }
    batch_matrix bm = batch_of(m, b);
    for (int64_t r = 0; r < m->rows; r++) {
        const float *x = row_of(bm, r, scratch);
        if (squares) {
            figures f = row_figures(x, NULL, m->cols, SUM | SQUARES);
            along[r] = f.sum;
            *squares += f.squares;
        } else
            along[r] = row_figures(x, NULL, m->cols, SUM).sum;
    }
}

static float norm(const float *x, int64_t n) {
    double t = 0.0;
    for (int64_t i = 0; i < n; i++)
        t += (double)x[i] * x[i];
    return (float)sqrt(t);
}

/* The worst ratio so far (bounded_ratio's amax: a NaN anywhere makes it NaN). */
typedef struct {
    float worst;
    int nan;
} verdict;

/* A bound's coefficients in float32, as each row's limit uses them, worked out once per call:
 * read through the bound's pointer, they were converted again at every row (the compiler
 * cannot keep them: the figures' stores might alias them), half a short row's cost. */
typedef struct {
    float row, fro, fro_row, sums, floor;
    int rows;
} limits;

static limits limits_of(const bound *bd) {
    limits lm = {(float)bd->row, (float)bd->fro, (float)(bd->fro + bd->row), (float)bd->sums,
                 (float)bd->floor, bd->rows != 0.0};
    return lm;
}

static inline void judge(verdict *v, float actual, float expected, float limit,
                         const limits *lm) {
    if (!isfinite(expected))
        return; /* an operand not finite: upstream's fault, this row counts 0 */
    float error = fabsf(actual - expected), scale = limit + lm->floor;
    /* Divided only where the row may be the worst so far (or NaN, or infinite over infinite):
     * a division's latency per row is most of a short row's cost. */
    if (isfinite(error) && error <= v->worst * scale)
        return;
    float ratio = error / scale;
    if (isnan(ratio))
        v->nan = 1;
    else if (ratio > v->worst)
        v->worst = ratio;
}

static float verdict_of(const verdict *v) { return v->nan ? NAN : v->worst; }

/* What a float32 norm may lose to squares below the smallest normal: product_bounds.NORM_SLACK,
 * by which each norm in a limit is taken larger. */
#define NORM_SLACK 0x1p-47f

/* The limit of a row (product_bounds.bounded_ratio): its norm, read (`own_norm`) or bounded by
 * its left operand's times the right's Frobenius norm and its addend's norm, and the check's
 * own sums. */
static inline float limit_of(const limits *lm, float row_norm, float left_norm, float right_fro,
                             float sums_norm, float addend_norm) {
    left_norm += NORM_SLACK, right_fro += NORM_SLACK, sums_norm += NORM_SLACK;
    if (!lm->rows)
        return left_norm * (right_fro * lm->fro_row + sums_norm * lm->sums) +
               (addend_norm + NORM_SLACK) * lm->row;
    return (row_norm + NORM_SLACK) * lm->row +
           left_norm * (right_fro * lm->fro + sums_norm * lm->sums);
}

/* Room for BLOCK rows of each of the widths given (each read into scratch of its own) and for
 * `vectors` vectors of the widest, zeroed: a figure a check does not compute (the squares of
 * a 32-bit product's rows) reads as 0, never as what the memory held. */
static float *scratch_for(int64_t a, int64_t b, int64_t vectors) {
    int64_t widest = a > b ? a : b;
    return calloc((size_t)(BLOCK * (a + b) + vectors * widest + LANES), sizeof(float));
}

/* output_figures: P e against alpha L (R e) + the addend's row sums, per batch matrix of P = L R.
 * The addend (`added` nonzero) is the fourth matrix, broadcast to P's shape: each row's sum and
 * norm, beta times, read once where every row is the same (a bias: strides 0). R is given as
 * itself (right_t 0) or as its transpose R^T with contiguous rows (a Linear's weight).
 * ||R||_F and ||L||_F per batch matrix, the worst ratio (out), and, where given, what the
 * backward's checks read of the operands, in the same read: R^T e (`right_sums`, p per batch
 * matrix) and L e (`left_sums`, m per batch matrix). */
void forward_check(const matrix *operands, int64_t right_t, int64_t added, double alpha,
                   double beta, const bound *bd, float *right_fros, float *left_fros,
                   float *right_sums, float *left_sums, float *out) {
    const matrix *L = operands, *R = operands + 1, *P = operands + 2, *A = operands + 3;
    int64_t q = L->cols, p = P->cols, m = P->rows, n = batches(P);
    float *scratch = scratch_for(q, p, 1), *row = scratch + BLOCK * q;
    float *sums = row + BLOCK * p, *addend_row = row + p;
    int one_addend = added && A->rstride == 0 && A->bstride[0] == 0 && A->bstride[1] == 0;
    const limits lm = limits_of(bd);
    const float a = (float)alpha, b_ = (float)beta, a_abs = (float)fabs(alpha),
                b_abs = (float)fabs(beta);
    figures addend = {0.0f, 0.0f, 0.0f, 0.0f};
    if (one_addend)
        addend = row_figures(row_of(batch_of(A, 0), 0, addend_row), NULL, p, SUM | SQUARES);
    verdict v = {0.0f, 0};
    for (int64_t b = 0; b < n; b++) {
        double right_sq = 0.0;
        float *columns = right_sums ? right_sums + b * p : NULL;
        if (right_t)
            sums_of(R, b, columns, sums, &right_sq, scratch);
        else
            sums_of(R, b, sums, columns, &right_sq, scratch);
        float right_fro = (float)sqrt(right_sq), sums_norm = norm(sums, q);
        double left_sq = 0.0;
        batch_matrix left = batch_of(L, b), output = batch_of(P, b);
        batch_matrix addends = added ? batch_of(A, b) : output;
        for (int64_t i = 0; i < m; i++) {
            const float *x = row_of(left, i, scratch);
            figures l;
            if (left_sums) {
                l = row_figures(x, sums, q, DOT | SUM | SQUARES);
                left_sums[b * m + i] = l.sum;
            } else
                l = row_figures(x, sums, q, DOT | SQUARES);
            const float *o = row_of(output, i, row);
            figures f = lm.rows ? row_figures(o, NULL, p, SUM | SQUARES)
                                : row_figures(o, NULL, p, SUM);
            float row_norm = lm.rows ? own_norm(o, p, f) : 0.0f;
            if (added && !one_addend)
                addend = row_figures(row_of(addends, i, addend_row), NULL, p, SUM | SQUARES);
            float expected = a * l.dot + b_ * addend.sum;
            float left_norm = l.norm * a_abs;
            judge(&v, f.sum, expected,
                  limit_of(&lm, row_norm, left_norm, right_fro, sums_norm, b_abs * addend.norm),
                  &lm);
            left_sq += l.squares;
        }
        right_fros[b] = right_fro;
        left_fros[b] = (float)sqrt(left_sq);
    }
    out[0] = verdict_of(&v);
    free(scratch);
}

/* grad_figures: from dP, per row dP_i (R^T e) and ||dP_i|| (each alpha times), R^T e given
 * (the forward's), and ||R^T e|| per batch matrix; where L e is given (the weight gradient is
 * checked), (L e)^T dP per batch matrix into `columns` in the same read, rows summed across
 * four at a time. */
static void grad_figures(const matrix *G, const float *right_sums, const float *left_sums,
                         double alpha, float *projected, float *norms, float *sums_norm,
                         float *columns) {
    int64_t m = G->rows, p = G->cols, n = batches(G);
    float *scratch = scratch_for(p, 0, 0);
    const float a = (float)alpha, a_abs = (float)fabs(alpha);
    for (int64_t b = 0; b < n; b++) {
        const float *sums = right_sums + b * p;
        sums_norm[b] = norm(sums, p);
        batch_matrix grad = batch_of(G, b);
        if (left_sums)
            memset(columns + b * p, 0, p * sizeof *columns);
        for (int64_t r = 0; r < m; r += BLOCK) {
            int count = m - r < BLOCK ? (int)(m - r) : BLOCK;
            const float *x[BLOCK];
            for (int k = 0; k < count; k++) {
                x[k] = row_of(grad, r + k, scratch + k * p);
                figures f = row_figures(x[k], sums, p, DOT | SQUARES);
                int64_t at = b * m + r + k;
                projected[at] = a * f.dot;
                norms[at] = p == 1 ? a_abs * f.norm : f.squares;
            }
            if (left_sums)
                accumulate(columns + b * p, x, left_sums + b * m + r, count, p);
        }
    }
    /* The rows' square roots after them all, in vector lanes: taken row by row, each waited on
     * its row's sums, most of a short row's time. */
    if (p > 1)
        for (int64_t at = 0; at < n * m; at++)
            norms[at] = a_abs * sqrtf(norms[at]);
    free(scratch);
}

/* left_ratio: dL e against alpha dP (R^T e), per row of dL. */
static void left_check(const matrix *G, const float *projected, const float *grad_norms,
                       const float *right_fro, const float *sums_norm, const bound *bd,
                       float *out) {
    int64_t n = batches(G);
    float *scratch = scratch_for(G->cols, 0, 0);
    const limits lm = limits_of(bd);
    verdict v = {0.0f, 0};
    for (int64_t b = 0; b < n; b++) {
        batch_matrix grad = batch_of(G, b);
        for (int64_t i = 0; i < G->rows; i++) {
            const float *x = row_of(grad, i, scratch);
            figures f = lm.rows ? row_figures(x, NULL, G->cols, SUM | SQUARES)
                                : row_figures(x, NULL, G->cols, SUM);
            int64_t at = b * G->rows + i;
            float row_norm = lm.rows ? own_norm(x, G->cols, f) : 0.0f;
            judge(&v, f.sum, projected[at],
                  limit_of(&lm, row_norm, grad_norms[at], right_fro[b], sums_norm[b], 0.0f), &lm);
        }
    }
    out[0] = verdict_of(&v);
    free(scratch);
}

/* The norms of a batch matrix's columns summed in float64 (`own_norm`'s slow path, taken only
 * where a float32 sum overflowed), into `norms`; a row of it at a time through scratch. */
static void column_norms(batch_matrix bm, int64_t rows, int64_t cols, float *norms,
                         float *scratch) {
    double *squares = calloc((size_t)cols, sizeof *squares);
    for (int64_t r = 0; r < rows; r++) {
        const float *x = row_of(bm, r, scratch);
        for (int64_t c = 0; c < cols; c++)
            squares[c] += (double)x[c] * x[c];
    }
    for (int64_t c = 0; c < cols; c++) {
        double norm = sqrt(squares[c]);
        norms[c] = norm > FLT_MAX ? FLT_MAX : (float)norm;
    }
    free(squares);
}

/* right_ratio: dR's columns, e^T dR against alpha (L e)^T dP, L e given (the forward's): the
 * rows of dR^T = alpha dP^T L, checked as the forward checks a product's rows, with ||dP||_F
 * for the norms of dP's columns. dR given as itself (grad_t 0: its columns summed across its
 * rows) or as its transpose with contiguous rows (a Linear's weight gradient: along them). */
static void right_check(const matrix *G, const matrix *D, int64_t grad_t, double alpha,
                        const float *columns, const float *left_sums, const float *left_fro,
                        const float *grad_norms, const bound *bd, float *out) {
    int64_t m = G->rows, p = G->cols, q = grad_t ? D->cols : D->rows, n = batches(G);
    float *scratch = scratch_for(D->cols, p, 2), *actual = scratch + BLOCK * (D->cols + p);
    float *norms = actual + p; /* of dR's columns: squares first where summed across its rows */
    const limits lm = limits_of(bd);
    const float a = (float)alpha;
    verdict v = {0.0f, 0};
    for (int64_t b = 0; b < n; b++) {
        const float *expected = columns + b * p;
        batch_matrix grad = batch_of(D, b);
        if (grad_t)
            for (int64_t r = 0; r < p; r++) {
                const float *x = row_of(grad, r, scratch);
                figures f = lm.rows ? row_figures(x, NULL, q, SUM | SQUARES)
                                    : row_figures(x, NULL, q, SUM);
                actual[r] = f.sum;
                norms[r] = lm.rows ? own_norm(x, q, f) : 0.0f;
            }
        else {
            across_rows(D, b, NULL, actual, lm.rows ? norms : NULL, NULL, NULL, scratch);
            int overflowed = 0;
            for (int64_t c = 0; c < p; c++) {
                overflowed |= !isfinite(norms[c]);
                norms[c] = sqrtf(norms[c]);
            }
            if (overflowed) /* own_norm's float64 sums, for the columns of dR at once */
                column_norms(grad, q, p, norms, scratch);
        }
        float grad_fro = norm(grad_norms + b * m, m), sums_norm = norm(left_sums + b * m, m);
        for (int64_t c = 0; c < p; c++)
            judge(&v, actual[c], a * expected[c],
                  limit_of(&lm, norms[c], grad_fro, left_fro[b], sums_norm, 0.0f), &lm);
    }
    out[0] = verdict_of(&v);
    free(scratch);
}

/* backward_check: a product's backward checked in one call, as the calls above in turn: the
 * output gradient's figures (grad_figures, into memory of this call's own), then the input
 * gradient's check (left_check, `which` bit 1) and the weight gradient's (right_check, bit 2),
 * their ratios into out[0] and out[1]. Matrices: dP, then dL where checked, then dR where
 * checked; the operands themselves are not read again: what their checks need of them, R^T e
 * (`right_sums`), L e (`left_sums`), ||R||_F and ||L||_F, the forward check kept. */
void backward_check(const matrix *operands, double alpha, int64_t which, const float *right_sums,
                    const float *left_sums, const float *right_fro, const float *left_fro,
                    const bound *left_bd, const bound *right_bd, int64_t grad_t, float *out) {
    const matrix *G = operands;
    int64_t rows = batches(G) * G->rows, columns = (which & 2) ? batches(G) * G->cols : 0;
    float *figures = malloc((size_t)(2 * rows + batches(G) + columns) * sizeof *figures);
    float *projected = figures, *norms = projected + rows, *sums_norm = norms + rows;
    float *weighted = sums_norm + batches(G);
    grad_figures(G, right_sums, (which & 2) ? left_sums : NULL, alpha, projected, norms,
                 sums_norm, weighted);
    const matrix *next = operands + 1;
    if (which & 1)
        left_check(next++, projected, norms, right_fro, sums_norm, left_bd, out);
    if (which & 2)
        right_check(G, next, grad_t, alpha, weighted, left_sums, left_fro, norms, right_bd,
                    out + 1);
    free(figures);
}

/* rounding_ratio: whether any element of `rounded` (bfloat16, or float32 holding a bfloat16
 * value) is not `wide` rounded once to bfloat16, nearest even. Bit for bit, but a NaN against
 * a NaN of any payload: torch's own casts write a NaN's bits differently on their vector and
 * scalar paths. as_bfloat16 on the bits without a branch (a NaN kept whole, any other value
 * rounded: a finite one never becomes a NaN), so that the comparison runs in vector lanes, a
 * chunk of a bfloat16 `rounded` widened at a time. */
static int rounded_wrong(const float *wide, const float *rounded, int64_t n) {
    uint32_t wrong = 0;
    for (int64_t c = 0; c < n; c++) {
        uint32_t a, b;
        memcpy(&a, wide + c, sizeof a);
        memcpy(&b, rounded + c, sizeof b);
        uint32_t a_nan = (a & 0x7fffffffu) > 0x7f800000u, b_nan = (b & 0x7fffffffu) > 0x7f800000u;
        uint32_t want = a_nan ? a : (a + 0x7fffu + ((a >> 16) & 1u)) & 0xffff0000u;
        wrong |= (want != b) & !(a_nan & b_nan);
    }
    return wrong != 0;
}

int64_t rounding_check(const float *wide, const void *rounded, int64_t rounded_float32, int64_t n) {
    enum { CHUNK = 256 };
    float widened[CHUNK];
    int wrong = 0;
    for (int64_t i = 0; i < n; i += CHUNK) {
        int64_t m = n - i < CHUNK ? n - i : CHUNK;
        const float *got = (const float *)rounded + i;
        if (!rounded_float32) {
            for (int64_t c = 0; c < m; c++)
                widened[c] = widen(((const uint16_t *)rounded)[i + c]);
            got = widened;
        }
        wrong |= rounded_wrong(wide + i, got, m);
    }
    return wrong;
}
