/* The strings of a JSON document, read in C (issue 43): `texts(body)` returns every
 * string of the document (keys and values, in document order, escapes undone as a JSON
 * reader undoes them) joined by newlines, as one `str`: what `jsondoc.texts` of
 * `jsondoc.load(body)` joins, without building the document (a coding agent's request,
 * 13 KB of a chat with code in it, is read in a few microseconds instead of json.loads'
 * sixteen and a walk of its objects).
 *
 * It answers only where it is sure Python's `json.loads(body)` reads the same document:
 * anything else returns None and the caller reads the body with `json` (the answer then
 * comes from there). So it declines, rather than decides: a body that is not UTF-8
 * (json.loads decodes with "surrogatepass": UTF-8-encoded surrogates, which this does not
 * take; a byte-order mark, or UTF-16/32, which json.loads detects), a document nested deeper than MAX_DEPTH (Python's recursion limit decides there), a
 * number longer than MAX_NUMBER characters (Python's int-digits limit), and every text
 * the grammar refuses (json.loads raises: the caller finds that out itself).
 *
 * The grammar is Python's (`json.scanner`, strict): whitespace is space, tab, CR and LF;
 * the literals true, false, null, NaN, Infinity, -Infinity; numbers
 * -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?; strings without control characters,
 * escapes \" \\ \/ \b \f \n \r \t \uXXXX, a high surrogate escape followed by a low
 * surrogate escape read as one character, a lone one kept as it is.
 *
 * Output: the strings' UTF-8 (a lone surrogate as its three-byte form) in a buffer of at
 * most the body's size plus one byte a string (an escape never makes more bytes than it
 * takes; a combined pair: 12 bytes in, 4 out), then made a `str` (ASCII copied; else
 * decoded with "surrogatepass").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_DEPTH 256
#define MAX_NUMBER 4000

typedef struct Memo Memo;

typedef struct {
    const uint8_t *p;   /* the body */
    Py_ssize_t n, i;    /* its size, the position read */
    uint8_t *out;       /* the strings, joined */
    Py_ssize_t o;       /* bytes written */
    int strings;        /* a string was written (a newline goes before each but the first) */
    int wide;           /* a character past ASCII was written */
    /* (`Memo.read` only: the strings remembered are left out, see below) */
    Py_ssize_t chars;   /* characters written */
    Memo *memo;
    uint64_t tag;
    PyObject *cuts, *fresh;  /* lists */
    int named;          /* a string left out holds a name rule's anchor */
    int failed;         /* a Python error is set (a list could not grow) */
    Py_ssize_t shortest;  /* the memo's: a string shorter is never left out */
} Reader;

static inline void skip_ws(Reader *r) {
    while (r->i < r->n) {
        uint8_t c = r->p[r->i];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            return;
        r->i++;
    }
}

static inline int hex4(const uint8_t *s, unsigned *value) {
    unsigned v = 0;
    for (int k = 0; k < 4; k++) {
        uint8_t c = s[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    *value = v;
    return 1;
}

static inline void put_code(Reader *r, unsigned c) {
    uint8_t *o = r->out + r->o;
    r->chars++;  /* (one character of a str: a pair combined is one, as is a lone half) */
    if (c < 0x80) {
        o[0] = (uint8_t)c;
        r->o += 1;
        return;
    }
    r->wide = 1;
    if (c < 0x800) {
        o[0] = (uint8_t)(0xC0 | (c >> 6));
        o[1] = (uint8_t)(0x80 | (c & 0x3F));
        r->o += 2;
    } else if (c < 0x10000) {  /* (a lone surrogate too: "surrogatepass" reads it back) */
        o[0] = (uint8_t)(0xE0 | (c >> 12));
        o[1] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
        o[2] = (uint8_t)(0x80 | (c & 0x3F));
        r->o += 3;
    } else {
        o[0] = (uint8_t)(0xF0 | (c >> 18));
        o[1] = (uint8_t)(0x80 | ((c >> 12) & 0x3F));
        o[2] = (uint8_t)(0x80 | ((c >> 6) & 0x3F));
        o[3] = (uint8_t)(0x80 | (c & 0x3F));
        r->o += 4;
    }
}

/* The length of the UTF-8 sequence at s (strict: no overlong form, no surrogate, nothing
 * past U+10FFFF), or 0. */
static inline int utf8_sequence(const uint8_t *s, Py_ssize_t left) {
    uint8_t c = s[0];
    if (c >= 0xC2 && c <= 0xDF)
        return left >= 2 && (s[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (left < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && s[1] < 0xA0) return 0;   /* overlong */
        if (c == 0xED && s[1] >= 0xA0) return 0;  /* a surrogate */
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (left < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 ||
            (s[3] & 0xC0) != 0x80) return 0;
        if (c == 0xF0 && s[1] < 0x90) return 0;   /* overlong */
        if (c == 0xF4 && s[1] >= 0x90) return 0;  /* past U+10FFFF */
        return 4;
    }
    return 0;
}

/* Copies the plain characters of a string from p[i] on (not a quote, a backslash, a
 * control character or past ASCII: most of a string) to the output; returns where the
 * first other one is. 16 bytes at a time where SSE2 is (every x86-64): a body of code
 * has an escape every few dozen bytes. (A block is stored whole before it is looked at:
 * the output has room, it is never ahead of the input, see `texts`.) */
static inline Py_ssize_t plain(Reader *r, Py_ssize_t i) {
    const uint8_t *p = r->p;
    Py_ssize_t n = r->n;
    uint8_t *out = r->out + r->o;
    Py_ssize_t start = i;
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\'),
        control = _mm_set1_epi8(0x1f);
    while (i + 16 <= n) {
        __m128i v = _mm_loadu_si128((const __m128i *)(p + i));
        _mm_storeu_si128((__m128i *)(out + (i - start)), v);
        __m128i other = _mm_or_si128(
            _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, backslash)),
            _mm_cmpeq_epi8(_mm_min_epu8(v, control), v));  /* (<= 0x1f) */
        unsigned mask = (unsigned)(_mm_movemask_epi8(other) | _mm_movemask_epi8(v));
        if (mask) {
            i += __builtin_ctz(mask);
            r->o += i - start;
            r->chars += i - start;
            return i;
        }
        i += 16;
    }
#endif
    while (i < n && p[i] != '"' && p[i] != '\\' && p[i] >= 0x20 && p[i] < 0x80) {
        out[i - start] = p[i];
        i++;
    }
    r->o += i - start;
    r->chars += i - start;
    return i;
}

static int fresh(Reader *r, Py_ssize_t raw, Py_ssize_t end, Py_ssize_t chars, int strings);
static int remembered(Reader *r, Py_ssize_t raw, Py_ssize_t end);

#if defined(__SSE2__)
/* The bits of the quotes and the backslashes among the bytes p[0:64]. */
static inline void marks64(const uint8_t *p, uint64_t *quotes, uint64_t *backslashes) {
    const __m128i quote = _mm_set1_epi8('"'), backslash = _mm_set1_epi8('\\');
    __m128i v0 = _mm_loadu_si128((const __m128i *)p),
        v1 = _mm_loadu_si128((const __m128i *)(p + 16)),
        v2 = _mm_loadu_si128((const __m128i *)(p + 32)),
        v3 = _mm_loadu_si128((const __m128i *)(p + 48));
#define MASK64(c) ((uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v0, c)) | \
    (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v1, c)) << 16 | \
    (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v2, c)) << 32 | \
    (uint64_t)(unsigned)_mm_movemask_epi8(_mm_cmpeq_epi8(v3, c)) << 48)
    *quotes = MASK64(quote);
    *backslashes = MASK64(backslash);
#undef MASK64
}
#endif

/* The bytes of a 64-byte block escaped by a backslash (bit k: byte k), given its
 * backslashes and whether its first byte is escaped by the block before (`*carry`, 0 or
 * 1, set for the next block). Without a loop: a run of backslashes escapes the byte after
 * it where the run is of odd length; adding a run's first bit to the run carries to the
 * byte after it, and whether the run is odd is whether that byte's place and the run's
 * first differ in parity (runs begun on even places and on odd ones added apart). Only
 * the bytes that are not backslashes are right (a backslash escaped is not looked at). */
static inline uint64_t escaped64(uint64_t backslashes, uint64_t *carry) {
    const uint64_t even = 0x5555555555555555ull, odd = ~even;
    uint64_t b = backslashes & ~*carry;  /* (one escaped by the block before escapes nothing) */
    uint64_t starts = b & ~(b << 1), from_even, from_odd;
    from_even = b + (starts & even);
    uint64_t over = __builtin_add_overflow(b, starts & odd, &from_odd);
    uint64_t escaped = (from_even & ~b & odd) | (from_odd & ~b & even) | *carry;
    *carry = over;  /* (a run begun on an odd place and running to the end: odd) */
    return escaped;
}

/* Where the string whose characters begin at p[i] ends (its closing quote), read without
 * undoing its escapes (a backslash takes the byte after it); -1: it does not end. For a
 * string the grammar takes, the end `read_string` finds; for any other, some end, which
 * only matters if the bytes before it equal a string remembered (`Memo`), which the
 * grammar took. 64 bytes at a time where SSE2 is (`escaped64`: no branch per escape;
 * source code has one every few dozen bytes). */
static Py_ssize_t skim(const uint8_t *p, Py_ssize_t n, Py_ssize_t i) {
    uint64_t carry = 0;  /* the next block's first byte is escaped (by the last one before) */
#if defined(__SSE2__)
    while (i + 64 <= n) {
        uint64_t quotes, backslashes;
        marks64(p + i, &quotes, &backslashes);
        quotes &= ~escaped64(backslashes, &carry);
        if (quotes)
            return i + __builtin_ctzll(quotes);
        i += 64;
    }
#endif
    i += (Py_ssize_t)carry;
    while (i < n) {
        if (p[i] == '"')
            return i;
        i += p[i] == '\\' ? 2 : 1;
    }
    return -1;
}

/* A string at r->i (its opening quote), written to the output; 0: declined. With a memo,
 * a long string is skimmed first (`skim`): one remembered is left out unread, its escapes
 * never undone (the history an agent resends, most of its body). */
static int read_string(Reader *r) {
    const uint8_t *p = r->p;
    Py_ssize_t n = r->n, i = r->i + 1, raw = i;
    if (r->memo != NULL && n - raw >= r->shortest) {
        Py_ssize_t end = skim(p, n, raw);
        if (end - raw >= r->shortest) {
            int left = remembered(r, raw, end);
            if (left < 0)
                return 0;
            if (left) {
                r->i = end + 1;
                return 1;
            }
        }
    }
    Py_ssize_t chars = r->chars;  /* (before it: where a fresh string begins) */
    int strings = r->strings;
    if (r->strings) {
        r->out[r->o++] = '\n';
        r->chars++;
    }
    r->strings = 1;
    for (;;) {
        i = plain(r, i);
        if (i >= n)
            return 0;  /* unterminated */
        uint8_t c = p[i];
        if (c == '"') {
            r->i = i + 1;
            return r->memo == NULL || fresh(r, raw, i, chars, strings);
        }
        if (c < 0x20)
            return 0;  /* a control character (strict) */
        if (c >= 0x80) {
            int size = utf8_sequence(p + i, n - i);
            if (!size)
                return 0;
            memcpy(r->out + r->o, p + i, (size_t)size);
            r->o += size;
            r->chars++;
            r->wide = 1;
            i += size;
            continue;
        }
        /* an escape */
        if (i + 1 >= n)
            return 0;
        c = p[i + 1];
        switch (c) {
        case '"': case '\\': case '/': r->out[r->o++] = c; r->chars++; i += 2; continue;
        case 'b': r->out[r->o++] = '\b'; r->chars++; i += 2; continue;
        case 'f': r->out[r->o++] = '\f'; r->chars++; i += 2; continue;
        case 'n': r->out[r->o++] = '\n'; r->chars++; i += 2; continue;
        case 'r': r->out[r->o++] = '\r'; r->chars++; i += 2; continue;
        case 't': r->out[r->o++] = '\t'; r->chars++; i += 2; continue;
        case 'u': break;
        default: return 0;
        }
        unsigned code, low;
        if (i + 6 > n || !hex4(p + i + 2, &code))
            return 0;
        i += 6;
        if (code >= 0xD800 && code <= 0xDBFF && i + 6 <= n && p[i] == '\\' &&
            p[i + 1] == 'u') {
            if (!hex4(p + i + 2, &low))
                return 0;  /* (Python raises on it too) */
            if (low >= 0xDC00 && low <= 0xDFFF) {
                code = 0x10000 + (((code - 0xD800) << 10) | (low - 0xDC00));
                i += 6;
            }
        }
        put_code(r, code);
    }
}

static int read_value(Reader *r, int depth);

static int literal(Reader *r, const char *word, Py_ssize_t size) {
    if (r->n - r->i < size || memcmp(r->p + r->i, word, (size_t)size) != 0)
        return 0;
    r->i += size;
    return 1;
}

static int read_number(Reader *r) {
    const uint8_t *p = r->p;
    Py_ssize_t n = r->n, i = r->i, start = r->i;
    if (i < n && p[i] == '-') {
        i++;
        if (i < n && p[i] == 'I') {  /* -Infinity */
            r->i = i;
            return literal(r, "Infinity", 8);
        }
    }
    if (i >= n || p[i] < '0' || p[i] > '9')
        return 0;
    if (p[i] == '0')
        i++;
    else
        while (i < n && p[i] >= '0' && p[i] <= '9') i++;
    if (i + 1 < n && p[i] == '.' && p[i + 1] >= '0' && p[i + 1] <= '9') {
        i += 2;
        while (i < n && p[i] >= '0' && p[i] <= '9') i++;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        Py_ssize_t j = i + 1;
        if (j < n && (p[j] == '+' || p[j] == '-')) j++;
        if (j < n && p[j] >= '0' && p[j] <= '9') {
            while (j < n && p[j] >= '0' && p[j] <= '9') j++;
            i = j;
        }
    }
    if (i - start > MAX_NUMBER)
        return 0;  /* (Python may refuse a long integer: it decides) */
    r->i = i;
    return 1;
}

static int read_container(Reader *r, int depth, uint8_t close) {
    r->i++;  /* '{' or '[' */
    skip_ws(r);
    if (r->i < r->n && r->p[r->i] == close) {
        r->i++;
        return 1;
    }
    for (;;) {
        if (close == '}') {
            if (r->i >= r->n || r->p[r->i] != '"' || !read_string(r))
                return 0;
            skip_ws(r);
            if (r->i >= r->n || r->p[r->i] != ':')
                return 0;
            r->i++;
            skip_ws(r);
        }
        if (!read_value(r, depth + 1))
            return 0;
        skip_ws(r);
        if (r->i >= r->n)
            return 0;
        uint8_t c = r->p[r->i++];
        if (c == close)
            return 1;
        if (c != ',')
            return 0;
        skip_ws(r);
    }
}

static int read_value(Reader *r, int depth) {
    if (r->i >= r->n || depth > MAX_DEPTH)
        return 0;
    switch (r->p[r->i]) {
    case '"': return read_string(r);
    case '{': return read_container(r, depth, '}');
    case '[': return read_container(r, depth, ']');
    case 't': return literal(r, "true", 4);
    case 'f': return literal(r, "false", 5);
    case 'n': return literal(r, "null", 4);
    case 'N': return literal(r, "NaN", 3);
    case 'I': return literal(r, "Infinity", 8);
    default: return read_number(r);
    }
}

static PyObject *texts(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *p = view.buf;
    Py_ssize_t n = view.len;
    PyObject *result = NULL;
    /* (What makes json.loads read another encoding, a byte-order mark or a NUL in the
     *  first four bytes, is declined by the grammar: neither begins a JSON value, and a
     *  NUL in a string is a control character.) */
    Reader r = {p, n, 0, NULL, 0, 0, 0, 0, NULL, 0, NULL, NULL, 0, 0};
    /* at most the body's bytes (an escape writes no more than it reads, a string's
     * quotes pay for its newline) */
    r.out = PyMem_Malloc((size_t)n + 16);  /* (+16: `plain` stores whole blocks) */
    if (r.out == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    skip_ws(&r);
    ok = read_value(&r, 0);
    if (ok) {
        skip_ws(&r);
        ok = r.i == r.n;
    }
    Py_END_ALLOW_THREADS
    if (!ok) {
        result = Py_NewRef(Py_None);
    } else if (!r.wide) {
        result = PyUnicode_New(r.o, 127);
        if (result != NULL)
            memcpy(PyUnicode_DATA(result), r.out, (size_t)r.o);
    } else {
        result = PyUnicode_DecodeUTF8((const char *)r.out, r.o, "surrogatepass");
    }
    PyMem_Free(r.out);
    PyBuffer_Release(&view);
    return result;
}

/* -- Memo: the strings a sandbox sent before, found to hold nothing ----------------------
 * A coding agent sends its whole conversation again every turn: the system prompt, the
 * tool definitions, every file it read. `Memo.read(body, tag)` reads a body as `texts`
 * does, but leaves out of the text each string of `shortest` bytes or more (as sent,
 * escapes and all) that `remember` was told holds nothing for the same `tag` (the
 * sandbox): the scan reads only what is new. What it leaves out is said (`cuts`: where
 * in the text a string was; `named`: one of them holds an anchor of the rules that read
 * a name beside its value), and so is every string it read that is long enough to be
 * remembered (`fresh`: its characters in the text, its bytes in the body); which of them
 * hold nothing the scan decides (gateway/core/dlp/history.py).
 *
 * A slot holds a copy of the string's bytes: a string is left out only where it equals
 * one remembered, byte for byte, with the same tag (the slot's hash only picks where to
 * look: a collision costs a comparison, never a string read as another). The slots are
 * a fixed table (`slots`, a power of two: a new string takes its slot's place) and their
 * bytes are bounded (`limit`: past it, every slot is let go). */

typedef struct {
    uint64_t hash, tag;
    Py_ssize_t len;
    int named;
    uint8_t *raw;
} Slot;

struct Memo {
    PyObject_HEAD
    Slot *slots;
    Py_ssize_t count, bytes, limit, shortest, held;
};

static uint64_t mix(uint64_t h, uint64_t v) {  /* (MurmurHash3's finalizer of h ^ v) */
    h ^= v;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 33);
}

/* A hash of the length, the tag and 16 bytes each at the start, the middle and the end. */
static uint64_t slot_hash(const uint8_t *raw, Py_ssize_t len, uint64_t tag) {
    uint64_t h = mix(mix(0, (uint64_t)len), tag), w;
    Py_ssize_t at[3] = {0, len / 2 - 8, len - 16};
    for (int k = 0; k < 3; k++)
        for (int j = 0; j < 2; j++) {
            memcpy(&w, raw + at[k] + 8 * j, 8);
            h = mix(h, w);
        }
    return h;
}

static Slot *memo_find(Memo *m, const uint8_t *raw, Py_ssize_t len, uint64_t tag) {
    uint64_t h = slot_hash(raw, len, tag);
    Slot *slot = &m->slots[h & (uint64_t)(m->count - 1)];
    if (slot->raw != NULL && slot->hash == h && slot->tag == tag && slot->len == len &&
        memcmp(slot->raw, raw, (size_t)len) == 0)
        return slot;
    return NULL;
}

static void memo_forget(Memo *m) {
    for (Py_ssize_t k = 0; k < m->count; k++) {
        PyMem_Free(m->slots[k].raw);
        m->slots[k].raw = NULL;
    }
    m->bytes = m->held = 0;
}

/* Whether the string body[raw:end] is remembered: if so, it is left out (its place in the
 * text listed in `cuts`) and 1; 0: not remembered; -1: a Python error (r->failed). */
static int remembered(Reader *r, Py_ssize_t raw, Py_ssize_t end) {
    Slot *slot = memo_find(r->memo, r->p + raw, end - raw, r->tag);
    if (slot == NULL)
        return 0;
    r->named |= slot->named;
    PyObject *item = PyLong_FromSsize_t(r->chars);
    if (item == NULL || PyList_Append(r->cuts, item) < 0)
        r->failed = 1;
    Py_XDECREF(item);
    return r->failed ? -1 : 1;
}

/* A string read with a memo, not remembered (`read_string` looked: a string the grammar
 * takes ends where `skim` said): listed as fresh where it is long enough to remember.
 * 0: a Python error (r->failed). */
static int fresh(Reader *r, Py_ssize_t raw, Py_ssize_t end, Py_ssize_t chars, int strings) {
    if (end - raw < r->shortest)
        return 1;
    PyObject *item = Py_BuildValue("(nnnn)", chars + (strings ? 1 : 0), r->chars, raw, end);
    if (item == NULL || PyList_Append(r->fresh, item) < 0)
        r->failed = 1;
    Py_XDECREF(item);
    return !r->failed;
}

static void memo_dealloc(Memo *self) {
    if (self->slots != NULL) {
        memo_forget(self);
        PyMem_Free(self->slots);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int memo_init(Memo *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"slots", "limit", "shortest", NULL};
    Py_ssize_t count = 4096, limit = 8 << 20, shortest = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|nnn", names, &count, &limit, &shortest))
        return -1;
    if (count < 1 || (count & (count - 1)) || count > (1 << 24) || shortest < 32 ||
        limit < shortest) {
        PyErr_SetString(PyExc_ValueError, "slots: a power of two up to 2**24; shortest: 32 "
                        "bytes or more; limit: at least shortest");
        return -1;
    }
    if (self->slots != NULL) {  /* (__init__ called again) */
        memo_forget(self);
        PyMem_Free(self->slots);
    }
    self->slots = PyMem_Calloc((size_t)count, sizeof(Slot));
    if (self->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->count = count;
    self->limit = limit;
    self->shortest = shortest;
    self->bytes = self->held = 0;
    return 0;
}

static PyObject *memo_read(Memo *self, PyObject *args) {
    /* read(body, tag): None (declined, as `texts`), or (text, cuts, fresh, named) */
    Py_buffer view;
    unsigned long long tag;
    if (!PyArg_ParseTuple(args, "y*K", &view, &tag))
        return NULL;
    Reader r = {view.buf, view.len, 0, NULL, 0, 0, 0, 0, self, (uint64_t)tag, NULL, NULL, 0, 0,
                self->shortest};
    PyObject *result = NULL, *text = NULL;
    r.cuts = PyList_New(0);
    r.fresh = PyList_New(0);
    r.out = PyMem_Malloc((size_t)view.len + 16);
    if (r.cuts == NULL || r.fresh == NULL || r.out == NULL) {
        if (r.out == NULL)
            PyErr_NoMemory();
        goto done;
    }
    /* (the GIL held: the memo and the lists are touched as the body is read) */
    skip_ws(&r);
    int ok = read_value(&r, 0);
    if (ok) {
        skip_ws(&r);
        ok = r.i == r.n;
    }
    if (r.failed)
        goto done;
    if (!ok) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (!r.wide) {
        text = PyUnicode_New(r.o, 127);
        if (text != NULL)
            memcpy(PyUnicode_DATA(text), r.out, (size_t)r.o);
    } else {
        text = PyUnicode_DecodeUTF8((const char *)r.out, r.o, "surrogatepass");
    }
    if (text != NULL)
        result = Py_BuildValue("(NOOO)", text, r.cuts, r.fresh, r.named ? Py_True : Py_False);
done:
    Py_XDECREF(r.cuts);
    Py_XDECREF(r.fresh);
    PyMem_Free(r.out);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *memo_remember(Memo *self, PyObject *args) {
    /* remember(body, start, end, tag, named): body[start:end], a string as sent, holds
     * nothing for `tag` (`named`: it holds a name rule's anchor) */
    Py_buffer view;
    Py_ssize_t start, end;
    unsigned long long tag;
    int named;
    if (!PyArg_ParseTuple(args, "y*nnKp", &view, &start, &end, &tag, &named))
        return NULL;
    Py_ssize_t len = end - start;
    if (start < 0 || end > view.len || len < self->shortest) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "a string of the body, of shortest bytes or more");
        return NULL;
    }
    if (len > self->limit) {  /* (never held: read again each time) */
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    if (self->bytes + len > self->limit)
        memo_forget(self);
    const uint8_t *raw = (const uint8_t *)view.buf + start;
    uint8_t *copy = PyMem_Malloc((size_t)len);
    if (copy == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    memcpy(copy, raw, (size_t)len);
    uint64_t h = slot_hash(raw, len, (uint64_t)tag);
    Slot *slot = &self->slots[h & (uint64_t)(self->count - 1)];
    if (slot->raw != NULL) {
        self->bytes -= slot->len;
        self->held--;
        PyMem_Free(slot->raw);
    }
    *slot = (Slot){h, (uint64_t)tag, len, named, copy};
    self->bytes += len;
    self->held++;
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *memo_forget_all(Memo *self, PyObject *unused) {
    (void)unused;
    memo_forget(self);
    Py_RETURN_NONE;
}

static PyObject *memo_size(Memo *self, PyObject *unused) {
    (void)unused;
    return Py_BuildValue("(nn)", self->held, self->bytes);
}

static PyMethodDef memo_methods[] = {
    {"read", (PyCFunction)memo_read, METH_VARARGS,
     "read(body, tag): None (declined: read it with json), or (text, cuts, fresh, named)."},
    {"remember", (PyCFunction)memo_remember, METH_VARARGS,
     "remember(body, start, end, tag, named): body[start:end] holds nothing for tag."},
    {"forget", (PyCFunction)memo_forget_all, METH_NOARGS, "Let every string go."},
    {"size", (PyCFunction)memo_size, METH_NOARGS, "(strings held, their bytes)."},
    {NULL, NULL, 0, NULL}
};

static PyTypeObject MemoType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.core.dlp._jsontext.Memo",
    .tp_basicsize = sizeof(Memo),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The strings of JSON bodies a sandbox sent before that hold nothing.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)memo_init,
    .tp_dealloc = (destructor)memo_dealloc,
    .tp_methods = memo_methods,
};

static PyMethodDef module_methods[] = {
    {"texts", texts, METH_O,
     "The strings of a JSON document joined by newlines, or None (declined: read it "
     "with json)."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jsontext",
    "The strings of a JSON document, read in C (gateway/core/dlp/jsondoc.py).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__jsontext(void) {
    if (PyType_Ready(&MemoType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Memo", (PyObject *)&MemoType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
