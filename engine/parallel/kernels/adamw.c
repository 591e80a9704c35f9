/* One pass of AdamW over a flat fp32 block, writing the compute copy as it goes.
 *
 * For each element: the gradient (divided by the clipping's divisor), both moments, the fp32
 * master, and the copy the workers upload (fp32, bf16 or fp16, rounded to nearest even), read
 * and written once. The arithmetic follows torch's fused CPU AdamW step by step: decoupled
 * weight decay first, the first moment as a lerp, the second as beta2 * v + (1 - beta2) * g * g,
 * then the bias-corrected update. Called through ctypes, which releases the GIL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { OUT_NONE = 0, OUT_FLOAT32 = 1, OUT_BFLOAT16 = 2, OUT_FLOAT16 = 3 };

static inline uint16_t to_bfloat16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* the update of one element; returns the new master */
static inline float update(float g, float *restrict m, float *restrict v, float p, float lr_wd,
                           float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                           float step_size, float bias_correction2_sqrt) {
    p = p - lr_wd * p;
    float mi = *m + one_minus_beta1 * (g - *m);
    float vi = beta2 * *v + one_minus_beta2 * g * g;
    *m = mi;
    *v = vi;
    return p - step_size * mi / (sqrtf(vi) / bias_correction2_sqrt + eps);
}

#define ADAMW_LOOP(STORE)                                                                           \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
    for (int64_t i = 0; i < n; i++) {                                                              \
        float g = grad[i] / divisor;                                                               \
        float p = update(g, &exp_avg[i], &exp_avg_sq[i], param[i], lr_wd, one_minus_beta1, beta2, \
                         one_minus_beta2, eps, step_size, bias_correction2_sqrt);                  \
        param[i] = p;                                                                              \
        STORE;                                                                                     \
    }

void roundhouse_adamw(float *restrict param, const float *restrict grad, float *restrict exp_avg,
                      float *restrict exp_avg_sq, void *restrict out, int out_kind, int64_t n,
                      float divisor, float lr, float beta1, float beta2, float eps,
                      float weight_decay, float step_size, float bias_correction2_sqrt,
                      int threads) {
    const float lr_wd = lr * weight_decay;
    const float one_minus_beta1 = 1.0f - beta1;
    const float one_minus_beta2 = 1.0f - beta2;
    if (out_kind == OUT_FLOAT32) {
        float *o = (float *)out;
        ADAMW_LOOP(o[i] = p)
    } else if (out_kind == OUT_BFLOAT16) {
        uint16_t *o = (uint16_t *)out;
        ADAMW_LOOP(o[i] = to_bfloat16(p))
    } else if (out_kind == OUT_FLOAT16) {
        _Float16 *o = (_Float16 *)out;
        ADAMW_LOOP(o[i] = (_Float16)p)
    } else {
        ADAMW_LOOP((void)0)
    }
}
