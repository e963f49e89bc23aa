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

typedef struct {
    const uint8_t *p;   /* the body */
    Py_ssize_t n, i;    /* its size, the position read */
    uint8_t *out;       /* the strings, joined */
    Py_ssize_t o;       /* bytes written */
    int strings;        /* a string was written (a newline goes before each but the first) */
    int wide;           /* a character past ASCII was written */
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
    return i;
}

/* A string at r->i (its opening quote), written to the output; 0: declined. */
static int read_string(Reader *r) {
    const uint8_t *p = r->p;
    Py_ssize_t n = r->n, i = r->i + 1;
    if (r->strings)
        r->out[r->o++] = '\n';
    r->strings = 1;
    for (;;) {
        i = plain(r, i);
        if (i >= n)
            return 0;  /* unterminated */
        uint8_t c = p[i];
        if (c == '"') {
            r->i = i + 1;
            return 1;
        }
        if (c < 0x20)
            return 0;  /* a control character (strict) */
        if (c >= 0x80) {
            int size = utf8_sequence(p + i, n - i);
            if (!size)
                return 0;
            memcpy(r->out + r->o, p + i, (size_t)size);
            r->o += size;
            r->wide = 1;
            i += size;
            continue;
        }
        /* an escape */
        if (i + 1 >= n)
            return 0;
        c = p[i + 1];
        switch (c) {
        case '"': case '\\': case '/': r->out[r->o++] = c; i += 2; continue;
        case 'b': r->out[r->o++] = '\b'; i += 2; continue;
        case 'f': r->out[r->o++] = '\f'; i += 2; continue;
        case 'n': r->out[r->o++] = '\n'; i += 2; continue;
        case 'r': r->out[r->o++] = '\r'; i += 2; continue;
        case 't': r->out[r->o++] = '\t'; i += 2; continue;
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
    Reader r = {p, n, 0, NULL, 0, 0, 0};
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
    return PyModule_Create(&module);
}
