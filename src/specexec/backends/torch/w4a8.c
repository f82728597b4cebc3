/* w4a8: y = x W^T with 4-bit weights and 8-bit activations, both quantized per group of 64 along K.
 *
 * Weights (N x K): w[n, k] = q[n, k] * s[n, g] + low[n, g], q in 0..15, g = k / 64.
 * Activations (M x K), quantized here per row and group: x[m, k] ~ xi[m, k] * sx[m, g], xi in -127..127.
 * So y[m, n] = sum_g s[n, g] sx[m, g] (q . xi)_g + low[n, g] sx[m, g] (sum xi)_g, where (q . xi)_g is an
 * exact integer dot product over the 64 channels of group g (AVX-512 VNNI: unsigned q times signed xi).
 *
 * Every row is computed the same way whatever M is, so a block of rows gives bit for bit the rows computed
 * one at a time, and the weights, read once per block of 16 outputs, serve every row from the cache.
 * Past ROW_TILE rows, where the CPU has AMX and the OS grants it (w4a8_enable_amx), the integer dot
 * products of 16 rows x 16 outputs x 64 channels are one tile instruction (tdpbsud) instead of 32 VNNI
 * ones per row; integer sums are exact in any order and the float epilogue is the same code, so both
 * paths give the same bits.
 *
 * Packed weights, per block of 16 outputs and per 8 input channels k0..k0+7: 64 bytes; byte 4j + t holds
 * q[n0 + j, k0 + t] in its low nibble and q[n0 + j, k0 + 4 + t] in its high nibble (j < 16, t < 4).
 * scales and lows: float16 [N / 16][K / 64][16] (as llama.cpp stores its block scales).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512VNNI__
#include <immintrin.h>
#endif
#ifdef __AMX_INT8__
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define GROUP 64
/* Software prefetch distance along the packed weights (and their scales), which every thread reads in
 * one sequential stream. Without it a one-row pass waited on memory and computed by turns, reaching half
 * the DRAM bandwidth of a 2-core CPU; 8 KB ahead (measured 4-16 KB: best at 8) overlaps the two. A
 * prefetch past the end is harmless: it never faults. */
#define PREFETCH_BYTES 8192
#define PREFETCH_GROUPS (PREFETCH_BYTES / (GROUP / 8 * 64) + 1)
#define ROW_TILE 8
#define AMX_ROWS 16
#define AMX_MIN_ROWS (ROW_TILE + 1) /* up to ROW_TILE rows, one VNNI pass over the weights is as fast */

static int amx_ready = 0;

/* Ask Linux for the AMX tile state (once per process); returns whether the AMX path is on. */
int w4a8_enable_amx(void) {
#ifdef __AMX_INT8__
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    if (!amx_ready && syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0) amx_ready = 1;
#endif
    return amx_ready;
}

int w4a8_has_vnni(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

/* Per row and group: sx = max|x| / 127, xi = round(x / sx), xsum = sx * sum(xi). */
void w4a8_quantize_rows(const float *x, int64_t m_rows, int64_t k, int8_t *xi, float *sx, float *xsum) {
    int64_t groups = k / GROUP;
    for (int64_t m = 0; m < m_rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *src = x + m * k + g * GROUP;
            int8_t *dst = xi + m * k + g * GROUP;
            float amax = 0.0f;
            for (int i = 0; i < GROUP; i++) amax = fmaxf(amax, fabsf(src[i]));
            float scale = amax / 127.0f;
            float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t total = 0;
            for (int i = 0; i < GROUP; i++) {
                int32_t v = (int32_t)nearbyintf(src[i] * inverse);
                v = v > 127 ? 127 : (v < -127 ? -127 : v);
                dst[i] = (int8_t)v;
                total += v;
            }
            sx[m * groups + g] = scale;
            xsum[m * groups + g] = scale * (float)total;
        }
    }
}

#ifdef __AVX512VNNI__
/* acc + s sx dot + low xsum, for one row, one group and 16 outputs: the float epilogue both vector paths
 * share, so that VNNI and AMX give the same bits. */
static inline __m512 add_group(__m512 acc, __m512i dot, __m512 s, __m512 low, float sx, float xsum) {
    __m512 scaled = _mm512_mul_ps(s, _mm512_set1_ps(sx));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scaled, acc);
    return _mm512_fmadd_ps(low, _mm512_set1_ps(xsum), acc);
}
#endif

/* Rows [m0, m0 + rows) of y for the 16 outputs of block nb; rows <= ROW_TILE. */
static void block_rows(const uint8_t *packed, const _Float16 *scales, const _Float16 *lows, const int8_t *xi,
                       const float *sx, const float *xsum, int64_t m0, int rows, int64_t nb, int64_t k,
                       int64_t n, float *y) {
    int64_t groups = k / GROUP;
    const uint8_t *wblock = packed + nb * (k / 8) * 64;
    const _Float16 *sblock = scales + nb * groups * 16;
    const _Float16 *lblock = lows + nb * groups * 16;
#ifdef __AVX512VNNI__
    __m512 acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        /* Low and high nibbles accumulate apart: two independent dependency chains per row. */
        __m512i dot_lo[ROW_TILE], dot_hi[ROW_TILE];
        for (int r = 0; r < rows; r++) dot_lo[r] = dot_hi[r] = _mm512_setzero_si512();
        _mm_prefetch((const char *)(sblock + (g + PREFETCH_GROUPS) * 16), _MM_HINT_T0);
        _mm_prefetch((const char *)(lblock + (g + PREFETCH_GROUPS) * 16), _MM_HINT_T0);
        for (int c = 0; c < GROUP / 8; c++) {
            const uint8_t *chunk = wblock + (g * (GROUP / 8) + c) * 64;
            _mm_prefetch((const char *)(chunk + PREFETCH_BYTES), _MM_HINT_T0);
            __m512i v = _mm512_loadu_si512((const void *)chunk);
            __m512i lo = _mm512_and_si512(v, nibble);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            int64_t kk = g * GROUP + c * 8;
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = xi + (m0 + r) * k + kk;
                int32_t first, second;
                memcpy(&first, xr, 4);
                memcpy(&second, xr + 4, 4);
                dot_lo[r] = _mm512_dpbusd_epi32(dot_lo[r], lo, _mm512_set1_epi32(first));
                dot_hi[r] = _mm512_dpbusd_epi32(dot_hi[r], hi, _mm512_set1_epi32(second));
            }
        }
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sblock + g * 16)));
        __m512 l = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lblock + g * 16)));
        for (int r = 0; r < rows; r++) {
            int64_t at = (m0 + r) * groups + g;
            acc[r] = add_group(acc[r], _mm512_add_epi32(dot_lo[r], dot_hi[r]), s, l, sx[at], xsum[at]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (m0 + r) * n + nb * 16, acc[r]);
#else
    /* Portable path: the same sums in the same order (fmaf where the vector code fuses). */
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < 16; j++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                int32_t dot = 0;
                for (int c = 0; c < GROUP / 8; c++) {
                    const uint8_t *bytes = wblock + (g * (GROUP / 8) + c) * 64 + 4 * j;
                    const int8_t *xr = xi + (m0 + r) * k + g * GROUP + c * 8;
                    for (int t = 0; t < 4; t++) {
                        dot += (int32_t)(bytes[t] & 0x0F) * xr[t];
                        dot += (int32_t)(bytes[t] >> 4) * xr[4 + t];
                    }
                }
                int64_t at = (m0 + r) * groups + g;
                acc = fmaf((float)dot, (float)sblock[g * 16 + j] * sx[at], acc);
                acc = fmaf((float)lblock[g * 16 + j], xsum[at], acc);
            }
            y[(m0 + r) * n + nb * 16 + j] = acc;
        }
    }
#endif
}

#ifdef __AMX_INT8__
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Tiles 0 (int32 dots), 1 (16 rows of activations), 2 (codes in tdpbsud's order) of 16 x 64 bytes each. */
static void amx_configure(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 3; t++) {
        config.rows[t] = 16;
        config.bytes_per_row[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* The 64 channels of group g of a block as tdpbsud reads them: the low nibbles of each 8 channels' chunk
 * are channels 0-3 of every output, the high ones 4-7, i.e. tile rows 2c and 2c + 1, 4 bytes per output. */
static void unpack_group(const uint8_t *wblock, int64_t g, uint8_t *codes) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < GROUP / 8; c++) {
        const uint8_t *chunk = wblock + (g * (GROUP / 8) + c) * 64;
        _mm_prefetch((const char *)(chunk + PREFETCH_BYTES), _MM_HINT_T0);
        __m512i v = _mm512_loadu_si512((const void *)chunk);
        _mm512_store_si512((void *)(codes + 2 * c * 64), _mm512_and_si512(v, nibble));
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        _mm512_store_si512((void *)(codes + (2 * c + 1) * 64), high);
    }
}

/* Rows [m0, m0 + 16) of y for the 16 outputs of block nb (xi has zero rows up to a multiple of 16; only
 * the first `rows` are stored), from the block's codes unpacked once into `codes` (K / 64 tiles of 1 KB)
 * for all its 16-row tiles. The epilogue runs group after group, as in block_rows. */
static void block_rows_amx(const uint8_t *codes, const _Float16 *scales, const _Float16 *lows,
                           const int8_t *xi, const float *sx, const float *xsum, int64_t m0, int rows,
                           int64_t nb, int64_t k, int64_t n, float *y) {
    int64_t groups = k / GROUP;
    const _Float16 *sblock = scales + nb * groups * 16;
    const _Float16 *lblock = lows + nb * groups * 16;
    int32_t dots[AMX_ROWS * 16] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        _tile_zero(0);
        _tile_loadd(1, xi + m0 * k + g * GROUP, k);
        _tile_loadd(2, codes + g * 1024, 64);
        _tile_dpbsud(0, 1, 2);
        _tile_stored(0, dots, 64);
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sblock + g * 16)));
        __m512 l = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lblock + g * 16)));
        for (int r = 0; r < rows; r++) {
            int64_t at = (m0 + r) * groups + g;
            __m512i dot = _mm512_load_si512((const void *)(dots + r * 16));
            acc[r] = add_group(acc[r], dot, s, l, sx[at], xsum[at]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (m0 + r) * n + nb * 16, acc[r]);
}
#endif

/* y (M x N, float32) = x (M x K, float32) W^T; K % 64 == 0, N % 16 == 0. Returns 0, or -1 when out of
 * memory. */
int w4a8_linear(const float *x, int64_t m_rows, int64_t k, int64_t n, const uint8_t *packed,
                const _Float16 *scales, const _Float16 *lows, float *y, int threads) {
    int64_t groups = k / GROUP;
    int amx = amx_ready && m_rows >= AMX_MIN_ROWS;
    /* The AMX path reads whole tiles of 16 rows: pad the activations with zero rows. */
    int64_t padded = amx ? (m_rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : m_rows;
    int8_t *xi = calloc((size_t)(padded * k), 1);
    float *sx = malloc(sizeof(float) * (size_t)(m_rows * groups));
    float *xsum = malloc(sizeof(float) * (size_t)(m_rows * groups));
    if (!xi || !sx || !xsum) {
        free(xi);
        free(sx);
        free(xsum);
        return -1;
    }
    w4a8_quantize_rows(x, m_rows, k, xi, sx, xsum);
    int64_t blocks = n / 16;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
#ifdef __AMX_INT8__
        uint8_t *codes = amx ? aligned_alloc(64, (size_t)groups * 1024) : NULL;
        failed = amx && !codes;
        if (codes) amx_configure(); /* tile state is per thread */
#endif
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < blocks; nb++) {
#ifdef __AMX_INT8__
            if (codes) {
                const uint8_t *wblock = packed + nb * (k / 8) * 64;
                for (int64_t g = 0; g < groups; g++) unpack_group(wblock, g, codes + g * 1024);
                for (int64_t m0 = 0; m0 < m_rows; m0 += AMX_ROWS) {
                    int rows = (int)(m_rows - m0 < AMX_ROWS ? m_rows - m0 : AMX_ROWS);
                    block_rows_amx(codes, scales, lows, xi, sx, xsum, m0, rows, nb, k, n, y);
                }
                continue;
            }
            if (amx) continue; /* out of memory: reported below */
#endif
            for (int64_t m0 = 0; m0 < m_rows; m0 += ROW_TILE) {
                int rows = (int)(m_rows - m0 < ROW_TILE ? m_rows - m0 : ROW_TILE);
                block_rows(packed, scales, lows, xi, sx, xsum, m0, rows, nb, k, n, y);
            }
        }
#ifdef __AMX_INT8__
        if (codes) _tile_release();
        free(codes);
#endif
    }
    free(xi);
    free(sx);
    free(xsum);
    return failed ? -1 : 0;
}
