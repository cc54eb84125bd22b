/* RLT's per-eviction loops over the leaf registry, compiled (engine_ext.cache.kernels).

An eviction of a few thousand tokens is little work (a few hundred leaves, a few thousand
picks), and as Python or numpy calls it costs microseconds each when the caches are cold, as
they are in a scheduler between batches. These loops do it in one C call each: gather the
candidates, draw the picks page by page (the definition in rlt_reference.py, the same picks
from the same uniforms), cut the tails and copy the KV indices they free. They read and write
numpy arrays (any object with a C-contiguous, one-dimensional buffer of the right item size)
in place and allocate nothing but the draw's working arrays. Where this module is not built,
RLT runs rlt_reference.py's loop instead.

Only the CPython C API is used (the buffer protocol; no numpy headers).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer view;
    int held;
} Arr;

static void release(Arr *arrs, int n) {
    for (int i = 0; i < n; i++) {
        if (arrs[i].held) {
            PyBuffer_Release(&arrs[i].view);
            arrs[i].held = 0;
        }
    }
}

/* A one-dimensional, C-contiguous buffer of `itemsize`-byte items ('q'/'l' int64 or 'd'
   float64 when `kind` is 'i' or 'f'; any 4- or 8-byte integer when `kind` is 'x'). */
static int get(PyObject *obj, Arr *arr, int writable, char kind, const char *name) {
    int flags = PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &arr->view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s: expected a %scontiguous numpy array", name,
                     writable ? "writable, " : "");
        return -1;
    }
    arr->held = 1;
    const char *fmt = arr->view.format ? arr->view.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    int ok;
    if (kind == 'f') {
        ok = arr->view.itemsize == 8 && fmt[0] == 'd' && fmt[1] == 0;
    } else if (kind == 'i') {
        ok = arr->view.itemsize == 8 && (fmt[0] == 'q' || fmt[0] == 'l') && fmt[1] == 0;
    } else {
        ok = (arr->view.itemsize == 8 || arr->view.itemsize == 4) && fmt[0] != 0 &&
             strchr("qlQLiI", fmt[0]) != NULL && fmt[1] == 0;
    }
    if (!ok || arr->view.ndim != 1) {
        PyErr_Format(PyExc_TypeError, "%s: expected a one-dimensional %s array, got format "
                     "'%s', %zd-byte items, %d dimensions", name,
                     kind == 'f' ? "float64" : kind == 'i' ? "int64" : "4- or 8-byte integer",
                     arr->view.format ? arr->view.format : "B", arr->view.itemsize,
                     arr->view.ndim);
        return -1;
    }
    return 0;
}


static Py_ssize_t length(Arr *arr) { return arr->view.len / arr->view.itemsize; }

static int get_ssize(PyObject *obj, Py_ssize_t *out, const char *name) {
    *out = PyLong_AsSsize_t(obj);
    if (*out == -1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int", name);
        return -1;
    }
    return 0;
}

static int check_args(Py_ssize_t nargs, Py_ssize_t want, const char *fn) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, nargs);
        return -1;
    }
    return 0;
}

/* candidates(mark, size, end, phase, page, slots_out, pages_out) -> (k, pages)

   RLT's candidates: the slots i < end with mark[i] < phase (unlocked, unmarked leaves), in
   order, into slots_out[:k], and their sizes in whole pages (size[i] // page) into
   pages_out[:k]; `pages` is their sum. */
static PyObject *candidates(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 7, "candidates") < 0) return NULL;
    Arr a[4];
    memset(a, 0, sizeof a);
    Py_ssize_t end, phase, page;
    if (get_ssize(args[2], &end, "end") < 0 || get_ssize(args[3], &phase, "phase") < 0 ||
        get_ssize(args[4], &page, "page") < 0)
        return NULL;
    if (page < 1) return PyErr_Format(PyExc_ValueError, "page: must be >= 1, got %zd", page);
    if (get(args[0], &a[0], 0, 'i', "mark") < 0 || get(args[1], &a[1], 0, 'i', "size") < 0 ||
        get(args[5], &a[2], 1, 'i', "slots_out") < 0 ||
        get(args[6], &a[3], 1, 'i', "pages_out") < 0)
        goto fail;
    if (end < 0 || end > length(&a[0]) || end > length(&a[1]) || end > length(&a[2]) ||
        end > length(&a[3])) {
        PyErr_Format(PyExc_ValueError, "end: %zd is outside the arrays", end);
        goto fail;
    }
    const int64_t *mark = a[0].view.buf, *size = a[1].view.buf;
    int64_t *slots = a[2].view.buf, *pages = a[3].view.buf;
    Py_ssize_t k = 0;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < end; i++) {
        if (mark[i] < phase) {
            slots[k] = i;
            pages[k] = size[i] / page;
            total += pages[k];
            k++;
        }
    }
    release(a, 4);
    return Py_BuildValue("(nL)", k, (long long)total);
fail:
    release(a, 4);
    return NULL;
}

/* The active leaves of steps, by position: label, pages left, pages taken so far.
   Candidates have labels 0 .. k - 1 (their totals go to taken[label]); a joined parent gets
   the next label from k and its total goes to joined[label - k]. The active count never
   exceeds k: a parent joins only in place of its emptied child. */
typedef struct {
    Py_ssize_t k, active, joined_n, joined_cap;
    int64_t *label, *left, *picked, *joined, *taken;
    PyObject *emptied, *joins;
} Leaves;

/* 0, or -1 with an error set (then leaves_free still frees what was allocated): a ValueError
   before anything is written if a candidate holds no page. */
static int leaves_init(Leaves *s, const int64_t *pages, Py_ssize_t k, int64_t *taken,
                       PyObject *joins) {
    memset(s, 0, sizeof *s);
    for (Py_ssize_t i = 0; i < k; i++) {
        if (pages[i] < 1) {
            PyErr_Format(PyExc_ValueError, "pages[%zd] = %lld: every candidate must hold a "
                         "page", i, (long long)pages[i]);
            return -1;
        }
    }
    size_t room = (size_t)(k ? k : 1) * sizeof(int64_t);
    s->label = PyMem_Malloc(room);
    s->left = PyMem_Malloc(room);
    s->picked = PyMem_Malloc(room);
    s->emptied = PyList_New(0);
    if (s->label == NULL || s->left == NULL || s->picked == NULL || s->emptied == NULL) {
        if (s->emptied != NULL) PyErr_NoMemory();
        return -1;
    }
    s->k = s->active = k;
    s->taken = taken;
    s->joins = joins;
    for (Py_ssize_t i = 0; i < k; i++) {
        s->label[i] = i;
        s->left[i] = pages[i];
        s->picked[i] = 0;
        taken[i] = 0;
    }
    return 0;
}

static void leaves_free(Leaves *s) {
    PyMem_Free(s->label);
    PyMem_Free(s->left);
    PyMem_Free(s->picked);
    PyMem_Free(s->joined);
    Py_XDECREF(s->emptied);
}

/* The active leaf at position j has no page left: its total recorded, its label appended
   to `emptied`, out of the order (the others keep theirs); then parent_joins(label) (an
   int or None) may add its parent with that many pages at the end. 0, or -1 with an
   error set. */
static int leaves_empty(Leaves *s, Py_ssize_t j) {
    int64_t who = s->label[j];
    if (who < s->k) s->taken[who] = s->picked[j];
    else s->joined[who - s->k] = s->picked[j];
    PyObject *who_obj = PyLong_FromLongLong((long long)who);
    if (who_obj == NULL || PyList_Append(s->emptied, who_obj) < 0) {
        Py_XDECREF(who_obj);
        return -1;
    }
    s->active--;
    size_t tail = (size_t)(s->active - j) * sizeof(int64_t);
    memmove(s->label + j, s->label + j + 1, tail);
    memmove(s->left + j, s->left + j + 1, tail);
    memmove(s->picked + j, s->picked + j + 1, tail);
    PyObject *got = PyObject_CallOneArg(s->joins, who_obj);
    Py_DECREF(who_obj);
    if (got == NULL) return -1;
    long long parent_pages = 0;
    if (got != Py_None) {
        parent_pages = PyLong_AsLongLong(got);
        if (parent_pages == -1 && PyErr_Occurred()) {
            Py_DECREF(got);
            PyErr_SetString(PyExc_TypeError, "parent_joins: must return an int or None");
            return -1;
        }
    }
    Py_DECREF(got);
    if (parent_pages <= 0) return 0;
    if (s->joined_n == s->joined_cap) {
        Py_ssize_t cap = s->joined_cap ? 2 * s->joined_cap : 16;
        int64_t *grown = PyMem_Realloc(s->joined, (size_t)cap * sizeof(int64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->joined = grown;
        s->joined_cap = cap;
    }
    s->joined[s->joined_n] = 0;
    s->label[s->active] = s->k + s->joined_n;
    s->left[s->active] = parent_pages;
    s->picked[s->active] = 0;
    s->joined_n++;
    s->active++;
    return 0;
}

/* (emptied, joined_taken) once the draw is over: the totals of the leaves still holding
   pages recorded first. NULL with an error set. */
static PyObject *leaves_result(Leaves *s) {
    for (Py_ssize_t i = 0; i < s->active; i++) {
        if (s->label[i] < s->k) s->taken[s->label[i]] = s->picked[i];
        else s->joined[s->label[i] - s->k] = s->picked[i];
    }
    PyObject *joined_list = PyList_New(s->joined_n);
    if (joined_list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < s->joined_n; i++) {
        PyObject *v = PyLong_FromLongLong((long long)s->joined[i]);
        if (v == NULL) {
            Py_DECREF(joined_list);
            return NULL;
        }
        PyList_SET_ITEM(joined_list, i, v);
    }
    return Py_BuildValue("(ON)", s->emptied, joined_list);
}

/* steps(uniforms, pages, k, parent_joins, taken_out) -> (emptied, joined_taken)

   RLT's draw by its definition, one page at a time (rlt_reference.py's loop). The k
   candidates (labels 0 .. k - 1, pages[i] >= 1 pages each) are the active leaves, in order.
   Pick j is floor(uniforms[j] * active): the active leaf at that position loses a page; a
   leaf that empties leaves the order (the others keep theirs), its label goes to `emptied`,
   and parent_joins(label) (an int or None) may add its parent with that many pages at the
   end of the order, as label k, k + 1, ... One pick per uniform; stops early when no leaf is
   left. taken_out[:k] = pages taken per candidate; joined_taken = pages taken per joined
   parent, a list. */
static PyObject *steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "steps") < 0) return NULL;
    Arr a[3];
    memset(a, 0, sizeof a);
    PyObject *out = NULL;
    Py_ssize_t k;
    if (get_ssize(args[2], &k, "k") < 0) return NULL;
    PyObject *joins = args[3];
    if (!PyCallable_Check(joins)) {
        PyErr_SetString(PyExc_TypeError, "parent_joins: expected a callable");
        return NULL;
    }
    if (get(args[0], &a[0], 0, 'f', "uniforms") < 0 || get(args[1], &a[1], 0, 'i', "pages") < 0 ||
        get(args[4], &a[2], 1, 'i', "taken_out") < 0)
        goto fail;
    if (k < 0 || k > length(&a[1]) || k > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "k: %zd is outside the arrays", k);
        goto fail;
    }
    const double *u = a[0].view.buf;
    Py_ssize_t need = length(&a[0]);
    Leaves s;
    if (leaves_init(&s, a[1].view.buf, k, a[2].view.buf, joins) < 0) goto done;
    for (Py_ssize_t used = 0; used < need && s.active > 0; used++) {
        const double scale = (double)s.active, x = u[used] * scale;
        if (!(x >= 0.0 && x < scale)) {
            PyErr_Format(PyExc_ValueError, "uniforms[%zd] is not in [0, 1)", used);
            goto done;
        }
        Py_ssize_t j = (Py_ssize_t)x;
        s.picked[j]++;
        if (--s.left[j] == 0 && leaves_empty(&s, j) < 0) goto done;
    }
    out = leaves_result(&s);
done:
    leaves_free(&s);
fail:
    release(a, 3);
    return out;
}

/* 0 if every slots[i] (i < k) is a slot below slots_len and every taken[i] is at most the
   whole pages the leaf there holds; else -1 with an IndexError or ValueError naming it. */
static int check_cuts(const int64_t *size, const int64_t *slots, const int64_t *taken,
                      Py_ssize_t k, Py_ssize_t page, Py_ssize_t slots_len) {
    for (Py_ssize_t i = 0; i < k; i++) {
        if (slots[i] < 0 || slots[i] >= slots_len) {
            PyErr_Format(PyExc_IndexError, "slots[%zd] = %lld is not a slot", i,
                         (long long)slots[i]);
            return -1;
        }
        if (taken[i] < 0 || taken[i] > size[slots[i]] / page) {
            PyErr_Format(PyExc_ValueError, "taken[%zd] = %lld pages: the leaf in slot %lld "
                         "holds %lld tokens", i, (long long)taken[i], (long long)slots[i],
                         (long long)size[slots[i]]);
            return -1;
        }
    }
    return 0;
}

/* trim(size, slots, taken, k, page, off, starts_out, lengths_out) -> tokens cut

   For i < k: size[slots[i]] -= taken[i] * page, all checked before any is written (every
   cut at most the leaf's size; slots distinct, the caller's part). With `off` (else None,
   and None outputs): starts_out[i] = off[slots[i]] + the new size and lengths_out[i] =
   taken[i] * page, the runs of arena positions that were cut. */
static PyObject *trim(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 8, "trim") < 0) return NULL;
    Arr a[6];
    memset(a, 0, sizeof a);
    Py_ssize_t k, page;
    if (get_ssize(args[3], &k, "k") < 0 || get_ssize(args[4], &page, "page") < 0) return NULL;
    if (page < 1) return PyErr_Format(PyExc_ValueError, "page: must be >= 1, got %zd", page);
    int runs = args[5] != Py_None;
    if (get(args[0], &a[0], 1, 'i', "size") < 0 || get(args[1], &a[1], 0, 'i', "slots") < 0 ||
        get(args[2], &a[2], 0, 'i', "taken") < 0)
        goto fail;
    if (runs && (get(args[5], &a[3], 0, 'i', "off") < 0 ||
                 get(args[6], &a[4], 1, 'i', "starts_out") < 0 ||
                 get(args[7], &a[5], 1, 'i', "lengths_out") < 0))
        goto fail;
    if (k < 0 || k > length(&a[1]) || k > length(&a[2]) ||
        (runs && (k > length(&a[4]) || k > length(&a[5])))) {
        PyErr_Format(PyExc_ValueError, "k: %zd is outside the arrays", k);
        goto fail;
    }
    int64_t *size = a[0].view.buf;
    const int64_t *slots = a[1].view.buf, *taken = a[2].view.buf;
    Py_ssize_t slots_len = length(&a[0]);
    if (runs && length(&a[3]) < slots_len) slots_len = length(&a[3]);
    if (check_cuts(size, slots, taken, k, page, slots_len) < 0) goto fail;
    int64_t total = 0;
    const int64_t *off = runs ? a[3].view.buf : NULL;
    int64_t *starts = runs ? a[4].view.buf : NULL, *lengths = runs ? a[5].view.buf : NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t cut = taken[i] * page, keep = size[slots[i]] - cut;
        size[slots[i]] = keep;
        total += cut;
        if (runs) {
            starts[i] = off[slots[i]] + keep;
            lengths[i] = cut;
        }
    }
    release(a, 6);
    return PyLong_FromLongLong((long long)total);
fail:
    release(a, 6);
    return NULL;
}

/* trim_gather(size, slots, taken, k, page, off, source, out, at) -> tokens cut

   trim's cuts (size[slots[i]] -= taken[i] * page, i < k) with their arena runs copied at
   once instead of returned: source[off[slots[i]] + new size : + taken[i] * page], one after
   another, into out from position `at` (source and out: integers of one item size). Every
   slot, cut and run is checked, and that out has room for them all, before anything is
   written. */
static PyObject *trim_gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 9, "trim_gather") < 0) return NULL;
    Arr a[6];
    memset(a, 0, sizeof a);
    Py_ssize_t k, page, at;
    if (get_ssize(args[3], &k, "k") < 0 || get_ssize(args[4], &page, "page") < 0 ||
        get_ssize(args[8], &at, "at") < 0)
        return NULL;
    if (page < 1) return PyErr_Format(PyExc_ValueError, "page: must be >= 1, got %zd", page);
    if (get(args[0], &a[0], 1, 'i', "size") < 0 || get(args[1], &a[1], 0, 'i', "slots") < 0 ||
        get(args[2], &a[2], 0, 'i', "taken") < 0 || get(args[5], &a[3], 0, 'i', "off") < 0 ||
        get(args[6], &a[4], 0, 'x', "source") < 0 || get(args[7], &a[5], 1, 'x', "out") < 0)
        goto fail;
    if (a[4].view.itemsize != a[5].view.itemsize) {
        PyErr_SetString(PyExc_TypeError, "out: must have source's item size");
        goto fail;
    }
    if (k < 0 || k > length(&a[1]) || k > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "k: %zd is outside the arrays", k);
        goto fail;
    }
    int64_t *size = a[0].view.buf;
    const int64_t *slots = a[1].view.buf, *taken = a[2].view.buf, *off = a[3].view.buf;
    Py_ssize_t slots_len = length(&a[0]), have = length(&a[4]), room = length(&a[5]);
    if (length(&a[3]) < slots_len) slots_len = length(&a[3]);
    if (at < 0 || at > room) {
        PyErr_Format(PyExc_ValueError, "at: %zd is outside out", at);
        goto fail;
    }
    if (check_cuts(size, slots, taken, k, page, slots_len) < 0) goto fail;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t cut = taken[i] * page, start = off[slots[i]] + size[slots[i]] - cut;
        if (off[slots[i]] < 0 || start + cut > have) {
            PyErr_Format(PyExc_ValueError, "run %zd (start %lld, length %lld) is outside "
                         "source", i, (long long)start, (long long)cut);
            goto fail;
        }
        total += cut;
    }
    if (total > room - at) {
        PyErr_Format(PyExc_ValueError, "out: %lld tokens cut, room for %zd after at",
                     (long long)total, room - at);
        goto fail;
    }
    char *dst = (char *)a[5].view.buf + at * a[5].view.itemsize;
    const char *src = a[4].view.buf;
    Py_ssize_t item = a[4].view.itemsize;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t cut = taken[i] * page, keep = size[slots[i]] - cut;
        size[slots[i]] = keep;
        memcpy(dst, src + (off[slots[i]] + keep) * item, (size_t)(cut * item));
        dst += cut * item;
    }
    release(a, 6);
    return PyLong_FromLongLong((long long)total);
fail:
    release(a, 6);
    return NULL;
}

/* gather(source, starts, lengths, k, out) -> items copied

   source[starts[i]:starts[i] + lengths[i]] for i < k, one after another, into the start of
   out (source and out: integers of one item size, 4 or 8 bytes). */
static PyObject *gather(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "gather") < 0) return NULL;
    Arr a[4];
    memset(a, 0, sizeof a);
    Py_ssize_t k;
    if (get_ssize(args[3], &k, "k") < 0) return NULL;
    if (get(args[0], &a[0], 0, 'x', "source") < 0 || get(args[1], &a[1], 0, 'i', "starts") < 0 ||
        get(args[2], &a[2], 0, 'i', "lengths") < 0 || get(args[4], &a[3], 1, 'x', "out") < 0)
        goto fail;
    if (a[0].view.itemsize != a[3].view.itemsize) {
        PyErr_SetString(PyExc_TypeError, "out: must have source's item size");
        goto fail;
    }
    if (k < 0 || k > length(&a[1]) || k > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "k: %zd is outside the arrays", k);
        goto fail;
    }
    const int64_t *starts = a[1].view.buf, *lengths = a[2].view.buf;
    Py_ssize_t have = length(&a[0]), room = length(&a[3]), item = a[0].view.itemsize, at = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (starts[i] < 0 || lengths[i] < 0 || starts[i] > have - lengths[i] ||
            lengths[i] > room - at) {
            PyErr_Format(PyExc_ValueError, "run %zd (start %lld, length %lld) is outside "
                         "source or out", i, (long long)starts[i], (long long)lengths[i]);
            goto fail;
        }
        at += lengths[i];
    }
    char *dst = a[3].view.buf;
    const char *src = a[0].view.buf;
    at = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        memcpy(dst + at * item, src + starts[i] * item, (size_t)(lengths[i] * item));
        at += lengths[i];
    }
    release(a, 4);
    return PyLong_FromSsize_t(at);
fail:
    release(a, 4);
    return NULL;
}

#define FASTCALL(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}

#define FASTCALL(name, doc) {#name, (PyCFunction)(void (*)(void))name, METH_FASTCALL, doc}

static PyMethodDef methods[] = {
    FASTCALL(candidates,
     "candidates(mark, size, end, phase, page, slots_out, pages_out) -> (k, pages)"),
    FASTCALL(steps,
     "steps(uniforms, pages, k, parent_joins, taken_out) -> (emptied, joined_taken)"),
    FASTCALL(trim,
     "trim(size, slots, taken, k, page, off, starts_out, lengths_out) -> tokens cut"),
    FASTCALL(trim_gather,
     "trim_gather(size, slots, taken, k, page, off, source, out, at) -> tokens cut"),
    FASTCALL(gather,
     "gather(source, starts, lengths, k, out) -> items copied"),
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kernels",
    "RLT's per-eviction loops, compiled (see engine_ext.cache.kernels).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&module); }
