/* A vectorized exp shared by the kernels (AVX2 + FMA; include inside an x86-64 guard). */
#ifndef MOBC_VEXP_H
#define MOBC_VEXP_H
#include <immintrin.h>

/* exp of 8 floats, x <= 0 (scores minus their maximum): Cody-Waite reduction x = n ln2 + r and a
 * degree-6 polynomial for e^r (the Cephes single-precision coefficients, ~1 ulp), scaled by 2^n.
 * Below -87.3 the result is 0, as expf's underflow is to the weights that matter here (MASK_MIN
 * slots must weigh exactly 0; a -INFINITY score too). */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ); /* also true for -INFINITY */
    x = _mm256_max_ps(lo, x); /* a NaN score stays NaN (max returns its second operand then) */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

#endif
