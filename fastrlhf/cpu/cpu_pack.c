/* Rows of a linear weight W [N, K] (row-major) written into oneDNN's blocked GEMM layout in place.
 *
 * The layout is panels of B output rows, each stored transposed, in 4-byte words: for fp32,
 * dst[n / B][k][n % B] = W[n][k], what oneDNN's brgemm wants for B = W^T ("BA16a64b" with K a
 * multiple of 16, B = 64 on AVX2/AVX-512); for bf16 the words are pairs of K-adjacent values
 * ("BA16a64b2a"), which is the same transpose of W viewed as an [N, K/2] matrix of 4-byte words.
 * fastrlhf.cpu.probe checks the layout before anything uses this file. Being a transpose,
 * it goes through 8x8 register tiles (AVX) rather than element by element, which keeps it near the
 * cost of a plain copy; torch's strided copy and oneDNN's reorder into a fresh buffer cost several
 * times that.
 * Words are only moved (loads, shuffles, stores), never converted, so any 4-byte content is exact.
 *
 * Built at run time with the machine's C compiler (fastrlhf.cpu.packed_linear.build_pack_kernel, with the
 * flags fastrlhf.cpu.probe picks for this CPU); the scalar loops below are the whole kernel where AVX is
 * missing or not targeted, and fastrlhf_pack_isa says which of the two was compiled.
 */
#include <stddef.h>
#include <stdint.h>

#ifdef __AVX__
#include <immintrin.h>

/* d[c * ld + r] = s[r * ls + c] for r, c < 8 */
static inline void transpose8x8(const float *s, size_t ls, float *d, size_t ld) {
    __m256 r0 = _mm256_loadu_ps(s + 0 * ls), r1 = _mm256_loadu_ps(s + 1 * ls);
    __m256 r2 = _mm256_loadu_ps(s + 2 * ls), r3 = _mm256_loadu_ps(s + 3 * ls);
    __m256 r4 = _mm256_loadu_ps(s + 4 * ls), r5 = _mm256_loadu_ps(s + 5 * ls);
    __m256 r6 = _mm256_loadu_ps(s + 6 * ls), r7 = _mm256_loadu_ps(s + 7 * ls);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(d + 0 * ld, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(d + 1 * ld, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(d + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(d + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(d + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(d + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(d + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(d + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

/* Write src's n_rows rows of K words (row stride ld words), which are rows row0 .. row0 + n_rows - 1
 * of W, into the panels at dst. Rows outside that range are left as they are. */
void fastrlhf_pack_rows_32bit(const uint32_t *src, size_t ld, size_t n_rows, size_t K, uint32_t *dst, size_t B,
                              size_t row0) {
    size_t i = 0;
    while (i < n_rows) {
        size_t row = row0 + i;
        size_t j = row % B;
        size_t span = B - j; /* rows left in this panel */
        if (span > n_rows - i) span = n_rows - i;
        const uint32_t *s = src + i * ld;
        uint32_t *d = dst + (row / B) * K * B + j;
        size_t r = 0;
#ifdef __AVX__
        /* Eight rows at a time, all of K: rows are read sequentially, panel rows written 8 wide. */
        for (; r + 8 <= span; r += 8) {
            size_t k = 0;
            for (; k + 8 <= K; k += 8)
                transpose8x8((const float *)(s + r * ld + k), ld, (float *)(d + k * B + r), B);
            for (; k < K; ++k)
                for (size_t q = 0; q < 8; ++q) d[k * B + r + q] = s[(r + q) * ld + k];
        }
#endif
        for (; r < span; ++r)
            for (size_t k = 0; k < K; ++k) d[k * B + r] = s[r * ld + k];
        i += span;
    }
}

/* Which transposes were compiled: "avx" (8x8 register tiles) or "scalar". */
const char *fastrlhf_pack_isa(void) {
#ifdef __AVX__
    return "avx";
#else
    return "scalar";
#endif
}
