/* Shared scalar math for specserve's C kernels. */
#ifndef SPECSERVE_MATH_H
#define SPECSERVE_MATH_H

#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0, vectorizable: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6
 * polynomial (relative error ~2e-7 over the range), 2^n put into the exponent bits. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

#endif
