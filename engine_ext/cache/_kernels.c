/* RLT's per-eviction loops over the leaf registry, compiled (engine_ext.cache.kernels).

An eviction of a few thousand tokens is cheap work (a few hundred leaves, a few thousand
picks) behind many small numpy calls, and each call costs microseconds when the caches are
cold, as they are in a scheduler between batches: most of the eviction's time. These
loops replace those calls, one C call each. They read and write numpy arrays (any object
with a C-contiguous, one-dimensional buffer of the right item size) in place and allocate
nothing. engine_ext/cache/kernels.py has the same functions in numpy, used when this
module is not built; tests check that both give the same results.

Only the CPython C API is used (the buffer protocol; no numpy headers).
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <math.h>
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

/* -1 with a ValueError naming `names` unless each array held in a[0..count) has n items. */
static int same_length(Arr *a, int count, Py_ssize_t n, const char *names) {
    for (int i = 0; i < count; i++) {
        if (a[i].held && length(&a[i]) != n) {
            PyErr_Format(PyExc_ValueError, "%s: expected arrays of one length", names);
            return -1;
        }
    }
    return 0;
}

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

/* counts[:leaves] = how many of uniforms[start:start + n] pick each leaf, a pick being
   floor(u * leaves), exactly as numpy's (u * leaves).astype(intp) computes it. With
   `pages` (else NULL), the count stops at the first pick that empties a leaf (counts[i]
   reaching pages[i]) and returns 1 (the counts then partial); else 0 once all n are
   counted, or -1 with a ValueError set if a uniform is not in [0, 1). */
static int count_picks(const double *uniforms, Py_ssize_t start, Py_ssize_t n,
                       Py_ssize_t leaves, int64_t *counts, const int64_t *pages) {
    const double *u = uniforms + start;
    const double scale = (double)leaves;
    memset(counts, 0, (size_t)leaves * sizeof(int64_t));
    for (Py_ssize_t j = 0; j < n; j++) {
        double x = u[j] * scale;
        if (!(x >= 0.0 && x < scale)) {
            PyErr_Format(PyExc_ValueError, "uniforms[%zd] is not in [0, 1)", start + j);
            return -1;
        }
        Py_ssize_t i = (Py_ssize_t)x;
        if (++counts[i] >= (pages ? pages[i] : INT64_MAX)) return 1;
    }
    return 0;
}

/* Equal-odds multinomial counts, drawn as one binomial per leaf from the uniforms.

   n picks spread uniformly over k leaves are, leaf by leaf, binomial: leaf j gets
   Bin(n_j, 1/(k - j)) of the n_j picks the earlier leaves left, the last leaf the rest.
   Each binomial is one uniform u, inverted by a search outward from the mode: the
   outcomes are visited in the order m, m + 1, m - 1, m + 2, ... and the first at which
   their probabilities add up past u is drawn, so any fixed order of the outcomes would
   do, and this one takes about 1.6 standard deviations of steps. The probability at the
   mode is Loader's saddle-point form (C. Loader, "Fast and Accurate Computation of
   Binomial Probabilities", 2000): exp(-stirlerr and deviance terms) / sqrt(2 pi x (n -
   x) / n), accurate to a few ulps where log-gamma differences lose digits as n grows;
   its neighbours follow by the exact ratio f(x + 1) / f(x) = (n - x) / ((x + 1)(r - 1))
   for p = 1 / r. If rounding leaves the visited mass short of u (probability ~1e-13)
   the mode is drawn. engine_ext/cache/kernels.py's numpy_even_counts is the same
   arithmetic in Python, step for step, so both give the same counts. */

#define LN_2PI 1.8378770664093456

/* log(n!) - log(sqrt(2 pi n) (n / e)^n), n >= 1: exact values up to 15, else Stirling's
   series (its error is below the next term, under 1e-16 from 16 on). */
static const double STIRLERR_SMALL[16] = {
    0.0, 0.08106146679532726, 0.0413406959554093, 0.02767792568499834,
    0.020790672103765093, 0.016644691189821193, 0.013876128823070748,
    0.01189670994589177, 0.010411265261972096, 0.009255462182712733,
    0.00833056343336287, 0.007573675487951841, 0.00694284010720953,
    0.006408994188004207, 0.0059513701127588475, 0.005554733551962801,
};
#define S0 0.083333333333333333 /* 1/12 */
#define S1 0.0027777777777777778 /* 1/360 */
#define S2 0.00079365079365079365 /* 1/1260 */
#define S3 0.00059523809523809524 /* 1/1680 */
#define S4 0.00084175084175084175 /* 1/1188 */

static double stirlerr(int64_t n) {
    if (n < 16) return STIRLERR_SMALL[n];
    double x = (double)n, nn = x * x;
    if (n > 500) return (S0 - S1 / nn) / x;
    if (n > 80) return (S0 - (S1 - S2 / nn) / nn) / x;
    if (n > 35) return (S0 - (S1 - (S2 - S3 / nn) / nn) / nn) / x;
    return (S0 - (S1 - (S2 - (S3 - S4 / nn) / nn) / nn) / nn) / x;
}

/* The deviance term x log(x / mu) + mu - x, by its series where x is near mu. */
static double bd0(double x, double mu) {
    double d = x - mu;
    if (fabs(d) < 0.1 * (x + mu)) {
        double v = d / (x + mu);
        double s = d * v;
        double ej = 2.0 * x * v;
        double vv = v * v;
        for (int j = 1; j < 1000; j++) {
            ej = ej * vv;
            double s1 = s + ej / (double)(2 * j + 1);
            if (s1 == s) return s1;
            s = s1;
        }
        return s;
    }
    return x * log(x / mu) + mu - x;
}

/* P(Bin(n, 1/r) = x), 0 <= x <= n, r >= 2. */
static double even_pmf(int64_t x, int64_t n, int64_t r) {
    double p = 1.0 / (double)r, q = 1.0 - p;
    if (x == 0) return exp((double)n * log1p(-p));
    if (x == n) return exp((double)n * log(p));
    double lc = stirlerr(n) - stirlerr(x) - stirlerr(n - x) - bd0((double)x, (double)n * p) -
                bd0((double)(n - x), (double)n * q);
    double lf = LN_2PI + log((double)x) + log1p(-(double)x / (double)n);
    return exp(lc - 0.5 * lf);
}

/* A draw of Bin(n, 1/r), r >= 2, from one uniform u in [0, 1). */
static int64_t even_binomial(int64_t n, int64_t r, double u) {
    if (n == 0) return 0;
    int64_t m = (n + 1) / r; /* the mode, floor((n + 1) p) */
    if (m > n) m = n;
    double f = even_pmf(m, n, r), cum = f, f_hi = f, f_lo = f;
    if (u < cum) return m;
    int64_t hi = m, lo = m;
    for (;;) {
        int up = hi < n && f_hi > 0.0, down = lo > 0 && f_lo > 0.0;
        if (!up && !down) return m; /* rounding left the mass short of u */
        if (up) {
            f_hi = f_hi * ((double)(n - hi) / (double)((hi + 1) * (r - 1)));
            hi++;
            cum = cum + f_hi;
            if (u < cum) return hi;
        }
        if (down) {
            f_lo = f_lo * ((double)(lo * (r - 1)) / (double)(n - lo + 1));
            lo--;
            cum = cum + f_lo;
            if (u < cum) return lo;
        }
    }
}

/* Hypergeometric draws, the same way: the number of `good` items in a uniformly random
   sample of `sample` items out of `good + bad`, inverted from one uniform by the search
   outward from the mode. The probability at the mode is R's dhyper, three of Loader's
   binomial probabilities, b(x; good) b(sample - x; bad) / b(sample; good + bad), all at
   p = sample / (good + bad), so that the saddle-point terms cancel accurately; the
   neighbours follow by the exact ratio f(x + 1) / f(x) = (good - x)(sample - x) / ((x + 1)
   (bad - sample + x + 1)), whose integer products are exact in double up to 2^53. */

/* P(Bin(n, p) = x), 0 <= x <= n, 0 < p < 1, q = 1 - p: R's dbinom_raw. */
static double binom_pmf(int64_t x, int64_t n, double p, double q) {
    if (x == 0) {
        if (n == 0) return 1.0;
        return exp(p < 0.1 ? -bd0((double)n, (double)n * q) - (double)n * p
                           : (double)n * log(q));
    }
    if (x == n)
        return exp(q < 0.1 ? -bd0((double)n, (double)n * p) - (double)n * q
                           : (double)n * log(p));
    double lc = stirlerr(n) - stirlerr(x) - stirlerr(n - x) - bd0((double)x, (double)n * p) -
                bd0((double)(n - x), (double)n * q);
    double lf = LN_2PI + log((double)x) + log1p(-(double)x / (double)n);
    return exp(lc - 0.5 * lf);
}

/* A draw of the hypergeometric (good, bad, sample), 0 <= sample <= good + bad, from one
   uniform u in [0, 1). */
static int64_t hypergeometric(int64_t good, int64_t bad, int64_t sample, double u) {
    int64_t total = good + bad;
    int64_t lo = sample - bad > 0 ? sample - bad : 0, hi = sample < good ? sample : good;
    if (lo >= hi) return lo;
    int64_t m = (sample + 1) * (good + 1) / (total + 2); /* the mode */
    if (m < lo) m = lo;
    if (m > hi) m = hi;
    double p = (double)sample / (double)total, q = (double)(total - sample) / (double)total;
    double f = binom_pmf(m, good, p, q) * binom_pmf(sample - m, bad, p, q) /
               binom_pmf(sample, total, p, q);
    double cum = f, f_up = f, f_down = f;
    if (u < cum) return m;
    int64_t up = m, down = m;
    for (;;) {
        int go_up = up < hi && f_up > 0.0, go_down = down > lo && f_down > 0.0;
        if (!go_up && !go_down) return m; /* rounding left the mass short of u */
        if (go_up) {
            f_up = f_up * ((double)((good - up) * (sample - up)) /
                           (double)((up + 1) * (bad - sample + up + 1)));
            up++;
            cum = cum + f_up;
            if (u < cum) return up;
        }
        if (go_down) {
            f_down = f_down * ((double)(down * (bad - sample + down)) /
                               (double)((good - down + 1) * (sample - down + 1)));
            down--;
            cum = cum + f_down;
            if (u < cum) return down;
        }
    }
}

/* counts[:k] = n picks over k equal leaves, from uniforms[start:start + k - 1]; -1 with a
   ValueError set if a uniform is not in [0, 1). */
static int even_draw(const double *uniforms, Py_ssize_t start, int64_t n, Py_ssize_t k,
                     int64_t *counts) {
    const double *u = uniforms + start;
    int64_t left = n;
    for (Py_ssize_t j = 0; j + 1 < k; j++) {
        if (!(u[j] >= 0.0 && u[j] < 1.0)) {
            PyErr_Format(PyExc_ValueError, "uniforms[%zd] is not in [0, 1)", start + j);
            return -1;
        }
        int64_t x = even_binomial(left, (int64_t)(k - j), u[j]);
        counts[j] = x;
        left -= x;
    }
    counts[k - 1] = left;
    return 0;
}

/* first_round(mark, size, end, phase, page, need, uniforms, start, picks_per_leaf,
               binomial_per_leaf, max_rounds, step_pages, slots_out, pages_out, counts_out)
   -> (status, k, smallest, used, slots_out, pages_out)

   An eviction's common case in one call. The candidates: the slots i < end with
   mark[i] < phase, in order, into slots_out[:k], their sizes in pages (size[i] // page)
   into pages_out[:k], and the smallest of those (0 if k == 0). Then, unless
   leaf_sampling would go straight to the continuous-time draw, the first round's counts
   into counts_out[:k], drawn from the uniforms from `start` as leaf_sampling's
   _draw_picks draws them with a Draws: `need` buffered picks (fewer than binomial_per_leaf
   per leaf, and if more than picks_per_leaf, no more than the whole buffer: the uniforms'
   length) or else even_draw()'s counts (k - 1 uniforms); buffered picks always where
   leaf_sampling draws page by page (need at most step_pages and the buffer's length, a
   leaf may empty, and one is likely to), unless it draws compiled rounds there (at least
   binomial_per_leaf picks per leaf and at most max_rounds leaves likely to empty: then
   even_draw()'s counts); `used` is how many uniforms that takes (what is
   left of the buffer must hold them, else the caller draws). Status 0: no leaf emptied,
   so the counts are the whole draw (the caller consumes `used` uniforms); 3: a leaf
   emptied in the picks of a page-by-page draw (counted up to that pick only), which the
   caller runs from `start` (steps()); 4: a leaf emptied in the first of compiled rounds,
   which the caller runs from `start` (cut_rounds(), whose first round is these counts);
   1: the caller draws, from the candidates gathered here (for 1, 3 and 4 no uniform was
   consumed; `used` is 0); 2: the candidates hold fewer than `need` pages (a new phase is
   due). The rules are leaf_sampling's _choose and _draw_picks. */
static PyObject *first_round(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 15, "first_round") < 0) return NULL;
    Arr a[6];
    memset(a, 0, sizeof a);
    Py_ssize_t end, phase, page, need, start, per_leaf, binomial_per_leaf, max_rounds,
        step_pages;
    if (get_ssize(args[2], &end, "end") < 0 || get_ssize(args[3], &phase, "phase") < 0 ||
        get_ssize(args[4], &page, "page") < 0 || get_ssize(args[5], &need, "need") < 0 ||
        get_ssize(args[7], &start, "start") < 0 ||
        get_ssize(args[8], &per_leaf, "picks_per_leaf") < 0 ||
        get_ssize(args[9], &binomial_per_leaf, "binomial_per_leaf") < 0 ||
        get_ssize(args[10], &max_rounds, "max_rounds") < 0 ||
        get_ssize(args[11], &step_pages, "step_pages") < 0)
        return NULL;
    if (page < 1) return PyErr_Format(PyExc_ValueError, "page: must be >= 1, got %zd", page);
    if (get(args[0], &a[0], 0, 'i', "mark") < 0 || get(args[1], &a[1], 0, 'i', "size") < 0 ||
        get(args[6], &a[2], 0, 'f', "uniforms") < 0 ||
        get(args[12], &a[3], 1, 'i', "slots_out") < 0 ||
        get(args[13], &a[4], 1, 'i', "pages_out") < 0 ||
        get(args[14], &a[5], 1, 'i', "counts_out") < 0)
        goto fail;
    if (end < 0 || end > length(&a[0]) || end > length(&a[1]) || end > length(&a[3]) ||
        end > length(&a[4]) || end > length(&a[5])) {
        PyErr_Format(PyExc_ValueError, "end: %zd is outside the arrays", end);
        goto fail;
    }
    if (start < 0 || start > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "start: %zd is outside the uniforms", start);
        goto fail;
    }
    const int64_t *mark = a[0].view.buf, *size = a[1].view.buf;
    int64_t *slots = a[3].view.buf, *pages = a[4].view.buf, *counts = a[5].view.buf;
    Py_ssize_t k = 0;
    int64_t smallest = 0, total = 0;
    for (Py_ssize_t i = 0; i < end; i++) {
        if (mark[i] < phase) {
            int64_t p = size[i] / page;
            slots[k] = i;
            pages[k] = p;
            if (k == 0 || p < smallest) smallest = p;
            total += p;
            k++;
        }
    }
    int status = 1;
    Py_ssize_t used = 0, left = length(&a[2]) - start;
    if (total < need) {
        status = 2;
    } else if (need > 0) {
        int continuous = 0, drawn = 0, many = need >= per_leaf * k; /* picks per leaf */
        /* buffered picks, else even_draw() */
        int counted = need < binomial_per_leaf * k && !(many && need > length(&a[2]));
        double mean = (double)need / (double)k;
        double bound = mean + 3.0 * sqrt(mean) + 1.0;
        /* _choose: a leaf may empty and one is likely to, in few enough pages */
        int stepwise = need > smallest && need <= step_pages && need <= length(&a[2]) &&
                       !((double)smallest > bound);
        /* _choose's rounds: there, many picks per leaf and few likely to empty; the first
           round is then even_draw()'s counts (`counted` is 0) */
        int rounds = 0;
        if (need > smallest && !((double)smallest > bound) && need >= binomial_per_leaf * k) {
            Py_ssize_t likely = 0;
            for (Py_ssize_t i = 0; i < k; i++) likely += (double)pages[i] <= bound;
            rounds = likely <= max_rounds;
            if (rounds) stepwise = 0;
        }
        if (!stepwise && !rounds && need > smallest && !(many && need <= smallest * max_rounds)) {
            /* _choose: a leaf may empty, and not the multinomial rounds' case */
            if (!((double)smallest > bound)) {
                Py_ssize_t likely = 0;
                for (Py_ssize_t i = 0; i < k; i++) likely += (double)pages[i] <= bound;
                continuous = likely > max_rounds;
            }
        }
        if (continuous) {
            /* the caller's continuous-time draw */
        } else if (stepwise) {
            if (need <= left) { /* else the buffer runs short: the caller draws */
                /* the picks in order until one empties a leaf (the caller's page-by-page
                   draw then replays them), or all of them: the whole draw */
                int emptied = count_picks(a[2].view.buf, start, need, k, counts, pages);
                if (emptied < 0) goto fail;
                status = emptied ? 3 : 0;
                used = emptied ? 0 : need;
            }
        } else if (counted && need <= left) {
            if (count_picks(a[2].view.buf, start, need, k, counts, NULL) < 0) goto fail;
            used = need;
            drawn = 1;
        } else if (!counted && k - 1 <= left) {
            if (even_draw(a[2].view.buf, start, need, k, counts) < 0) goto fail;
            used = k - 1;
            drawn = 1;
        } /* else the buffer runs short: the caller draws (and refills it) */
        if (drawn) {
            status = 0;
            for (Py_ssize_t i = 0; i < k; i++) {
                if (counts[i] >= pages[i]) {
                    /* a leaf empties: the caller's draw goes on from here (rounds: the
                       caller's cut_rounds draws these counts again) */
                    status = rounds ? 4 : 1;
                    used = 0;
                    break;
                }
            }
        }
    }
    release(a, 6);
    return Py_BuildValue("(inLnOO)", status, k, (long long)smallest, used, args[12],
                         args[13]);
fail:
    release(a, 6);
    return NULL;
}

/* The arguments (uniforms, start, n, leaves, counts_out) of pick_counts and even_counts:
   the two arrays held in a[0] and a[1], n >= 0 and leaves in 1..len(counts_out); -1 with
   an error set and nothing held otherwise. Each caller checks the uniforms it reads. */
static int counts_args(PyObject *const *args, Py_ssize_t nargs, const char *fn, Arr *a,
                       Py_ssize_t *start, Py_ssize_t *n, Py_ssize_t *leaves) {
    if (check_args(nargs, 5, fn) < 0) return -1;
    if (get_ssize(args[1], start, "start") < 0 || get_ssize(args[2], n, "n") < 0 ||
        get_ssize(args[3], leaves, "leaves") < 0)
        return -1;
    if (*n < 0) {
        PyErr_Format(PyExc_ValueError, "n: must be >= 0, got %zd", *n);
        return -1;
    }
    if (get(args[0], &a[0], 0, 'f', "uniforms") < 0 ||
        get(args[4], &a[1], 1, 'i', "counts_out") < 0)
        goto fail;
    if (*leaves < 1 || *leaves > length(&a[1])) {
        PyErr_Format(PyExc_ValueError, "leaves: %zd is not in 1..len(counts_out)", *leaves);
        goto fail;
    }
    return 0;
fail:
    release(a, 2);
    return -1;
}

/* pick_counts(uniforms, start, n, leaves, counts_out) -> (counts_out, the largest count)

   count_picks() into counts_out[:leaves]. */
static PyObject *pick_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arr a[2];
    memset(a, 0, sizeof a);
    Py_ssize_t start, n, leaves;
    if (counts_args(args, nargs, "pick_counts", a, &start, &n, &leaves) < 0) return NULL;
    if (start < 0 || start > length(&a[0]) - n) {
        PyErr_Format(PyExc_ValueError, "start, n: %zd, %zd are outside the uniforms", start, n);
        goto fail;
    }
    int64_t *counts = a[1].view.buf;
    if (count_picks(a[0].view.buf, start, n, leaves, counts, NULL) < 0) goto fail;
    int64_t top = 0;
    for (Py_ssize_t i = 0; i < leaves; i++)
        if (counts[i] > top) top = counts[i];
    release(a, 2);
    return Py_BuildValue("(OL)", args[4], (long long)top);
fail:
    release(a, 2);
    return NULL;
}

/* even_counts(uniforms, start, n, leaves, counts_out) -> counts_out

   even_draw() into counts_out[:leaves]: n picks over `leaves` equal leaves, from the
   leaves - 1 uniforms from `start`. */
static PyObject *even_counts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Arr a[2];
    memset(a, 0, sizeof a);
    Py_ssize_t start, n, leaves;
    if (counts_args(args, nargs, "even_counts", a, &start, &n, &leaves) < 0) return NULL;
    if (start < 0 || start > length(&a[0]) - (leaves - 1)) {
        PyErr_Format(PyExc_ValueError, "start, leaves: %zd, %zd are outside the uniforms",
                     start, leaves);
        goto fail;
    }
    if (even_draw(a[0].view.buf, start, n, leaves, a[1].view.buf) < 0) goto fail;
    release(a, 2);
    Py_INCREF(args[4]);
    return args[4];
fail:
    release(a, 2);
    return NULL;
}

/* The next of the uniforms u[start..len) into *v (*used of them taken so far, then one
   more); 0, or -1 with a ValueError if they ran out or the uniform is not in [0, 1). */
static int next_uniform(const double *u, Py_ssize_t start, Py_ssize_t len, Py_ssize_t *used,
                        double *v) {
    if (start + *used >= len) {
        PyErr_Format(PyExc_ValueError, "uniforms: fewer than needed from start %zd (%zd)",
                     start, len - start);
        return -1;
    }
    *v = u[start + (*used)++];
    if (!(*v >= 0.0 && *v < 1.0)) {
        PyErr_Format(PyExc_ValueError, "uniforms[%zd] is not in [0, 1)", start + *used - 1);
        return -1;
    }
    return 0;
}

/* counts_emptying's draw (see there) on raw arrays: counts[:k] >= 0, remaining[:k] >= 1,
   the uniforms u[start..len) (*used set to how many it took), out[:k] (neither counts nor
   remaining), work[:5k] scratch. The position; -1 if no leaf can empty (out = the
   counts); -2 with a ValueError set if the uniforms run out or one is not in [0, 1). */
static Py_ssize_t emptying_draw(const int64_t *counts, const int64_t *remaining, Py_ssize_t k,
                                const double *u, Py_ssize_t start, Py_ssize_t len,
                                Py_ssize_t *used, int64_t *out, int64_t *work) {
    Py_ssize_t reach = 0;
    int64_t n = 0, others = 0;
    *used = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        n += counts[i];
        if (counts[i] >= remaining[i]) reach++;
        else others += counts[i];
    }
    if (reach == 0) {
        memcpy(out, counts, (size_t)k * sizeof(int64_t));
        return -1;
    }
    /* for each leaf that can empty: its index, its picks in the span, the pages it still
       has to take to empty (from the span's start), its picks before the span, and its
       picks in the span's first half */
    int64_t *idx = work, *span = work + reach, *due = work + 2 * reach;
    int64_t *before = work + 3 * reach, *half = work + 4 * reach;
    for (Py_ssize_t i = 0, j = 0; i < k; i++) {
        if (counts[i] >= remaining[i]) {
            idx[j] = i;
            span[j] = counts[i];
            due[j] = remaining[i];
            before[j] = 0;
            j++;
        }
    }
    int64_t length_ = n, before_others = 0, position = 0;
    double v;
    while (length_ > 1) {
        int64_t first = length_ / 2, pool = length_, take = first;
        int reached = 0;
        for (Py_ssize_t j = 0; j < reach; j++) {
            if (next_uniform(u, start, len, used, &v) < 0) return -2;
            int64_t x = hypergeometric(span[j], pool - span[j], take, v);
            half[j] = x;
            pool -= span[j];
            take -= x;
            reached |= x >= due[j];
        }
        /* take: the first half's picks of the leaves that cannot empty */
        if (reached) {
            for (Py_ssize_t j = 0; j < reach; j++) span[j] = half[j];
            length_ = first;
        } else {
            for (Py_ssize_t j = 0; j < reach; j++) {
                span[j] -= half[j];
                due[j] -= half[j];
                before[j] += half[j];
            }
            before_others += take;
            position += first;
            length_ -= first;
        }
    }
    /* one position left: the pick of the leaf whose last page it is */
    memset(out, 0, (size_t)k * sizeof(int64_t));
    for (Py_ssize_t j = 0; j < reach; j++) out[idx[j]] = before[j] + (span[j] == 1 && due[j] == 1);
    /* the leaves that cannot empty share before_others of their `others` picks */
    int64_t pool = others, take = before_others;
    Py_ssize_t last = -1;
    for (Py_ssize_t i = 0; i < k; i++)
        if (counts[i] < remaining[i]) last = i;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (counts[i] >= remaining[i]) continue;
        if (i == last) {
            out[i] = take;
            break;
        }
        if (next_uniform(u, start, len, used, &v) < 0) return -2;
        int64_t x = hypergeometric(counts[i], pool - counts[i], take, v);
        out[i] = x;
        pool -= counts[i];
        take -= x;
    }
    return (Py_ssize_t)position;
}

/* The active leaves of steps and cut_rounds, by position: label, pages left, pages taken so
   far. Candidates have labels 0 .. k - 1 (their totals go to taken[label]); a joined
   parent gets the next label from k and its total goes to joined[label - k]. */
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

/* (taken_out, n, emptied, joined_taken) once the draw is over: the totals of the leaves
   still holding pages recorded first. NULL with an error set. */
static PyObject *leaves_result(Leaves *s, PyObject *taken_out, Py_ssize_t n) {
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
    return Py_BuildValue("(OnON)", taken_out, n, s->emptied, joined_list);
}

/* steps(uniforms, start, need, pages, k, parent_joins, taken_out)
   -> (taken_out, used, emptied, joined_taken)

   RLT's draw by its definition, one page at a time. The k candidates (labels 0 .. k - 1,
   pages[i] >= 1 pages each) are the active leaves, in order. Each pick is floor(u *
   active) of the next uniform from `start`, the active leaf at that position loses a page;
   a leaf that empties leaves the order (the others keep theirs), its label goes to
   `emptied`, and parent_joins(label) (an int or None) may add its parent with that many
   pages at the end of the order, as label k, k + 1, ... Stops after `need` picks or when
   no leaf is left. taken_out[:k] = pages taken per candidate; joined_taken = pages taken
   per joined parent, a list; `used` = picks made (uniforms used). The active count never
   exceeds k (a parent joins only in place of its emptied child). Picks fewer than the
   smallest active leaf holds can empty none: runs of at least STEP_BLOCK of them are
   counted without the emptying check (the smallest is looked up again after as many
   single picks as there are active leaves, so the lookups cost at most one pass each). */

#define STEP_BLOCK 16
static PyObject *steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 7, "steps") < 0) return NULL;
    Arr a[3];
    memset(a, 0, sizeof a);
    PyObject *out = NULL;
    Py_ssize_t start, need, k;
    if (get_ssize(args[1], &start, "start") < 0 || get_ssize(args[2], &need, "need") < 0 ||
        get_ssize(args[4], &k, "k") < 0)
        return NULL;
    PyObject *joins = args[5];
    if (!PyCallable_Check(joins)) {
        PyErr_SetString(PyExc_TypeError, "parent_joins: expected a callable");
        return NULL;
    }
    if (get(args[0], &a[0], 0, 'f', "uniforms") < 0 || get(args[3], &a[1], 0, 'i', "pages") < 0 ||
        get(args[6], &a[2], 1, 'i', "taken_out") < 0)
        goto fail;
    if (k < 0 || k > length(&a[1]) || k > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "k: %zd is outside the arrays", k);
        goto fail;
    }
    if (need < 0 || start < 0 || start > length(&a[0]) - need) {
        PyErr_Format(PyExc_ValueError, "start, need: %zd, %zd are outside the uniforms", start,
                     need);
        goto fail;
    }
    const int64_t *pages = a[1].view.buf;
    const double *u = (const double *)a[0].view.buf + start;
    Leaves s;
    if (leaves_init(&s, pages, k, a[2].view.buf, joins) < 0) goto done;
    int64_t *left = s.left, *picked = s.picked;
    Py_ssize_t used = 0, careful = 0;
    while (used < need && s.active > 0) {
        const double scale = (double)s.active;
        if (careful == 0) {
            /* fewer picks than the smallest leaf holds empty none: count them in a block */
            int64_t smallest = left[0];
            for (Py_ssize_t i = 1; i < s.active; i++)
                if (left[i] < smallest) smallest = left[i];
            Py_ssize_t block = need - used;
            if (smallest - 1 < block) block = (Py_ssize_t)(smallest - 1);
            if (block >= STEP_BLOCK) {
                for (Py_ssize_t t = 0; t < block; t++) {
                    double x = u[used + t] * scale;
                    if (!(x >= 0.0 && x < scale)) {
                        PyErr_Format(PyExc_ValueError, "uniforms[%zd] is not in [0, 1)",
                                     start + used + t);
                        goto done;
                    }
                    Py_ssize_t j = (Py_ssize_t)x;
                    left[j]--;
                    picked[j]++;
                }
                used += block;
                continue;
            }
            careful = s.active; /* this many picks one at a time before the next scan */
        }
        careful--;
        double x = u[used] * scale;
        if (!(x >= 0.0 && x < scale)) {
            PyErr_Format(PyExc_ValueError, "uniforms[%zd] is not in [0, 1)", start + used);
            goto done;
        }
        used++;
        Py_ssize_t j = (Py_ssize_t)x;
        picked[j]++;
        if (--left[j] > 0) continue;
        if (leaves_empty(&s, j) < 0) goto done;
    }
    out = leaves_result(&s, args[6], used);
done:
    leaves_free(&s);
fail:
    release(a, 3);
    return out;
}

/* cut_rounds(uniforms, start, need, pages, k, parent_joins, refill, taken_out)
   -> (taken_out, end, emptied, joined_taken)

   steps' draw (the same leaves, order, labels, parent_joins and results) by rounds, for
   leaves that get many picks each: a round draws all the picks still needed as counts
   over the active leaves (even_draw(): a binomial per leaf), and if one reaches what its
   leaf holds, where the first leaf empties among them (emptying_draw(): the round's
   picks up to that one are taken, the rest drawn again over the new set in the next
   round, which the process's independence makes exact). A round costs O(active) draws
   plus O(log picks) per leaf that can empty, not a draw per page. Uniforms come from
   `start` on; when fewer are left than a round's draws may need, refill() (which
   refills `uniforms` in place: a Draws' buffer) is called and the round goes on from
   position 0. `end` is the position after the last uniform used. The active count
   never exceeds k, so a round needs at most k * (bit_length(need) + 2) uniforms, which
   the buffer must hold. */
static PyObject *cut_rounds(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 8, "cut_rounds") < 0) return NULL;
    Arr a[3];
    memset(a, 0, sizeof a);
    PyObject *out = NULL;
    int64_t *work = NULL;
    Py_ssize_t start, need, k;
    if (get_ssize(args[1], &start, "start") < 0 || get_ssize(args[2], &need, "need") < 0 ||
        get_ssize(args[4], &k, "k") < 0)
        return NULL;
    PyObject *joins = args[5], *refill = args[6];
    if (!PyCallable_Check(joins) || !PyCallable_Check(refill)) {
        PyErr_SetString(PyExc_TypeError, "parent_joins, refill: expected callables");
        return NULL;
    }
    if (get(args[0], &a[0], 0, 'f', "uniforms") < 0 || get(args[3], &a[1], 0, 'i', "pages") < 0 ||
        get(args[7], &a[2], 1, 'i', "taken_out") < 0)
        goto fail;
    if (k < 0 || k > length(&a[1]) || k > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "k: %zd is outside the arrays", k);
        goto fail;
    }
    Py_ssize_t len = length(&a[0]);
    if (need < 0 || start < 0 || start > len) {
        PyErr_Format(PyExc_ValueError, "start, need: %zd, %zd: need >= 0, start in the uniforms",
                     start, need);
        goto fail;
    }
    int bits = 0;
    for (int64_t v = need; v > 0; v >>= 1) bits++;
    if ((int64_t)k * (bits + 2) > (int64_t)len) {
        PyErr_Format(PyExc_ValueError, "uniforms: %zd hold fewer than a round may need (%lld)",
                     len, (long long)k * (bits + 2));
        goto fail;
    }
    const int64_t *pages = a[1].view.buf;
    const double *u = (const double *)a[0].view.buf;
    Leaves s;
    if (leaves_init(&s, pages, k, a[2].view.buf, joins) < 0) goto done;
    /* the round's counts, the picks up to its first emptying, emptying_draw()'s scratch */
    work = PyMem_Malloc((size_t)(7 * (k ? k : 1)) * sizeof(int64_t));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t *counts = work, *upto = work + k, *scratch = work + 2 * k;
    Py_ssize_t pos = start;
    int64_t left_need = need;
    while (left_need > 0 && s.active > 0) {
        Py_ssize_t active = s.active;
        if (pos + active - 1 > len) { /* the round's counts: active - 1 uniforms */
            PyObject *r = PyObject_CallNoArgs(refill);
            if (r == NULL) goto done;
            Py_DECREF(r);
            pos = 0;
        }
        if (even_draw(u, pos, left_need, active, counts) < 0) goto done;
        pos += active - 1;
        Py_ssize_t reach = 0;
        for (Py_ssize_t i = 0; i < active; i++) reach += counts[i] >= s.left[i];
        if (reach == 0) { /* nobody empties: every pick stands */
            for (Py_ssize_t i = 0; i < active; i++) {
                s.left[i] -= counts[i];
                s.picked[i] += counts[i];
            }
            left_need = 0;
            break;
        }
        int nbits = 0;
        for (int64_t v = left_need; v > 0; v >>= 1) nbits++;
        if (pos + reach * nbits + active > len) { /* what emptying_draw() may take */
            PyObject *r = PyObject_CallNoArgs(refill);
            if (r == NULL) goto done;
            Py_DECREF(r);
            pos = 0;
        }
        Py_ssize_t used = 0;
        Py_ssize_t at = emptying_draw(counts, s.left, active, u, pos, len, &used, upto, scratch);
        if (at < 0) {
            if (at == -1) PyErr_SetString(PyExc_AssertionError, "cut_rounds: no leaf emptied");
            goto done;
        }
        pos += used;
        left_need -= at + 1;
        Py_ssize_t gone = -1;
        for (Py_ssize_t i = 0; i < active; i++) {
            s.left[i] -= upto[i];
            s.picked[i] += upto[i];
            if (s.left[i] == 0) gone = i;
        }
        if (leaves_empty(&s, gone) < 0) goto done;
    }
    out = leaves_result(&s, args[7], pos);
done:
    PyMem_Free(work);
    leaves_free(&s);
fail:
    release(a, 3);
    return out;
}

/* bridge_params(start, end, size, lo, hi, t_lo, t_hi, t, n_out, p_out) -> (n_out, p_out)

   leaf_sampling._bridge's binomial parameters, per leaf i (start, end, t's: float64; size,
   lo, hi: int64; hi may be None): a leaf alive at t (start < t < end) draws from its
   rings not yet placed, hi - lo - (end <= t_hi), or size - 1 - lo without hi, each at t
   with probability (t - lower) / (upper - lower), lower = max(start, t_lo), upper =
   min(end, t_hi); any other leaf draws nothing (n 0, p 0). The same float64 operations as
   the numpy code, so numpy's binomial gets the same parameters and makes the same draw. */
static PyObject *bridge_params(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 10, "bridge_params") < 0) return NULL;
    Arr a[7];
    memset(a, 0, sizeof a);
    double t_lo = PyFloat_AsDouble(args[5]), t_hi = PyFloat_AsDouble(args[6]),
           t = PyFloat_AsDouble(args[7]);
    if (PyErr_Occurred()) return PyErr_Format(PyExc_TypeError, "t_lo, t_hi, t: expected floats");
    int with_hi = args[4] != Py_None;
    if (get(args[0], &a[0], 0, 'f', "start") < 0 || get(args[1], &a[1], 0, 'f', "end") < 0 ||
        get(args[2], &a[2], 0, 'i', "size") < 0 || get(args[3], &a[3], 0, 'i', "lo") < 0 ||
        (with_hi && get(args[4], &a[4], 0, 'i', "hi") < 0) ||
        get(args[8], &a[5], 1, 'i', "n_out") < 0 || get(args[9], &a[6], 1, 'f', "p_out") < 0)
        goto fail;
    Py_ssize_t n = length(&a[2]);
    if (same_length(a, 7, n, "start, end, size, lo, hi, n_out, p_out") < 0) goto fail;
    const double *start = a[0].view.buf, *end = a[1].view.buf;
    const int64_t *size = a[2].view.buf, *lo = a[3].view.buf;
    const int64_t *hi = with_hi ? a[4].view.buf : NULL;
    int64_t *n_out = a[5].view.buf;
    double *p_out = a[6].view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (start[i] < t && end[i] > t) {
            double lower = start[i] > t_lo ? start[i] : t_lo;
            double upper = end[i] < t_hi ? end[i] : t_hi;
            n_out[i] = with_hi ? hi[i] - lo[i] - (end[i] <= t_hi) : size[i] - 1 - lo[i];
            p_out[i] = (t - lower) / (upper - lower);
        } else {
            n_out[i] = 0;
            p_out[i] = 0.0;
        }
    }
    release(a, 7);
    return Py_BuildValue("(OO)", args[8], args[9]);
fail:
    release(a, 7);
    return NULL;
}

/* bridge_finish(start, end, size, lo, drawn, t) -> (drawn, their sum)

   leaf_sampling._bridge's ring counts at t, in place of the binomial draws: size for a
   leaf that emptied by t (end <= t), 0 for one not yet joined (start >= t), else
   lo + drawn. */
static PyObject *bridge_finish(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 6, "bridge_finish") < 0) return NULL;
    Arr a[5];
    memset(a, 0, sizeof a);
    double t = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return PyErr_Format(PyExc_TypeError, "t: expected a float");
    if (get(args[0], &a[0], 0, 'f', "start") < 0 || get(args[1], &a[1], 0, 'f', "end") < 0 ||
        get(args[2], &a[2], 0, 'i', "size") < 0 || get(args[3], &a[3], 0, 'i', "lo") < 0 ||
        get(args[4], &a[4], 1, 'i', "drawn") < 0)
        goto fail;
    Py_ssize_t n = length(&a[2]);
    if (same_length(a, 5, n, "start, end, size, lo, drawn") < 0) goto fail;
    const double *start = a[0].view.buf, *end = a[1].view.buf;
    const int64_t *size = a[2].view.buf, *lo = a[3].view.buf;
    int64_t *drawn = a[4].view.buf, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        drawn[i] = end[i] <= t ? size[i] : start[i] >= t ? 0 : lo[i] + drawn[i];
        total += drawn[i];
    }
    release(a, 5);
    return Py_BuildValue("(OL)", args[4], (long long)total);
fail:
    release(a, 5);
    return NULL;
}

/* gap_rings(start, end, lo, hi, t_lo, t_hi, rings_out) -> (rings_out, their sum)

   leaf_sampling._first_rings_in_gap, before its draw: per leaf, the rings between t_lo and
   t_hi whose times are still to be drawn, hi - lo - last, where last says that the leaf's
   final ring (at its end) is in the gap: t_lo < end <= t_hi. */
static PyObject *gap_rings(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 7, "gap_rings") < 0) return NULL;
    Arr a[5];
    memset(a, 0, sizeof a);
    double t_lo = PyFloat_AsDouble(args[4]), t_hi = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred()) return PyErr_Format(PyExc_TypeError, "t_lo, t_hi: expected floats");
    if (get(args[0], &a[0], 0, 'f', "start") < 0 || get(args[1], &a[1], 0, 'f', "end") < 0 ||
        get(args[2], &a[2], 0, 'i', "lo") < 0 || get(args[3], &a[3], 0, 'i', "hi") < 0 ||
        get(args[6], &a[4], 1, 'i', "rings_out") < 0)
        goto fail;
    Py_ssize_t n = length(&a[2]);
    if (same_length(a, 5, n, "start, end, lo, hi, rings_out") < 0) goto fail;
    const double *end = a[1].view.buf;
    const int64_t *lo = a[2].view.buf, *hi = a[3].view.buf;
    int64_t *rings = a[4].view.buf, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        rings[i] = hi[i] - lo[i] - (end[i] > t_lo && end[i] <= t_hi);
        if (rings[i] < 0) {
            PyErr_Format(PyExc_ValueError, "hi, lo: leaf %zd has fewer rings at t_hi than at "
                         "t_lo", i);
            goto fail;
        }
        total += rings[i];
    }
    release(a, 5);
    return Py_BuildValue("(OL)", args[6], (long long)total);
fail:
    release(a, 5);
    return NULL;
}

typedef struct {
    double t;
    int64_t label;
} Ring;

/* Reorder rings[0..n) so that rings[0..k) hold the k earliest (k in 1..n; ties at the
   boundary go either way, as numpy's argpartition lets them). Quickselect: Hoare
   partitions around a median of three, O(n) expected. */
static void select_earliest(Ring *rings, Py_ssize_t n, Py_ssize_t k) {
    Py_ssize_t lo = 0, hi = n - 1, target = k - 1;
    while (hi > lo) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        Ring tmp;
        if (rings[mid].t < rings[lo].t) { tmp = rings[mid]; rings[mid] = rings[lo]; rings[lo] = tmp; }
        if (rings[hi].t < rings[lo].t) { tmp = rings[hi]; rings[hi] = rings[lo]; rings[lo] = tmp; }
        if (rings[hi].t < rings[mid].t) { tmp = rings[hi]; rings[hi] = rings[mid]; rings[mid] = tmp; }
        double pivot = rings[mid].t;
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (rings[i].t < pivot) i++;
            while (rings[j].t > pivot) j--;
            if (i <= j) {
                tmp = rings[i];
                rings[i] = rings[j];
                rings[j] = tmp;
                i++;
                j--;
            }
        }
        if (target <= j) {
            hi = j;
        } else if (target >= i) {
            lo = i;
        } else {
            break; /* rings[j + 1 .. i - 1] equal the pivot, the target among them */
        }
    }
}

/* gap_first(start, end, lo, t_lo, t_hi, rings, uniforms, wanted, out) -> out

   leaf_sampling._first_rings_in_gap, after its draw: leaf i's rings[i] rings at
   max(start, t_lo) + span * u, span = min(end, t_hi) - max(start, t_lo), with u the next
   of `uniforms` in leaf order (as numpy's repeat lays them out), and its final ring at end
   if that is in the gap (t_lo < end <= t_hi); out = lo + how many of the `wanted` earliest
   of all those rings each leaf has. */
static PyObject *gap_first(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 9, "gap_first") < 0) return NULL;
    Arr a[6];
    memset(a, 0, sizeof a);
    Ring *all = NULL;
    Py_ssize_t wanted;
    double t_lo = PyFloat_AsDouble(args[3]), t_hi = PyFloat_AsDouble(args[4]);
    if (PyErr_Occurred()) return PyErr_Format(PyExc_TypeError, "t_lo, t_hi: expected floats");
    if (get_ssize(args[7], &wanted, "wanted") < 0) return NULL;
    if (get(args[0], &a[0], 0, 'f', "start") < 0 || get(args[1], &a[1], 0, 'f', "end") < 0 ||
        get(args[2], &a[2], 0, 'i', "lo") < 0 || get(args[5], &a[3], 0, 'i', "rings") < 0 ||
        get(args[8], &a[4], 1, 'i', "out") < 0 || get(args[6], &a[5], 0, 'f', "uniforms") < 0)
        goto fail;
    Py_ssize_t n = length(&a[2]);
    if (same_length(a, 5, n, "start, end, lo, rings, out") < 0) goto fail;
    const double *start = a[0].view.buf, *end = a[1].view.buf, *u = a[5].view.buf;
    const int64_t *lo = a[2].view.buf, *rings = a[3].view.buf;
    int64_t *out = a[4].view.buf;
    Py_ssize_t drawn = 0, total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rings[i] < 0) {
            PyErr_Format(PyExc_ValueError, "rings[%zd] is negative", i);
            goto fail;
        }
        drawn += rings[i];
        total += rings[i] + (end[i] > t_lo && end[i] <= t_hi);
    }
    if (drawn != length(&a[5])) {
        PyErr_Format(PyExc_ValueError, "uniforms: expected %zd (one per ring), got %zd", drawn,
                     length(&a[5]));
        goto fail;
    }
    if (wanted < 1 || wanted > total) {
        PyErr_Format(PyExc_ValueError, "wanted: %zd is not in 1..%zd", wanted, total);
        goto fail;
    }
    all = PyMem_Malloc((size_t)total * sizeof(Ring));
    if (all == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double lower = start[i] > t_lo ? start[i] : t_lo;
        double span = (end[i] < t_hi ? end[i] : t_hi) - lower;
        for (int64_t r = 0; r < rings[i]; r++, at++) {
            all[at].t = lower + span * u[at];
            all[at].label = i;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (end[i] > t_lo && end[i] <= t_hi) {
            all[at].t = end[i];
            all[at].label = i;
            at++;
        }
    }
    if (wanted < total) select_earliest(all, total, wanted);
    for (Py_ssize_t i = 0; i < n; i++) out[i] = lo[i];
    for (Py_ssize_t j = 0; j < wanted; j++) out[all[j].label]++;
    PyMem_Free(all);
    release(a, 6);
    Py_INCREF(args[8]);
    return args[8];
fail:
    PyMem_Free(all);
    release(a, 6);
    return NULL;
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

/* first_emptying(picks, n, remaining, k, counts_out) -> (position, counts_out)

   A cut round's picks in order (leaf indices in 0..k): the position of the first pick that
   takes a leaf's last page (counts reaching remaining[leaf]) and counts_out[:k], the picks
   per leaf up to and including it; (-1, the counts of all n picks) if none does. */
static PyObject *first_emptying(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 5, "first_emptying") < 0) return NULL;
    Arr a[3];
    memset(a, 0, sizeof a);
    Py_ssize_t n, k;
    if (get_ssize(args[1], &n, "n") < 0 || get_ssize(args[3], &k, "k") < 0) return NULL;
    if (get(args[0], &a[0], 0, 'i', "picks") < 0 || get(args[2], &a[1], 0, 'i', "remaining") < 0 ||
        get(args[4], &a[2], 1, 'i', "counts_out") < 0)
        goto fail;
    if (n < 0 || n > length(&a[0])) {
        PyErr_Format(PyExc_ValueError, "n: %zd is outside the picks", n);
        goto fail;
    }
    if (k < 1 || k > length(&a[1]) || k > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "k: %zd is not in 1..len(remaining), len(counts_out)", k);
        goto fail;
    }
    const int64_t *picks = a[0].view.buf, *remaining = a[1].view.buf;
    int64_t *counts = a[2].view.buf;
    for (Py_ssize_t i = 0; i < k; i++) {
        if (remaining[i] < 1) {
            PyErr_Format(PyExc_ValueError, "remaining[%zd] = %lld: every leaf holds a page",
                         i, (long long)remaining[i]);
            goto fail;
        }
    }
    memset(counts, 0, (size_t)k * sizeof(int64_t));
    Py_ssize_t at = -1;
    for (Py_ssize_t j = 0; j < n; j++) {
        int64_t leaf = picks[j];
        if (leaf < 0 || leaf >= k) {
            PyErr_Format(PyExc_ValueError, "picks[%zd] = %lld is not a leaf", j, (long long)leaf);
            goto fail;
        }
        if (++counts[leaf] == remaining[leaf]) {
            at = j;
            break;
        }
    }
    release(a, 3);
    return Py_BuildValue("(nO)", at, args[4]);
fail:
    release(a, 3);
    return NULL;
}

/* counts_emptying(counts, remaining, k, uniforms, start, counts_out)
       -> (position, used, counts_out)

   first_emptying for a round drawn as counts only (counts[:k] picks per leaf, n in all):
   given the counts, the picks' order is a uniformly random arrangement of them, and this
   draws where in it the first leaf empties (its count reaching remaining[leaf]) without
   drawing the arrangement, in O(log n) hypergeometric draws per leaf that can empty
   (counts >= remaining) plus one per other leaf. It halves the span of positions that
   holds the first emptying: the counts in the span's first half are a multivariate
   hypergeometric sample of the span's counts (drawn leaf by leaf, the leaves that cannot
   empty as one), and given them each half is again a uniform arrangement; the first half
   holds the first emptying if a leaf reaches its remaining pages there, else the second
   does, with what the first half took counted. At one position, that pick is the leaf's
   last page. The leaves that cannot empty then share what they took before it as a
   multivariate hypergeometric sample of their counts. Returns the position (0-based) and
   counts_out[:k], the picks per leaf up to and including it; (-1, 0, counts) if no leaf
   can empty. Each draw takes the next uniform from `start`; `used` is how many (at most
   (leaves that can empty) * bit_length(n) + k); a ValueError if the uniforms run out. */
static PyObject *counts_emptying(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_args(nargs, 6, "counts_emptying") < 0) return NULL;
    Arr a[4];
    memset(a, 0, sizeof a);
    int64_t *work = NULL;
    PyObject *result = NULL;
    Py_ssize_t k, start;
    if (get_ssize(args[2], &k, "k") < 0 || get_ssize(args[4], &start, "start") < 0) return NULL;
    if (get(args[0], &a[0], 0, 'i', "counts") < 0 ||
        get(args[1], &a[1], 0, 'i', "remaining") < 0 ||
        get(args[3], &a[2], 0, 'f', "uniforms") < 0 ||
        get(args[5], &a[3], 1, 'i', "counts_out") < 0)
        goto done;
    if (k < 1 || k > length(&a[0]) || k > length(&a[1]) || k > length(&a[3])) {
        PyErr_Format(PyExc_ValueError,
                     "k: %zd is not in 1..len(counts), len(remaining), len(counts_out)", k);
        goto done;
    }
    if (start < 0 || start > length(&a[2])) {
        PyErr_Format(PyExc_ValueError, "start: %zd is outside the uniforms", start);
        goto done;
    }
    const int64_t *counts = a[0].view.buf, *remaining = a[1].view.buf;
    int64_t *out = a[3].view.buf;
    if ((const int64_t *)out == counts || (const int64_t *)out == remaining) {
        PyErr_SetString(PyExc_ValueError, "counts_out: must not be counts or remaining");
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (remaining[i] < 1 || counts[i] < 0) {
            PyErr_Format(PyExc_ValueError,
                         "counts[%zd], remaining[%zd] = %lld, %lld: need counts >= 0 and "
                         "remaining >= 1", i, i, (long long)counts[i], (long long)remaining[i]);
            goto done;
        }
    }
    work = PyMem_Malloc((size_t)(5 * k) * sizeof(int64_t));
    if (work == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t used = 0;
    Py_ssize_t at = emptying_draw(counts, remaining, k, a[2].view.buf, start, length(&a[2]),
                                  &used, out, work);
    if (at >= -1) result = Py_BuildValue("(nnO)", at, used, args[5]);
done:
    PyMem_Free(work);
    release(a, 4);
    return result;
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

static PyMethodDef methods[] = {
    FASTCALL(first_round,
     "first_round(mark, size, end, phase, page, need, uniforms, start, picks_per_leaf, "
     "binomial_per_leaf, max_rounds, step_pages, slots_out, pages_out, counts_out) -> "
     "(status, k, "
     "smallest, used, slots_out, pages_out)"),
    FASTCALL(pick_counts,
     "pick_counts(uniforms, start, n, leaves, counts_out) -> (counts_out, the largest count)"),
    FASTCALL(even_counts,
     "even_counts(uniforms, start, n, leaves, counts_out) -> counts_out"),
    FASTCALL(steps,
     "steps(uniforms, start, need, pages, k, parent_joins, taken_out) -> (taken_out, used, "
     "emptied, joined_taken)"),
    FASTCALL(cut_rounds,
     "cut_rounds(uniforms, start, need, pages, k, parent_joins, refill, taken_out) -> "
     "(taken_out, end, emptied, joined_taken)"),
    FASTCALL(bridge_params,
     "bridge_params(start, end, size, lo, hi, t_lo, t_hi, t, n_out, p_out) -> (n_out, p_out)"),
    FASTCALL(bridge_finish,
     "bridge_finish(start, end, size, lo, drawn, t) -> (drawn, their sum)"),
    FASTCALL(gap_rings,
     "gap_rings(start, end, lo, hi, t_lo, t_hi, rings_out) -> (rings_out, their sum)"),
    FASTCALL(gap_first,
     "gap_first(start, end, lo, t_lo, t_hi, rings, uniforms, wanted, out) -> out"),
    FASTCALL(trim,
     "trim(size, slots, taken, k, page, off, starts_out, lengths_out) -> tokens cut"),
    FASTCALL(first_emptying,
     "first_emptying(picks, n, remaining, k, counts_out) -> (position, counts_out)"),
    FASTCALL(counts_emptying,
     "counts_emptying(counts, remaining, k, uniforms, start, counts_out) -> (position, used, "
     "counts_out)"),
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
