/* A gradient contribution into its fp32 buffer, and the buffer's squared norm, in one pass.
 *
 * dst = src * scale (the step's first contribution) or dst + src * scale (the next ones, in the
 * fold's canonical order); returns the sum of the squares of dst afterwards, so the last
 * contribution leaves the squared norm of the tensor's whole gradient and the step needs no
 * separate pass for the global norm. The sum is deterministic: fixed blocks, fixed lanes inside
 * a block, the blocks' sums added in order, whatever the number of threads. Called through
 * ctypes, which releases the GIL.
 */
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 8192
#define LANES 16

static double block_fold(float *restrict dst, const float *restrict src, int64_t n, float scale,
                         int add) {
    float lanes[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int j = 0; j < LANES; j++) {
            float d = src[i + j] * scale;
            if (add) d = dst[i + j] + d;
            dst[i + j] = d;
            lanes[j] += d * d;
        }
    }
    double total = 0.0;
    for (; i < n; i++) {
        float d = src[i] * scale;
        if (add) d = dst[i] + d;
        dst[i] = d;
        total += (double)d * (double)d;
    }
    for (int j = 0; j < LANES; j++) total += lanes[j];
    return total;
}

double roundhouse_fold(float *restrict dst, const float *restrict src, int64_t n, float scale,
                       int add, int threads) {
    int64_t blocks = (n + BLOCK - 1) / BLOCK;
    if (blocks <= 1) return block_fold(dst, src, n, scale, add);
    double *sums = malloc(sizeof(double) * (size_t)blocks);
    if (sums == NULL) return -1.0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t start = b * BLOCK;
        int64_t len = n - start < BLOCK ? n - start : BLOCK;
        sums[b] = block_fold(dst + start, src + start, len, scale, add);
    }
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) total += sums[b];
    free(sums);
    return total;
}
