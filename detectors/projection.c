/* allreduce_sketch's projection and sum of squares of a bucket in one read (detectors/
 * native_projection.py builds and loads it; detectors/allreduce_sketch.py, the weights).
 *
 * The bucket's first rows * width elements are a row-major grid weighed by u[b] * v[c], the
 * rest (fewer than rows) by z. Products and per-row partial sums in float32 lanes, as the
 * eager path's float32 matrix-vector product; across rows in float64. A 16-bit bucket is widened
 * in registers (bfloat16: a shift) instead of through a float32 copy. Plain C with the
 * compiler's vector extensions (GCC, Clang): no torch headers, so it builds in a fraction of a
 * second, and -march=native picks the host's widest vectors. */
#include <stdint.h>
#include <string.h>

#define LANES 16
typedef float floats __attribute__((vector_size(LANES * 4)));
typedef double doubles __attribute__((vector_size(LANES * 8)));
typedef uint32_t words __attribute__((vector_size(LANES * 4)));
typedef uint16_t halves __attribute__((vector_size(LANES * 2)));

/* Rows wider than this (floats of v) are read BLOCK at a time, so that each load of v, which no
 * longer fits the first-level cache, serves several rows; narrower ones one at a time, which
 * keeps the read to one sequential stream (25 MiB of float32, one core: 512 rows of 12,800 at
 * 1.3 read passes this way against 2.2 one row at a time; 4,096 rows of 1,600 the reverse). */
#define WIDE 4096
#define BLOCK 8

static inline floats load_float32(const float *p) {
    floats x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline floats load_bfloat16(const uint16_t *p) {
    halves h;
    memcpy(&h, p, sizeof h);
    words w = __builtin_convertvector(h, words) << 16;
    floats x;
    memcpy(&x, &w, sizeof x);
    return x;
}

static inline float one_float32(const float *p) { return *p; }

static inline float one_bfloat16(const uint16_t *p) {
    uint32_t w = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

#define PROJECT(DTYPE, T)                                                                   \
    static void rows_##DTYPE(const T *grid, int64_t first, int64_t width, int64_t body,    \
                             const float *u, const float *v, doubles *projection,           \
                             doubles *squares) {                                            \
        floats acc[BLOCK] = {{0}}, sq[BLOCK] = {{0}};                                       \
        const T *row = grid + first * width;                                                \
        for (int64_t c = 0; c < body; c += LANES) {                                         \
            floats w = load_float32(v + c);                                                 \
            for (int r = 0; r < BLOCK; r++) {                                               \
                floats x = load_##DTYPE(row + r * width + c);                               \
                acc[r] += x * w;                                                            \
                sq[r] += x * x;                                                             \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < BLOCK; r++) {                                                   \
            *projection += __builtin_convertvector(acc[r], doubles) * (double)u[first + r]; \
            *squares += __builtin_convertvector(sq[r], doubles);                            \
        }                                                                                   \
    }                                                                                       \
                                                                                            \
    static void row_##DTYPE(const T *row, int64_t body, double weight, const float *v,     \
                            doubles *projection, doubles *squares) {                        \
        floats acc = {0}, sq = {0};                                                         \
        for (int64_t c = 0; c < body; c += LANES) {                                         \
            floats x = load_##DTYPE(row + c);                                               \
            acc += x * load_float32(v + c);                                                 \
            sq += x * x;                                                                    \
        }                                                                                   \
        *projection += __builtin_convertvector(acc, doubles) * weight;                      \
        *squares += __builtin_convertvector(sq, doubles);                                   \
    }                                                                                       \
                                                                                            \
    void project_##DTYPE(const T *bucket, int64_t numel, int64_t rows, int64_t width,      \
                         const float *u, const float *v, const float *z, double *out) {     \
        doubles projection = {0}, squares = {0};                                            \
        int64_t body = width - width % LANES, b = 0;                                        \
        for (; width > WIDE && b + BLOCK <= rows; b += BLOCK)                               \
            rows_##DTYPE(bucket, b, width, body, u, v, &projection, &squares);              \
        for (; b < rows; b++)                                                               \
            row_##DTYPE(bucket + b * width, body, u[b], v, &projection, &squares);          \
        double total = 0.0, total_squares = 0.0;                                            \
        for (int l = 0; l < LANES; l++) {                                                   \
            total += projection[l];                                                         \
            total_squares += squares[l];                                                    \
        }                                                                                   \
        for (b = 0; body < width && b < rows; b++) {                                        \
            const T *row = bucket + b * width;                                              \
            float dot = 0.0f;                                                               \
            for (int64_t c = body; c < width; c++) {                                        \
                float x = one_##DTYPE(row + c);                                             \
                dot += x * v[c];                                                            \
                total_squares += (double)(x * x);                                           \
            }                                                                               \
            total += (double)u[b] * dot;                                                    \
        }                                                                                   \
        for (int64_t i = rows * width; i < numel; i++) {                                    \
            float x = one_##DTYPE(bucket + i);                                              \
            total += (double)(x * z[i - rows * width]);                                     \
            total_squares += (double)(x * x);                                               \
        }                                                                                   \
        out[0] = total;                                                                     \
        out[1] = total_squares;                                                             \
    }

PROJECT(float32, float)
PROJECT(bfloat16, uint16_t)
