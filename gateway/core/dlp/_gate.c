/* The gate's one pass in C (gateway/core/dlp/fastscan.py, `Gate`): whether a text holds
 * `segment` characters of the base64 alphabets in a row (RUN), and whether it holds one
 * of some literals (LITERAL), in one pass over its bytes, 32 (AVX2) or 64 (AVX-512 BW)
 * bytes a vector.
 *
 * Hyperscan answers the same two questions, but a database holding the run's bounded
 * repeat and any literal at all runs two engines over every byte: on prose, 0.21-0.30 ms
 * per MiB against 0.10-0.20 for the run alone (docs/performance.md). Here each 64-byte
 * block's nibbles are taken once: one pair of lookups gives the alphabet's bit mask and
 * the escapes (runs: five shifts and ands on a 64-bit word, the run carried across
 * blocks; 0.05 ms/MiB of prose), and two more where a literal may begin (a "Teddy"
 * prefilter on a pair of each literal's first bytes, the rarer of its first two pairs,
 * in up to eight buckets, the block before's carried in: 0.061 ms/MiB of prose with the
 * default detectors' at 64 bytes a vector, 0.077 at 32; 0.075 and 0.093 with three
 * lookups on the first three bytes until session 25, 0.13 and 0.15 when each lookup
 * took its own nibbles and loads until session 22); a position the prefilter keeps is
 * dropped unless its first three bytes hash to a literal's, then confirmed by comparing
 * the literals of its buckets.
 *
 * Only where the CPU has AVX2 (checked at import; AVX-512 BW too for `wide`) and only for
 * literals of three bytes or more (at most 64): otherwise `Gate()` raises ValueError and
 * the caller keeps Hyperscan. The answer is what a reader takes from Hyperscan's: RUN as
 * soon as a run is found (LITERAL may be set beside it: a run decides both askers), else
 * LITERAL exactly when one of the literals is in the text, and then ESCAPES with
 * PERCENT, BACKSLASH and PLUS for the bytes a reader unescapes (`%`, `\\`, `+`: the leak
 * guard and detection ask for them next, each a memchr pass of its own without this).
 * UNMARKED says the text starts with no byte-order mark and no NUL, so that detection
 * knows a JSON or text reader reads its bytes as they are without a call of its own.
 * tests/core/dlp/test_dlp_gate_native.py holds both widths to a plain reading on every
 * offset and length around the blocks' edges, to Hyperscan on random texts, and to no
 * read past a buffer under AddressSanitizer.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define RUN 1
#define LITERAL 2
#define PERCENT 4     /* a `%` is in the text (with ESCAPES) */
#define BACKSLASH 8   /* a `\\` */
#define PLUS 16       /* a `+` */
#define ESCAPES 32    /* the three bits above are known: the whole text was read */
#define UNDECIDED 64  /* the prefilter kept too many positions: ask another matcher */
#define UNMARKED 128  /* no byte-order mark, no NUL in the first four bytes: a JSON or
                       * text reader reads the text as its bytes (`decoding.json_codec`) */
#define MAX_LITERALS 64
#define PREFIX_BITS 4096
/* The work the prefilter's positions may cost before the pass gives up (a position kept
 * and each literal compared there count one): 1,024, then one in 16 bytes (the bench's
 * prose and chat body of 1 MiB cost under one in 4,096, measured). A text made to keep
 * many (`APG APG ...`, each a cross product of the literals' nibbles; `BEGIN PRIVATE KE`
 * over and over, seven comparisons each) would cost that much each: the caller asks
 * Hyperscan instead (UNDECIDED), whose cost does not depend on it. */
#define KEPT_FREE 1024
#define KEPT_SHIFT 4
#define BUCKETS 8
#define SEGMENT 20  /* (fastscan.SEGMENT: the run every gate asks for) */

typedef struct {
    PyObject_HEAD
    int segment;
    int count;
    int wide;  /* 64 bytes a vector (AVX-512 BW), else 32 (AVX2) */
    uint8_t cls_lo[16], cls_hi[16];  /* (lo[b & 15] & hi[b >> 4]): the escapes' bits and
                                      * above them the alphabet's (ALPHA_BITS) */
    uint8_t lo[2][16], hi[2][16];  /* byte k of a pair of a literal of the bucket (`place_pairs`) */
    uint8_t at_offset[2];          /* the buckets with a literal whose pair is at 0, at 1 */
    uint8_t offset[MAX_LITERALS];  /* where the literal's pair is in it: 0 or 1 */
    uint8_t length[MAX_LITERALS];
    uint8_t caseless[MAX_LITERALS];
    uint64_t prefixes[PREFIX_BITS / 64];  /* the literals' first three bytes, hashed */
    uint8_t bucket[MAX_LITERALS];
    char *text[MAX_LITERALS];
} GateObject;

static int have_avx2, have_avx512;

static uint8_t lower(uint8_t c) { return (c >= 'A' && c <= 'Z') ? (uint8_t)(c + 32) : c; }

/* Whether a literal of `buckets` whose pair is at `offset` is at `at` (its bytes within
 * `n`); `*work` counts the comparisons. */
static int literal_at(const GateObject *g, const uint8_t *data, Py_ssize_t n, Py_ssize_t at,
                      unsigned buckets, int offset, uint64_t *work) {
    for (int i = 0; i < g->count; i++) {
        if (!(buckets & (1u << g->bucket[i])) || g->offset[i] != offset)
            continue;
        Py_ssize_t len = g->length[i];
        if (at + len > n)
            continue;
        ++*work;
        const uint8_t *w = (const uint8_t *)g->text[i];
        if (!g->caseless[i]) {
            if (memcmp(data + at, w, (size_t)len) == 0)
                return 1;
            continue;
        }
        Py_ssize_t k = 0;
        while (k < len && lower(data[at + k]) == w[k])
            k++;
        if (k == len)
            return 1;
    }
    return 0;
}

/* A run of `segment` alphabet characters in the block (bit i of `alpha`: character i is
 * one), or carried into it; `carry` becomes the run reaching the block's end. Inlined
 * into each pass with `segment` a constant where it is SEGMENT (the shifts unrolled). */
static inline __attribute__((always_inline)) int run_in(uint64_t alpha, uint64_t *carry,
                                                        int segment) {
    uint64_t leading = alpha == ~(uint64_t)0 ? 64 : (uint64_t)__builtin_ctzll(~alpha);
    if (*carry + leading >= (uint64_t)segment)
        return 1;
    uint64_t r = alpha;
    if (segment == SEGMENT) {  /* (the loop below, unrolled: 2, 4, 8, 16, 20) */
        r &= r >> 1;
        r &= r >> 2;
        r &= r >> 4;
        r &= r >> 8;
        r &= r >> 4;
    } else {
        int have = 1;  /* r: bit i set where `have` characters from i are all in */
        while (have * 2 <= segment) {
            r &= r >> have;
            have *= 2;
        }
        if (have < segment)  /* (two runs of `have`, overlapping, make the segment) */
            r &= r >> (segment - have);
    }
    if (r)
        return 1;
    *carry = alpha == ~(uint64_t)0 ? *carry + 64
                                   : (alpha ? (uint64_t)__builtin_clzll(~alpha) : 0);
    return 0;
}

static inline unsigned prefix_hash(uint8_t a, uint8_t b, uint8_t c) {
    return ((unsigned)a * 0x9E3779B1u ^ (unsigned)b * 0x85EBCA77u ^ (unsigned)c * 0xC2B2AE3Du)
           >> 20 & (PREFIX_BITS - 1);
}

/* Whether a literal begins where one of the block's `starts` puts it (bit i: the
 * prefilter kept a pair at p + i, for the buckets in byte i of `buckets`; a literal whose
 * pair is its second and third bytes begins one byte before). A start whose first three
 * bytes (lowercased) are no literal's (the nibble tables also keep their cross products:
 * `AK` and `AP` make `AC`, `AS`, `Ak` too) is dropped by one bit test. */
static inline int literal_in(const GateObject *g, const uint8_t *data, Py_ssize_t n,
                             Py_ssize_t p, uint64_t starts, const uint8_t *buckets,
                             uint64_t *work) {
    while (starts) {
        int i = __builtin_ctzll(starts);
        starts &= starts - 1;
        for (int offset = 0; offset < 2; offset++) {
            unsigned kept = buckets[i] & g->at_offset[offset];
            Py_ssize_t at = p + i - offset;
            if (!kept || at < 0 || at + 3 > n)
                continue;
            ++*work;
            unsigned h = prefix_hash(lower(data[at]), lower(data[at + 1]),
                                     lower(data[at + 2]));
            if (!(g->prefixes[h / 64] >> (h % 64) & 1))
                continue;
            if (literal_at(g, data, n, at, kept, offset, work))
                return 1;
        }
    }
    return 0;
}

/* The last block, padded with zero bytes (in no table). */
static inline const uint8_t *padded(const uint8_t *block, Py_ssize_t left, uint8_t *tail) {
    if (left >= 64)
        return block;
    memset(tail, 0, 64);
    memcpy(tail, block, (size_t)left);
    return tail;
}

/* The escapes' bits of a gate's class table (`cls_lo`, `cls_hi`: the alphabet's bits are
 * above them, ALPHA_BITS): `%` bit 0, `\` bit 1, `+` bit 2 of lo[b & 15] & hi[b >> 4]. */
static const uint8_t ESCAPE_LO[16] = {0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 4, 2, 0, 0, 0};
static const uint8_t ESCAPE_HI[16] = {0, 0, 5, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
#define ESCAPE_BITS 3
#define ALPHA_BITS 0xF8  /* (the alphabet's classes: the five bits above the escapes') */

static inline int finish(int flags, const uint8_t *seen, int size) {
    unsigned any = 0;
    for (int i = 0; i < size; i++)
        any |= seen[i];
    return flags | ESCAPES | (int)((any & 7) << 2);
}

/* Each pass classifies a 64-byte block with one pair of nibble lookups (the alphabet's
 * bits and the escapes'), and for the literals two more on the same nibbles: byte k of a
 * literal's pair (its first two bytes, or its second and third where those are rarer in
 * text: `place_pairs`). A pair may begin at i where byte i is a first byte and i + 1 a
 * second of the same bucket: the first lookup is shifted by one byte against the second
 * (the block before's carried in), so that bit j of the block's answer is a pair that may
 * begin at j - 1, its literal there or one byte before ("Teddy", as Hyperscan's literal
 * matcher does it). Nothing is loaded twice and no nibble is taken twice. A third lookup
 * (the first three bytes, until session 25) cost more than the positions it drops: about
 * half the literals' share of the pass on prose, on AVX2. */

/* -- 32 bytes a vector (AVX2) ------------------------------------------------------------ */

/* Bytes b where (lo[b & 15] & hi[b >> 4]) is not zero: that value, else 0. */
__attribute__((target("avx2")))
static inline __m256i lookup(__m256i bytes, __m256i lo, __m256i hi) {
    __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256i l = _mm256_shuffle_epi8(lo, _mm256_and_si256(bytes, nibble));
    __m256i h = _mm256_shuffle_epi8(hi, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble));
    return _mm256_and_si256(l, h);
}

/* The same on nibbles already taken. */
__attribute__((target("avx2")))
static inline __m256i classes(__m256i low, __m256i high, __m256i lo, __m256i hi) {
    return _mm256_and_si256(_mm256_shuffle_epi8(lo, low), _mm256_shuffle_epi8(hi, high));
}

__attribute__((target("avx2")))
static inline __m256i table(const uint8_t t[16]) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
}

/* Bytes of `cur` moved up by one (the last of `prev` in front). */
__attribute__((target("avx2")))
static inline __m256i after1(__m256i prev, __m256i cur) {
    return _mm256_alignr_epi8(cur, _mm256_permute2x128_si256(prev, cur, 0x21), 15);
}

__attribute__((target("avx2")))
static inline uint32_t nonzero(__m256i v) {
    return ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_setzero_si256()));
}

__attribute__((target("avx2"))) __attribute__((always_inline))
static inline int pass_avx2(const GateObject *g, const uint8_t *data, Py_ssize_t n,
                            int segment, int teddy) {
    const __m256i clo = table(g->cls_lo), chi = table(g->cls_hi);
    const __m256i alphabet = _mm256_set1_epi8((char)ALPHA_BITS);
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    const __m256i lo0 = table(g->lo[0]), hi0 = table(g->hi[0]);
    const __m256i lo1 = table(g->lo[1]), hi1 = table(g->hi[1]);
    __m256i seen = _mm256_setzero_si256(), first = seen;
    int literals = teddy && g->count > 0, flags = 0;
    uint64_t carry = 0, kept = 0;
    uint8_t tail[64], buckets[64];
    for (Py_ssize_t p = 0; p < n; p += 64) {
        const uint8_t *block = padded(data + p, n - p, tail);
        __m256i a = _mm256_loadu_si256((const __m256i *)block);
        __m256i b = _mm256_loadu_si256((const __m256i *)(block + 32));
        __m256i alow = _mm256_and_si256(a, nibble);
        __m256i ahigh = _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble);
        __m256i blow = _mm256_and_si256(b, nibble);
        __m256i bhigh = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
        __m256i ca = classes(alow, ahigh, clo, chi), cb = classes(blow, bhigh, clo, chi);
        seen = _mm256_or_si256(seen, _mm256_or_si256(ca, cb));
        uint64_t alpha = nonzero(_mm256_and_si256(ca, alphabet)) |
                         ((uint64_t)nonzero(_mm256_and_si256(cb, alphabet)) << 32);
        if (n - p < 64)
            alpha &= (((uint64_t)1) << (n - p)) - 1;
        if (literals) {
            __m256i fa = classes(alow, ahigh, lo0, hi0), fb = classes(blow, bhigh, lo0, hi0);
            __m256i ea = _mm256_and_si256(classes(alow, ahigh, lo1, hi1), after1(first, fa));
            __m256i eb = _mm256_and_si256(classes(blow, bhigh, lo1, hi1), after1(fa, fb));
            first = fb;
            __m256i either = _mm256_or_si256(ea, eb);
            if (!_mm256_testz_si256(either, either)) {  /* (most blocks: no pair kept) */
                uint64_t ends = nonzero(ea) | ((uint64_t)nonzero(eb) << 32);
                _mm256_storeu_si256((__m256i *)buckets, ea);
                _mm256_storeu_si256((__m256i *)(buckets + 32), eb);
                if (literal_in(g, data, n, p - 1, ends, buckets, &kept)) {
                    flags |= LITERAL;
                    literals = 0;  /* (answered: only the run is still asked) */
                } else if (kept > (uint64_t)(KEPT_FREE + (p >> KEPT_SHIFT))) {
                    return flags | UNDECIDED;
                }
            }
        }
        if (run_in(alpha, &carry, segment))
            return flags | RUN;
    }
    uint8_t bytes[32];
    _mm256_storeu_si256((__m256i *)bytes, seen);
    return finish(flags, bytes, 32);
}

__attribute__((target("avx2")))
static int scan_avx2(const GateObject *g, const uint8_t *data, Py_ssize_t n) {
    /* (each pass made for its case: the run's shifts unrolled, the run alone with no
     * literal's table in a register) */
    if (g->segment == SEGMENT)
        return g->count ? pass_avx2(g, data, n, SEGMENT, 1) : pass_avx2(g, data, n, SEGMENT, 0);
    return pass_avx2(g, data, n, g->segment, 1);
}

/* -- 64 bytes a vector (AVX-512 BW) ------------------------------------------------------ */

__attribute__((target("avx512f,avx512bw")))
static inline __m512i classes512(__m512i low, __m512i high, __m512i lo, __m512i hi) {
    return _mm512_and_si512(_mm512_shuffle_epi8(lo, low), _mm512_shuffle_epi8(hi, high));
}

__attribute__((target("avx512f,avx512bw")))
static inline __m512i table512(const uint8_t t[16]) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)t));
}

__attribute__((target("avx512f,avx512bw")))
static inline __m512i after512_1(__m512i prev, __m512i cur) {
    return _mm512_alignr_epi8(cur, _mm512_alignr_epi64(cur, prev, 6), 15);
}

__attribute__((target("avx512f,avx512bw"))) __attribute__((always_inline))
static inline int pass_avx512(const GateObject *g, const uint8_t *data, Py_ssize_t n,
                            int segment, int teddy) {
    const __m512i clo = table512(g->cls_lo), chi = table512(g->cls_hi);
    const __m512i alphabet = _mm512_set1_epi8((char)ALPHA_BITS);
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i lo0 = table512(g->lo[0]), hi0 = table512(g->hi[0]);
    const __m512i lo1 = table512(g->lo[1]), hi1 = table512(g->hi[1]);
    __m512i seen = _mm512_setzero_si512(), first = seen;
    int literals = teddy && g->count > 0, flags = 0;
    uint64_t carry = 0, kept = 0;
    uint8_t tail[64], buckets[64];
    for (Py_ssize_t p = 0; p < n; p += 64) {
        const uint8_t *block = padded(data + p, n - p, tail);
        __m512i a = _mm512_loadu_si512((const void *)block);
        __m512i low = _mm512_and_si512(a, nibble);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble);
        __m512i c = classes512(low, high, clo, chi);
        seen = _mm512_or_si512(seen, c);
        uint64_t alpha = (uint64_t)_mm512_test_epi8_mask(c, alphabet);
        if (n - p < 64)
            alpha &= (((uint64_t)1) << (n - p)) - 1;
        if (literals) {
            __m512i f = classes512(low, high, lo0, hi0);
            __m512i e = _mm512_and_si512(classes512(low, high, lo1, hi1), after512_1(first, f));
            first = f;
            uint64_t ends = (uint64_t)_mm512_test_epi8_mask(e, e);
            if (ends) {
                _mm512_storeu_si512((void *)buckets, e);
                if (literal_in(g, data, n, p - 1, ends, buckets, &kept)) {
                    flags |= LITERAL;
                    literals = 0;
                } else if (kept > (uint64_t)(KEPT_FREE + (p >> KEPT_SHIFT))) {
                    return flags | UNDECIDED;
                }
            }
        }
        if (run_in(alpha, &carry, segment))
            return flags | RUN;
    }
    uint8_t bytes[64];
    _mm512_storeu_si512((void *)bytes, seen);
    return finish(flags, bytes, 64);
}

__attribute__((target("avx512f,avx512bw")))
static int scan_avx512(const GateObject *g, const uint8_t *data, Py_ssize_t n) {
    if (g->segment == SEGMENT)
        return g->count ? pass_avx512(g, data, n, SEGMENT, 1)
                        : pass_avx512(g, data, n, SEGMENT, 0);
    return pass_avx512(g, data, n, g->segment, 1);
}

static int scan(const GateObject *g, const uint8_t *data, Py_ssize_t n) {
    return g->wide ? scan_avx512(g, data, n) : scan_avx2(g, data, n);
}

static int partition(const uint8_t member[256], uint8_t lo[16], uint8_t hi[16]) {
    /* Tables with (lo[b & 15] & hi[b >> 4]) != 0 exactly for the members: each high
     * nibble's set of low nibbles gets a bit (at most 8 distinct sets). The bits used,
     * or -1. */
    uint16_t sets[8];
    int used = 0;
    memset(lo, 0, 16);
    memset(hi, 0, 16);
    for (int h = 0; h < 16; h++) {
        uint16_t set = 0;
        for (int l = 0; l < 16; l++)
            if (member[h * 16 + l])
                set |= (uint16_t)(1u << l);
        if (!set)
            continue;
        int bit = -1;
        for (int i = 0; i < used; i++)
            if (sets[i] == set)
                bit = i;
        if (bit < 0) {
            if (used == 8)
                return -1;
            bit = used;
            sets[used++] = set;
        }
        hi[h] |= (uint8_t)(1u << bit);
        for (int l = 0; l < 16; l++)
            if (set & (1u << l))
                lo[l] |= (uint8_t)(1u << bit);
    }
    return used;
}

/* How often a byte is in ordinary text (letters as a caseless literal holds them, in
 * lowercase): the prefilter looks for the rarer of a literal's two first pairs, so that
 * prose and code keep few positions (`eyJ`: `yJ`, not `ey` as in "they"). */
static int commonness(uint8_t c) {
    if ((c >= 'a' && c <= 'z') || (c != 0 && strchr(" \n\",.:/_-=", c) != NULL))
        return 4;
    return c >= '0' && c <= '9' ? 2 : 1;
}

/* Buckets for the literals' pairs: one a pair where there are at most BUCKETS of them,
 * else one a pair's first byte (`AK`, `AP`, `Ac` in one: no cross product but those of
 * the nibbles), then in turn; and the nibble tables of each pair's two bytes (both cases
 * of a caseless literal's letters). */
static void place_pairs(GateObject *g) {
    int pairs = 0;
    for (int i = 0; i < g->count; i++) {
        int seen = 0;
        for (int j = 0; j < i && !seen; j++)
            seen = g->offset[j] == g->offset[i] && g->caseless[j] == g->caseless[i] &&
                   memcmp(g->text[j] + g->offset[j], g->text[i] + g->offset[i], 2) == 0;
        pairs += !seen;
    }
    int width = pairs > BUCKETS ? 1 : 2, buckets = 0;
    for (int i = 0; i < g->count; i++) {
        const uint8_t *pair = (const uint8_t *)g->text[i] + g->offset[i];
        int bucket = -1;
        for (int j = 0; j < i && bucket < 0; j++)
            if (g->offset[j] == g->offset[i] && g->caseless[j] == g->caseless[i] &&
                    memcmp(g->text[j] + g->offset[j], pair, (size_t)width) == 0)
                bucket = g->bucket[j];
        if (bucket < 0)
            bucket = buckets++ % BUCKETS;
        g->bucket[i] = (uint8_t)bucket;
        g->at_offset[g->offset[i]] |= (uint8_t)(1u << bucket);
        for (int k = 0; k < 2; k++) {
            uint8_t variants[2] = {pair[k], pair[k]};
            if (g->caseless[i] && pair[k] >= 'a' && pair[k] <= 'z')
                variants[1] = (uint8_t)(pair[k] - 32);
            for (int v = 0; v < 2; v++) {
                g->lo[k][variants[v] & 15] |= (uint8_t)(1u << bucket);
                g->hi[k][variants[v] >> 4] |= (uint8_t)(1u << bucket);
            }
        }
    }
}

static void gate_dealloc(GateObject *self) {
    for (int i = 0; i < self->count; i++)
        PyMem_Free(self->text[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int gate_init(GateObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"alphabet", "segment", "literals", "wide", NULL};
    Py_buffer alphabet;
    int segment, wide = -1;
    PyObject *literals;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*iO|p", names, &alphabet, &segment,
                                     &literals, &wide))
        return -1;
    for (int i = 0; i < self->count; i++)  /* (__init__ called again) */
        PyMem_Free(self->text[i]);
    self->count = 0;
    memset(self->lo, 0, sizeof self->lo);
    memset(self->hi, 0, sizeof self->hi);
    memset(self->prefixes, 0, sizeof self->prefixes);
    memset(self->at_offset, 0, sizeof self->at_offset);
    uint8_t member[256] = {0};
    for (Py_ssize_t i = 0; i < alphabet.len; i++)
        member[((const uint8_t *)alphabet.buf)[i]] = 1;
    PyBuffer_Release(&alphabet);
    if (!have_avx2 || (wide == 1 && !have_avx512)) {
        PyErr_SetString(PyExc_ValueError, wide == 1 ? "this CPU has no AVX-512 BW"
                                                    : "this CPU has no AVX2");
        return -1;
    }
    self->wide = wide;  /* (-1: chosen below, once the literals are known) */
    uint8_t alpha_lo[16], alpha_hi[16];
    int classes = partition(member, alpha_lo, alpha_hi);
    if (segment < 1 || segment > 64 || classes < 0 || classes > 8 - ESCAPE_BITS) {
        PyErr_SetString(PyExc_ValueError, "segment must be 1 to 64, the alphabet 5 classes");
        return -1;
    }
    for (int k = 0; k < 16; k++) {  /* (the escapes' bits below the alphabet's) */
        self->cls_lo[k] = (uint8_t)(ESCAPE_LO[k] | alpha_lo[k] << ESCAPE_BITS);
        self->cls_hi[k] = (uint8_t)(ESCAPE_HI[k] | alpha_hi[k] << ESCAPE_BITS);
    }
    self->segment = segment;
    PyObject *seq = PySequence_Fast(literals, "literals must be a sequence");
    if (seq == NULL)
        return -1;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    if (count > MAX_LITERALS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "more than 64 literals");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        const char *bytes;
        Py_ssize_t len;
        int caseless;
        if (!PyArg_ParseTuple(item, "y#p", &bytes, &len, &caseless)) {
            Py_DECREF(seq);
            return -1;
        }
        if (len < 3 || len > 255) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "a literal must have 3 to 255 bytes");
            return -1;
        }
        char *copy = PyMem_Malloc((size_t)len);
        if (copy == NULL) {
            Py_DECREF(seq);
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t k = 0; k < len; k++)
            copy[k] = (char)(caseless ? lower((uint8_t)bytes[k]) : (uint8_t)bytes[k]);
        self->text[i] = copy;
        self->length[i] = (uint8_t)len;
        self->caseless[i] = (uint8_t)caseless;
        self->count = (int)i + 1;
        unsigned h = prefix_hash(lower((uint8_t)copy[0]), lower((uint8_t)copy[1]),
                                 lower((uint8_t)copy[2]));
        self->prefixes[h / 64] |= (uint64_t)1 << (h % 64);
        const uint8_t *w = (const uint8_t *)copy;
        self->offset[i] = (uint8_t)(commonness(w[1]) + commonness(w[2]) <
                                    commonness(w[0]) + commonness(w[1]));
    }
    Py_DECREF(seq);
    place_pairs(self);
    /* By default 64 bytes a vector where there are literals: the prefilter's lookups and
     * loads halve (0.011 ms/MiB over the run alone, against 0.026 at 32). The
     * run alone measured a tenth faster at 32 (0.058-0.066 against 0.064-0.071 ms/MiB on
     * this project's AMD EPYC, family 26; why, not analysed). */
    if (self->wide == -1)
        self->wide = have_avx512 && self->count > 0;
    return 0;
}

#define SEAM 255  /* the most bytes of a stream before a piece (`flags`'s `before`) */

static PyObject *gate_flags(GateObject *self, PyObject *const *args, Py_ssize_t nargs) {
    /* flags(text[, before]): `before`, the end of a stream before `text` (a piece of it):
     * also what crosses from it into the piece, read with the piece's first bytes
     * (fastscan.ChunkPass: one call a piece, no slice or join). */
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "flags(text[, before])");
        return NULL;
    }
    Py_buffer view, before;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    before.len = 0;
    if (nargs == 2 && PyObject_GetBuffer(args[1], &before, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (before.len > SEAM) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&before);
        PyErr_SetString(PyExc_ValueError, "before: 255 bytes at most");
        return NULL;
    }
    int flags;
    if (view.len > 64 * 1024) {  /* (long texts: other threads run meanwhile) */
        Py_BEGIN_ALLOW_THREADS
        flags = scan(self, (const uint8_t *)view.buf, view.len);
        Py_END_ALLOW_THREADS
    } else {
        flags = scan(self, (const uint8_t *)view.buf, view.len);
    }
    const uint8_t *text = (const uint8_t *)view.buf;
    if (view.len == 0 || (text[0] < 0xFE && !memchr(text, 0, view.len < 4 ? (size_t)view.len : 4)))
        flags |= UNMARKED;
    if (before.len && !(flags & RUN)) {  /* the seam: `before` and as much of the text */
        uint8_t seam[2 * SEAM];
        Py_ssize_t take = view.len < before.len ? view.len : before.len;
        memcpy(seam, before.buf, (size_t)before.len);
        memcpy(seam + before.len, view.buf, (size_t)take);
        flags |= scan(self, seam, before.len + take) & (RUN | LITERAL);
    }
    if (nargs == 2)
        PyBuffer_Release(&before);
    PyBuffer_Release(&view);
    return PyLong_FromLong(flags);
}

static PyObject *gate_runs_clean(GateObject *self, PyObject *arg);

static PyMethodDef gate_methods[] = {
    {"flags", (PyCFunction)(void (*)(void))gate_flags, METH_FASTCALL,
     "flags(text[, before]): RUN | LITERAL (and the escapes) as found in a bytes-like "
     "object, and across from `before` into it (see the module docstring)."},
    {"runs_clean", (PyCFunction)gate_runs_clean, METH_O,
     "runs_clean(text): True where every run decoding.runs reads in a bytes-like text "
     "decodes to nothing this gate finds (see runs_clean below); False: look."},
    {NULL, NULL, 0, NULL},
};

/* -- key_run: the exact check behind a RUN ------------------------------------------------
 * `decoding.runs` decodes a maximal run of the base64 alphabets (A-Z a-z 0-9 + / _ -) of
 * `KEY_SEGMENT` characters or more only where it holds both an upper and a lower case
 * letter (base64 of random bytes), or `KEY_HEX` characters in a row of one case's hex
 * digits: a path, a snake_case name, a long word is one case and no hex, and is not read
 * further. In Python that is a few microseconds a run, and a body of code holds hundreds
 * of runs of names; here it is one pass. True where `runs` may yield (a mixed-case run
 * longer than 1,024 characters whose length leaves no decodable alignment is also
 * True: `runs` then says no), False only where it yields nothing
 * (tests/core/dlp/test_dlp_gate_native.py holds it to `runs` on random texts). Scalar: a
 * probe every `KEY_SEGMENT` bytes (a run that long holds one); only the runs under a
 * probe are read, about half the bytes of code. `key_runs` lists them all: `runs` reads
 * those only. */

#define KEY_SEGMENT 20
#define KEY_HEX 32
#define K_ALPHA 1
#define K_UPPER 2
#define K_LOWER 4
#define K_HEXL 8
#define K_HEXU 16
static uint8_t key_class[256];

static void key_classes(void) {
    for (int c = 0; c < 256; c++) {
        uint8_t k = 0;
        if (c >= 'A' && c <= 'Z')
            k = K_ALPHA | K_UPPER | (c <= 'F' ? K_HEXU : 0);
        else if (c >= 'a' && c <= 'z')
            k = K_ALPHA | K_LOWER | (c <= 'f' ? K_HEXL : 0);
        else if (c >= '0' && c <= '9')
            k = K_ALPHA | K_HEXL | K_HEXU;
        else if (c == '+' || c == '/' || c == '_' || c == '-')
            k = K_ALPHA;
        key_class[c] = k;
    }
}

/* The next run from `i` (0, or just past a byte out of the alphabet) that `runs` may
 * decode: 1 with its bounds in `*start` and `*end`, or 0. */
static int key_run_next(const uint8_t *p, Py_ssize_t n, Py_ssize_t i, Py_ssize_t *start,
                        Py_ssize_t *end) {
    while (i + KEY_SEGMENT <= n) {
        if (!(key_class[p[i + KEY_SEGMENT - 1]] & K_ALPHA)) {
            i += KEY_SEGMENT;  /* no run of KEY_SEGMENT begins in [i, i + KEY_SEGMENT) */
            continue;
        }
        Py_ssize_t s = i + KEY_SEGMENT - 1, e;
        while (s > i && (key_class[p[s - 1]] & K_ALPHA))
            s--;
        unsigned seen = 0;
        int hexl = 0, hexu = 0, hex = 0;
        uint8_t k;
        for (e = s; e < n && ((k = key_class[p[e]]) & K_ALPHA); e++) {
            seen |= k;
            hexl = k & K_HEXL ? hexl + 1 : 0;
            hexu = k & K_HEXU ? hexu + 1 : 0;
            hex |= hexl >= KEY_HEX || hexu >= KEY_HEX;
        }
        if (hex || (e - s >= KEY_SEGMENT &&
                    (seen & (K_UPPER | K_LOWER)) == (K_UPPER | K_LOWER))) {
            *start = s;
            *end = e;
            return 1;
        }
        i = e + 1;
    }
    return 0;
}

static PyObject *key_run(PyObject *module, PyObject *arg) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t s, e;
    int found;
    if (view.len > 64 * 1024) {
        Py_BEGIN_ALLOW_THREADS
        found = key_run_next((const uint8_t *)view.buf, view.len, 0, &s, &e);
        Py_END_ALLOW_THREADS
    } else {
        found = key_run_next((const uint8_t *)view.buf, view.len, 0, &s, &e);
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(found);
}

static PyObject *key_runs(PyObject *module, PyObject *arg) {
    /* key_runs(text): the bounds of every run `runs` may decode, in order. */
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    Py_ssize_t i = 0, s, e;
    while (out != NULL && key_run_next((const uint8_t *)view.buf, view.len, i, &s, &e)) {
        PyObject *bounds = Py_BuildValue("(nn)", s, e);
        if (bounds == NULL || PyList_Append(out, bounds) < 0)
            Py_CLEAR(out);
        Py_XDECREF(bounds);
        i = e + 1;
    }
    PyBuffer_Release(&view);
    return out;
}

/* -- runs_clean: the runs `decoding.runs` reads, decoded and gated, in one call ----------
 * What `Scanner._decoded` does for a text in Python (the runs of each stretch `key_runs`
 * lists, `decoding.runs_at`: one-case hex whole, else each 32 or more hex digits of one
 * case inside it from its first and second digit, then a mixed-case stretch as base64
 * from its first character, and its second to fourth where it is 1,024 or shorter; each
 * decoded, and kept where its bytes hold something to read further), for the common
 * answer: every run decodes to fewer than MIN_DECODED bytes, or to bytes in which this
 * gate (the scanner's: the anchors of rules that need no run, and runs) finds no RUN and
 * no LITERAL: nothing a detector finds there (a rule that needs no run has one of the
 * gate's anchors; every match of any other rule holds a run) and no run to decode again.
 * A W3C trace id or a tool call id is read here in a fraction of a microsecond. A run
 * decoding to more than MAX_DECODED bytes, or to bytes the gate finds something in, makes
 * it answer 0, "look": the Python reading decides (tests/core/dlp/test_dlp_gate_native.py
 * holds it to the scan of every run's decoded text, `Scanner.decoded`). */

#define MIN_DECODED 12
#define MAX_SHIFTED 1024
#define MAX_DECODED 3072  /* bytes: a run decoding to more is Python's to read */

static int hex_value(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int b64_value(uint8_t c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    return -1;
}

/* Whether data holds an escape a JSON reader reads a character out of (\uXXXX, \/):
 * decoded bytes are read with them undone too (`prefilter.holds_json_escape`). */
static int json_escape_in(const uint8_t *data, Py_ssize_t n) {
    const uint8_t *p = data, *end = data + n;
    while ((p = memchr(p, '\\', (size_t)(end - p))) != NULL && p + 1 < end) {
        if (p[1] == '/')
            return 1;
        if (p[1] == 'u' && end - p >= 6 && hex_value(p[2]) >= 0 && hex_value(p[3]) >= 0 &&
            hex_value(p[4]) >= 0 && hex_value(p[5]) >= 0)
            return 1;
        p++;
    }
    return 0;
}

static Py_ssize_t local_best(const uint8_t *p, Py_ssize_t n, Py_ssize_t i);

/* Whether data starts as a compressed file does (`archives.archive_kind`: gzip, bzip2,
 * xz, zstd, or a zstd skippable frame), or holds a zip's local header anywhere
 * (`zip_entries.holds_files`: an image that is also a zip): a decoded run that does is
 * unpacked (`archive_views`). */
static int archive_start(const uint8_t *d, Py_ssize_t n) {
    return local_best(d, n, 0) >= 0 ||
           (n >= 3 && d[0] == 0x1f && d[1] == 0x8b && d[2] == 8) ||
           (n >= 3 && d[0] == 'B' && d[1] == 'Z' && d[2] == 'h') ||
           (n >= 4 && d[0] == 0x28 && d[1] == 0xb5 && d[2] == 0x2f && d[3] == 0xfd) ||
           (n >= 4 && (d[0] & 0xf0) == 0x50 && d[1] == 0x2a && d[2] == 0x4d && d[3] == 0x18) ||
           (n >= 6 && memcmp(d, "\xfd" "7zXZ\0", 6) == 0);
}

/* 1: decoded bytes (MIN_DECODED to MAX_DECODED of them) in which this gate finds
 * nothing (see above), that hold no JSON escape and are no compressed file; 0: look. */
static int decoded_clean(const GateObject *g, const uint8_t *data, Py_ssize_t n) {
    return !(scan(g, data, n) & (RUN | LITERAL | UNDECIDED)) && !json_escape_in(data, n) &&
           !archive_start(data, n);
}

/* The hex run p[lo:hi] (its even part), decoded and gated. */
static int hex_clean(const GateObject *g, const uint8_t *p, Py_ssize_t lo, Py_ssize_t hi) {
    Py_ssize_t n = (hi - lo) / 2;
    if (n < MIN_DECODED)
        return 1;
    if (n > MAX_DECODED)
        return 0;
    uint8_t out[MAX_DECODED];
    for (Py_ssize_t k = 0; k < n; k++)
        out[k] = (uint8_t)(hex_value(p[lo + 2 * k]) << 4 | hex_value(p[lo + 2 * k + 1]));
    return decoded_clean(g, out, n);
}

/* The base64 run p[lo:end] (its padding left off; length mod 4 is not 1), decoded and
 * gated (`decoding.decode_run`: the URL alphabet read as the standard one). */
static int b64_clean(const GateObject *g, const uint8_t *p, Py_ssize_t lo, Py_ssize_t end) {
    Py_ssize_t size = end - lo;
    Py_ssize_t n = size / 4 * 3 + (size % 4 ? size % 4 - 1 : 0);
    if (n < MIN_DECODED)
        return 1;
    if (n > MAX_DECODED)
        return 0;
    uint8_t out[MAX_DECODED + 2];
    Py_ssize_t o = 0;
    uint32_t bits = 0;
    int have = 0;
    for (Py_ssize_t i = lo; i < end; i++) {
        bits = bits << 6 | (uint32_t)b64_value(p[i]);
        have += 6;
        if (have >= 8) {
            have -= 8;
            out[o++] = (uint8_t)(bits >> have);
        }
    }
    return decoded_clean(g, out, o < n ? o : n);
}

static int lower_hex(uint8_t c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }
static int upper_hex(uint8_t c) { return (c >= '0' && c <= '9') || (c >= 'A' && c <= 'F'); }

/* 1: every run `runs_at` reads in the stretch p[s:e] is clean; 0: look. As `runs_at`:
 * a stretch of one case that is hex of even length, whole (and nothing else); else the
 * hex inside it (`_HEX_INSIDE.finditer`: at each place the run of lower-case hex digits,
 * else of upper-case ones, of 32 or more, from its first and its second digit; the
 * search goes on after it), then a mixed-case stretch as base64. */
static int stretch_clean(const GateObject *g, const uint8_t *p, Py_ssize_t s, Py_ssize_t e) {
    Py_ssize_t size = e - s, i, j;
    int has_lower = 0, has_upper = 0;
    for (i = s; i < e; i++) {
        has_lower |= p[i] >= 'a' && p[i] <= 'z';
        has_upper |= p[i] >= 'A' && p[i] <= 'Z';
    }
    int mixed = has_lower && has_upper;
    if (!mixed) {
        int (*digit)(uint8_t) = has_upper ? upper_hex : lower_hex;
        for (i = s; i < e && digit(p[i]); i++) {}
        if (i == e && size >= KEY_HEX && size % 2 == 0)
            return hex_clean(g, p, s, e);
    }
    /* (`lower`, `upper`: where the run of each case's digits holding i ends, found once
     * per run: linear in a stretch made of runs of 31 digits) */
    Py_ssize_t lower = s, upper = s;
    for (i = s; i < e;) {
        if (lower <= i)
            for (lower = i; lower < e && lower_hex(p[lower]); lower++) {}
        j = lower;
        if (j - i < KEY_HEX) {
            if (upper <= i)
                for (upper = i; upper < e && upper_hex(p[upper]); upper++) {}
            j = upper;
        }
        if (j - i < KEY_HEX) {
            i++;
            continue;
        }
        for (int shift = 0; shift < 2; shift++)  /* (an odd last digit: left off) */
            if (j - i - shift >= KEY_HEX && !hex_clean(g, p, i + shift, j))
                return 0;
        i = j;
    }
    if (!mixed)
        return 1;
    for (int shift = 0; shift < (size <= MAX_SHIFTED ? 4 : 1); shift++) {
        Py_ssize_t left = size - shift;
        if (left >= KEY_SEGMENT && !b64_clean(g, p, s + shift, left % 4 == 1 ? e - 1 : e))
            return 0;  /* (one past a whole group: cut, as `runs_at` reads it) */
    }
    return 1;
}

static PyObject *gate_runs_clean(GateObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = view.buf;
    Py_ssize_t n = view.len, i = 0, s, e;
    int clean = 1;
    while (clean && key_run_next(p, n, i, &s, &e)) {
        clean = stretch_clean(self, p, s, e);
        i = e + 1;
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(clean);
}

/* -- wrapped: base64 written in lines, for the leak guard (`core/leak_lines.py`) ---------
 * A line break is "\n" or "\r\n", as the bytes are or JSON-escaped ("\\n", "\\r\\n"); a
 * block is a line of WRAP_LINE or more characters of the base64 alphabets, a break, the
 * next line, and on while the line before each break is that long (a short line after a
 * single line only where that line's length is a multiple of 4). (start, end) of each
 * block. Most breaks are after a word or a bracket: a few bytes looked at each. */

#define WRAP_LINE 20

static Py_ssize_t break_after(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) {
    /* The length of the line break at p[i] (0: none). */
    if (i < n && p[i] == '\n')
        return 1;
    if (i + 1 < n && p[i] == '\r' && p[i + 1] == '\n')
        return 2;
    if (i + 1 < n && p[i] == '\\' && p[i + 1] == 'n')
        return 2;
    if (i + 3 < n && p[i] == '\\' && p[i + 1] == 'r' && p[i + 2] == '\\' && p[i + 3] == 'n')
        return 4;
    return 0;
}

static Py_ssize_t line_end(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) {
    while (i < n && (key_class[p[i]] & K_ALPHA))
        i++;
    return i;
}

/* The block whose first line ends at `at` (a line break starts there), if that line
 * holds WRAP_LINE alphabet characters after `reach`: 1 with its bounds, else 0. */
static int block_at(const uint8_t *p, Py_ssize_t n, Py_ssize_t at, Py_ssize_t reach,
                    Py_ssize_t *bs, Py_ssize_t *be) {
    if (break_after(p, n, at) == 0)
        return 0;
    Py_ssize_t start = at;
    while (start > reach && (key_class[p[start - 1]] & K_ALPHA) &&
           !(start - 2 >= reach && p[start - 2] == '\\' &&
             (p[start - 1] == 'n' || p[start - 1] == 'r')))
        start--;  /* (a line starts after a break, an escaped one's letter not its own) */
    if (at - start < WRAP_LINE)
        return 0;
    Py_ssize_t end = at, line = at - start, step;
    int lines = 1;
    while (line >= WRAP_LINE && (step = break_after(p, n, end)) > 0) {
        Py_ssize_t next = line_end(p, n, end + step);
        if (next == end + step || (next - end - step < WRAP_LINE && lines == 1 && line % 4))
            break;  /* (no line; or a short one after a single line of a width no encoder
                     * writes: a name and the next, not a block: `decoding.wrapped`) */
        line = next - end - step;
        end = next;
        lines++;
    }
    if (end == at)
        return 0;
    *bs = start;
    *be = end;
    return 1;
}

/* (start, end) appended to `out`: 0, or -1 with the error set. */
static int append_bounds(PyObject *out, Py_ssize_t start, Py_ssize_t end) {
    PyObject *bounds = Py_BuildValue("(nn)", start, end);
    int failed = bounds == NULL || PyList_Append(out, bounds) < 0;
    Py_XDECREF(bounds);
    return failed ? -1 : 0;
}

static uint8_t wrap_lo[16], wrap_hi[16];  /* the alphabets' nibble tables (key_class) */

/* Where a line break may start after WRAP_LINE alphabet characters, 64 bytes a step:
 * bit j of a block's mask is a byte in "\n\r\\" with the WRAP_LINE bytes before it in
 * the alphabets (a run carried in from the blocks before: `tail`). Most blocks of code
 * or prose have none: a break after a word, a bracket, an indent. */
__attribute__((target("avx2")))
static int wrapped_avx2(const uint8_t *p, Py_ssize_t n, PyObject *out) {
    const __m256i alo = table(wrap_lo), ahi = table(wrap_hi);
    const __m256i nl = _mm256_set1_epi8('\n'), cr = _mm256_set1_epi8('\r'),
                  bs = _mm256_set1_epi8('\\');
    uint8_t tailbuf[64 + 2 + 64];
    uint64_t tail = 0;  /* alphabet bytes in a row before the block */
    Py_ssize_t reach = 0;
    for (Py_ssize_t q = 0; q < n; q += 64) {
        const uint8_t *block = padded(p + q, n - q, tailbuf);
        __m256i a0 = _mm256_loadu_si256((const __m256i *)block);
        __m256i a1 = _mm256_loadu_si256((const __m256i *)(block + 32));
        uint64_t alpha = nonzero(lookup(a0, alo, ahi)) |
                         ((uint64_t)nonzero(lookup(a1, alo, ahi)) << 32);
        uint64_t brk = (uint32_t)_mm256_movemask_epi8(_mm256_or_si256(
                           _mm256_or_si256(_mm256_cmpeq_epi8(a0, nl), _mm256_cmpeq_epi8(a0, cr)),
                           _mm256_cmpeq_epi8(a0, bs))) |
                       ((uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_or_si256(
                           _mm256_or_si256(_mm256_cmpeq_epi8(a1, nl), _mm256_cmpeq_epi8(a1, cr)),
                           _mm256_cmpeq_epi8(a1, bs))) << 32);
        if (n - q < 64) {
            uint64_t inside = (((uint64_t)1) << (n - q)) - 1;
            alpha &= inside;
            brk &= inside;
        }
        uint64_t r = alpha;  /* bit i: the WRAP_LINE (20) bytes up to i in the alphabets */
        r &= r << 1;
        r &= r << 2;
        r &= r << 4;
        r &= r << 8;
        r &= r << 4;
        uint64_t cand = brk & (r << 1);
        /* (a run carried in from before: breaks at j in [lo, hi], bytes 0..j-1 in it) */
        uint64_t lead = alpha == ~(uint64_t)0 ? 64 : (uint64_t)__builtin_ctzll(~alpha);
        uint64_t lo = tail >= WRAP_LINE ? 0 : WRAP_LINE - tail;
        uint64_t hi = lead < WRAP_LINE ? lead : WRAP_LINE;
        if (lo <= hi)
            cand |= brk & ((((uint64_t)2) << hi) - 1) & ~((((uint64_t)1) << lo) - 1);
        tail = alpha == ~(uint64_t)0 ? tail + 64
                                     : (alpha ? (uint64_t)__builtin_clzll(~alpha) : 0);
        while (cand) {
            Py_ssize_t at = q + __builtin_ctzll(cand);
            cand &= cand - 1;
            Py_ssize_t s, e;
            if (at < reach || !block_at(p, n, at, reach, &s, &e))
                continue;
            if (append_bounds(out, s, e) < 0)
                return -1;
            reach = e;
            if (e >= q + 64) {  /* (the block went on past this step: resume after it) */
                q = (e / 64) * 64 - 64;  /* (the loop adds 64: the step holding e) */
                tail = 0;
                cand = 0;
            }
        }
    }
    return 0;
}

static PyObject *wrapped_blocks(PyObject *module, PyObject *arg) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = view.buf;
    Py_ssize_t n = view.len, reach = 0;
    PyObject *out = PyList_New(0);
    if (out != NULL && have_avx2) {
        if (wrapped_avx2(p, n, out) < 0)
            Py_CLEAR(out);
        PyBuffer_Release(&view);
        return out;
    }
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        uint8_t c = p[i];
        if (c != '\n' && c != '\r' && c != '\\')
            continue;
        Py_ssize_t s, e;
        if (!block_at(p, n, i, reach, &s, &e))
            continue;
        if (append_bounds(out, s, e) < 0)
            Py_CLEAR(out);
        reach = e;
        i = e - 1;
    }
    PyBuffer_Release(&view);
    return out;
}

/* -- key_blocks: the stretches and the blocks of lines among them, in one call ----------
 * What `decoding.wrapped(text, stretches, escaped=True, joins)` finds, for a text whose
 * stretches `key_runs` lists: a stretch touching a line break ("\n", "\r\n", or JSON's
 * "\\n", "\\r\\n"), the whole lines of WRAP_LINE alphabet characters before it, and
 * the lines after it while the one before is that long (a short line after a single
 * line only where that line is a multiple of 4 long), none crossing into a view that
 * starts at one of `joins`. Most texts: no stretch touches a break, nothing made in
 * Python (tests/core/dlp/test_dlp_run_reading.py holds it to `wrapped`). */

static int joined_at(const Py_ssize_t *joins, Py_ssize_t count, Py_ssize_t at) {
    Py_ssize_t lo = 0, hi = count;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (joins[mid] < at)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < count && joins[lo] == at;
}

static int whole_line(const uint8_t *p, Py_ssize_t a, Py_ssize_t b) {
    if (a >= b)
        return 0;
    for (Py_ssize_t i = a; i < b; i++)
        if (!(key_class[p[i]] & K_ALPHA))
            return 0;
    return 1;
}

/* Where the line before a break ending at `start` starts (a whole line of WRAP_LINE or
 * more after `reach`), or -1 (`decoding._line_before`). */
static Py_ssize_t line_before(const uint8_t *p, Py_ssize_t start, Py_ssize_t reach) {
    Py_ssize_t at = -1;
    if (start >= 1 && p[start - 1] == '\n') {
        at = start - 1;
        if (at > reach && p[at - 1] == '\r')
            at--;
    } else if (start >= 2 && p[start - 2] == '\\' && p[start - 1] == 'n') {
        at = start >= 4 && p[start - 4] == '\\' && p[start - 3] == 'r' ? start - 4 : start - 2;
    }
    if (at - WRAP_LINE < reach || !whole_line(p, at - WRAP_LINE, at))
        return -1;
    Py_ssize_t first = reach;  /* (after the last break before `at`: `line_start`) */
    for (Py_ssize_t i = at - 1; i >= reach; i--) {
        if (p[i] == '\n') {
            first = i + 1;
            break;
        }
        if (i + 1 < at && p[i] == '\\' && p[i + 1] == 'n') {
            first = i + 2;
            break;
        }
    }
    return whole_line(p, first, at) ? first : -1;
}

static PyObject *key_blocks(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "key_blocks(text, joins)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "joins must be a sequence");
    if (seq == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t *joins = count ? PyMem_Malloc((size_t)count * sizeof(Py_ssize_t)) : NULL;
    PyObject *runs = PyList_New(0), *blocks = PyList_New(0), *out = NULL;
    if ((count && joins == NULL) || runs == NULL || blocks == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < count; k++) {
        joins[k] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, k));
        if (joins[k] == -1 && PyErr_Occurred())
            goto done;
    }
    const uint8_t *p = view.buf;
    Py_ssize_t n = view.len, i = 0, s, e, reach = 0;
    while (key_run_next(p, n, i, &s, &e)) {
        if (append_bounds(runs, s, e) < 0)
            goto done;
        i = e + 1;
        uint8_t before = s ? p[s - 1] : 0, after = e < n ? p[e] : 0;
        if (after != '\r' && after != '\n' && after != '\\' && before != '\n' &&
            before != '\\')
            continue;  /* (most: no line break on either side) */
        Py_ssize_t start = s;
        if (before == '\\' && (p[s] == 'n' || p[s] == 'r'))
            start++;  /* (an escaped break's letter is not the line's) */
        if (start < reach)
            continue;
        int lines = 1;
        Py_ssize_t first;
        while (!joined_at(joins, count, start) && (first = line_before(p, start, reach)) >= 0) {
            start = first;
            lines = 2;
        }
        Py_ssize_t at = e, line = e - start, step;
        while (line >= WRAP_LINE && (step = break_after(p, n, at)) > 0) {
            Py_ssize_t next = line_end(p, n, at + step);
            if (next == at + step || joined_at(joins, count, at + step))
                break;
            if (next - at - step < WRAP_LINE && lines == 1 && line % 4)
                break;
            line = next - at - step;
            at = next;
            lines++;
        }
        if (at > e) {
            if (append_bounds(blocks, start, at) < 0)
                goto done;
            reach = at;
        }
    }
    out = PyTuple_Pack(2, runs, blocks);
done:
    PyMem_Free(joins);
    Py_XDECREF(runs);
    Py_XDECREF(blocks);
    Py_DECREF(seq);
    PyBuffer_Release(&view);
    return out;
}

/* -- local_header: where a zip entry's local header is ------------------------------------
 * `PK\3\4` is searched for in every request body (core/zip_entries.py: a zip read from
 * wherever its entries are, as unzip reads one after other bytes), so it costs what a
 * memchr does: 64 positions a step (128 with AVX-512), the first byte and the fourth
 * compared at once (the rest where both agree: in prose never, in random bytes one
 * position in 65,536).
 * CPython's `bytes.find` takes 0.5-0.9 ms a MiB for it (a loop a byte). */

static Py_ssize_t local_scalar(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) {
    for (; i + 4 <= n; i++)
        if (p[i] == 'P' && p[i + 3] == 4 && p[i + 1] == 'K' && p[i + 2] == 3)
            return i;
    return -1;
}

__attribute__((target("avx2")))
static Py_ssize_t local_avx2(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) {
    const __m256i first = _mm256_set1_epi8('P'), last = _mm256_set1_epi8(4);
    for (; i + 67 <= n; i += 64) {  /* (64 positions a step: one test for both halves) */
        __m256i a = _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(p + i)), first),
            _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(p + i + 3)), last));
        __m256i b = _mm256_and_si256(
            _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(p + i + 32)), first),
            _mm256_cmpeq_epi8(_mm256_loadu_si256((const __m256i *)(p + i + 35)), last));
        if (_mm256_testz_si256(_mm256_or_si256(a, b), _mm256_or_si256(a, b)))
            continue;
        uint64_t both = (uint32_t)_mm256_movemask_epi8(a) |
                        (uint64_t)(uint32_t)_mm256_movemask_epi8(b) << 32;
        while (both) {
            int at = __builtin_ctzll(both);
            if (p[i + at + 1] == 'K' && p[i + at + 2] == 3)
                return i + at;
            both &= both - 1;
        }
    }
    return local_scalar(p, n, i);
}

__attribute__((target("avx512f,avx512bw")))
static Py_ssize_t local_avx512(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) {
    const __m512i first = _mm512_set1_epi8('P'), last = _mm512_set1_epi8(4);
    for (; i + 131 <= n; i += 128) {
        __mmask64 a = _mm512_cmpeq_epi8_mask(_mm512_loadu_si512((const void *)(p + i)), first) &
                      _mm512_cmpeq_epi8_mask(_mm512_loadu_si512((const void *)(p + i + 3)), last);
        __mmask64 b = _mm512_cmpeq_epi8_mask(_mm512_loadu_si512((const void *)(p + i + 64)),
                                             first) &
                      _mm512_cmpeq_epi8_mask(_mm512_loadu_si512((const void *)(p + i + 67)),
                                             last);
        if (!(a | b))
            continue;
        for (int half = 0; half < 2; half++) {
            uint64_t both = half ? b : a;
            while (both) {
                int at = __builtin_ctzll(both) + 64 * half;
                if (p[i + at + 1] == 'K' && p[i + at + 2] == 3)
                    return i + at;
                both &= both - 1;
            }
        }
    }
    return local_avx2(p, n, i);
}

static Py_ssize_t local_best(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) {
    return have_avx512 ? local_avx512(p, n, i) : have_avx2 ? local_avx2(p, n, i)
                                                           : local_scalar(p, n, i);
}

static PyObject *local_header(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    /* local_header(data, start=0, width=<the CPU's>): the first offset >= start of
     * `PK\3\4`, or -1 (`width`: 64, 32 or 1 bytes a vector, for the tests). */
    (void)module;
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "local_header(data, start=0, width=None)");
        return NULL;
    }
    Py_ssize_t start = 0, width = have_avx512 ? 64 : have_avx2 ? 32 : 1;
    if (nargs >= 2 && (start = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred())
        return NULL;
    if (nargs == 3 && (width = PyLong_AsSsize_t(args[2])) == -1 && PyErr_Occurred())
        return NULL;
    if ((width == 64 && !have_avx512) || (width == 32 && !have_avx2)) {
        PyErr_SetString(PyExc_ValueError, "this CPU has no such width");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = (const uint8_t *)view.buf;
    Py_ssize_t at = start < 0 ? 0 : start;
    at = width == 64 ? local_avx512(p, view.len, at)
         : width == 32 ? local_avx2(p, view.len, at) : local_scalar(p, view.len, at);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(at);
}

static PyMethodDef module_methods[] = {
    {"key_run", key_run, METH_O,
     "key_run(text): whether a bytes-like text may hold a run decoding.runs decodes (see "
     "the comment above key_run_next in _gate.c)."},
    {"key_runs", key_runs, METH_O,
     "key_runs(text): [(start, end)] of every run decoding.runs may decode, in order."},
    {"key_blocks", (PyCFunction)(void (*)(void))key_blocks, METH_FASTCALL,
     "key_blocks(text, joins): (key_runs(text), the blocks of lines among them)."},
    {"local_header", (PyCFunction)(void (*)(void))local_header, METH_FASTCALL,
     "local_header(data, start=0, width=None): the first offset >= start of a zip local "
     "header's "
     "signature PK\\3\\4, or -1."},
    {"wrapped_blocks", wrapped_blocks, METH_O,
     "wrapped_blocks(data): [(start, end)] of every block of base64 lines (see _gate.c)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.core.dlp._gate.Gate",
    .tp_basicsize = sizeof(GateObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Gate(alphabet, segment, literals, wide=<AVX-512 BW>): one pass, RUN | LITERAL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gate_init,
    .tp_dealloc = (destructor)gate_dealloc,
    .tp_methods = gate_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gate",
    "The gate's run and literal pass in one AVX2 loop (gateway/core/dlp/_gate.c).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gate(void) {
    __builtin_cpu_init();
    key_classes();
    have_avx2 = __builtin_cpu_supports("avx2") != 0;
    {
        uint8_t member[256];
        for (int c = 0; c < 256; c++)
            member[c] = (key_class[c] & K_ALPHA) != 0;
        partition(member, wrap_lo, wrap_hi);
    }
    have_avx512 = have_avx2 && __builtin_cpu_supports("avx512f") != 0 &&
                  __builtin_cpu_supports("avx512bw") != 0;
    if (PyType_Ready(&GateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Gate", (PyObject *)&GateType) < 0 ||
        PyModule_AddIntConstant(m, "AVX2", have_avx2) < 0 ||
        PyModule_AddIntConstant(m, "AVX512", have_avx512) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
