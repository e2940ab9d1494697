/* Decode a batch of row frames (lz4 blocks or zstd frames) in one call, without the GIL,
 * on a few threads, each frame straight into its row of the output batch.
 *
 * No codec source is compiled in: the codec library (the system's liblz4 / libzstd, or the
 * copy inside an installed Python package) is opened at run time with dlopen, and the few
 * functions used are declared here. mmreplay/backends/native_rows.py finds the library and
 * falls back to pure-Python decoding when this module or the library is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

typedef int (*lz4_decompress_safe_fn)(const char *, char *, int, int);
typedef void *(*zstd_create_dctx_fn)(void);
typedef size_t (*zstd_free_dctx_fn)(void *);
typedef size_t (*zstd_decompress_dctx_fn)(void *, void *, size_t, const void *, size_t);
typedef void *(*zstd_create_ddict_fn)(const void *, size_t);
typedef size_t (*zstd_free_ddict_fn)(void *);
typedef size_t (*zstd_decompress_ddict_fn)(void *, void *, size_t, const void *, size_t, const void *);
typedef unsigned (*zstd_is_error_fn)(size_t);
typedef const char *(*zstd_error_name_fn)(size_t);
typedef size_t (*zstd_set_dparameter_fn)(void *, int, int);

/* ZSTD_d_forceIgnoreChecksum (ZSTD_d_experimentalParam3 in zstd.h, since zstd 1.4.7): 1 skips
 * the content checksum of the frames decoded, 0 (the default) checks it */
#define ZSTD_D_FORCE_IGNORE_CHECKSUM 1002

static lz4_decompress_safe_fn lz4_decompress_safe;
static struct {
    zstd_create_dctx_fn create_dctx;
    zstd_free_dctx_fn free_dctx;
    zstd_decompress_dctx_fn decompress_dctx;
    zstd_create_ddict_fn create_ddict;
    zstd_free_ddict_fn free_ddict;
    zstd_decompress_ddict_fn decompress_ddict;
    zstd_is_error_fn is_error;
    zstd_error_name_fn error_name;
    zstd_set_dparameter_fn set_dparameter; /* NULL in a library without it */
} zstd;
/* the library takes ZSTD_d_forceIgnoreChecksum (tried when it is loaded); else every frame's
 * checksum is checked */
static int can_ignore_checksums;

enum { CODEC_LZ4 = 0, CODEC_ZSTD = 1 };
#define DDICT_CAPSULE "mmreplay._rowdecode.ddict"
/* rows a thread takes at a time: few enough to balance, enough to share one atomic add */
#define ROWS_PER_GRAB 8
#define MAX_THREADS 256

static int codec_of(const char *name) {
    if (strcmp(name, "lz4") == 0) return CODEC_LZ4;
    if (strcmp(name, "zstd") == 0) return CODEC_ZSTD;
    PyErr_Format(PyExc_ValueError, "codec must be 'lz4' or 'zstd', not %R", name);
    return -1;
}

static void *symbol(void *lib, const char *name, const char *path) {
    void *f = dlsym(lib, name);
    if (f == NULL) PyErr_Format(PyExc_OSError, "%s has no function %s", path, name);
    return f;
}

static void load_encoding(int codec, void *lib);

PyDoc_STRVAR(load_doc, "load(codec, path): use the codec library at path (a dlopen name); OSError if it lacks a function");

static PyObject *load(PyObject *self, PyObject *args) {
    const char *name, *path;
    if (!PyArg_ParseTuple(args, "ss", &name, &path)) return NULL;
    int codec = codec_of(name);
    if (codec < 0) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);  /* kept open for the process's life */
    if (lib == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "cannot open %s: %s", path, why ? why : "unknown error");
        return NULL;
    }
    if (codec == CODEC_LZ4) {
        void *f = symbol(lib, "LZ4_decompress_safe", path);
        if (f == NULL) return NULL;
        lz4_decompress_safe = (lz4_decompress_safe_fn)f;
        load_encoding(codec, lib);
        Py_RETURN_NONE;
    }
    void *f[8];
    const char *names[8] = {"ZSTD_createDCtx",   "ZSTD_freeDCtx",  "ZSTD_decompressDCtx",
                            "ZSTD_createDDict",  "ZSTD_freeDDict", "ZSTD_decompress_usingDDict",
                            "ZSTD_isError",      "ZSTD_getErrorName"};
    for (int i = 0; i < 8; i++)
        if ((f[i] = symbol(lib, names[i], path)) == NULL) return NULL;
    zstd.create_dctx = (zstd_create_dctx_fn)f[0];
    zstd.free_dctx = (zstd_free_dctx_fn)f[1];
    zstd.decompress_dctx = (zstd_decompress_dctx_fn)f[2];
    zstd.create_ddict = (zstd_create_ddict_fn)f[3];
    zstd.free_ddict = (zstd_free_ddict_fn)f[4];
    zstd.decompress_ddict = (zstd_decompress_ddict_fn)f[5];
    zstd.is_error = (zstd_is_error_fn)f[6];
    zstd.error_name = (zstd_error_name_fn)f[7];
    /* Whether this library can skip checksums: asked once, of a context made for it. */
    zstd.set_dparameter = (zstd_set_dparameter_fn)dlsym(lib, "ZSTD_DCtx_setParameter");
    can_ignore_checksums = 0;
    if (zstd.set_dparameter != NULL) {
        void *dctx = zstd.create_dctx();
        if (dctx != NULL) {
            can_ignore_checksums = !zstd.is_error(zstd.set_dparameter(dctx, ZSTD_D_FORCE_IGNORE_CHECKSUM, 1));
            zstd.free_dctx(dctx);
        }
    }
    load_encoding(codec, lib);
    Py_RETURN_NONE;
}

static void free_ddict(PyObject *capsule) {
    void *d = PyCapsule_GetPointer(capsule, DDICT_CAPSULE);
    if (d != NULL && zstd.free_ddict != NULL) zstd.free_ddict(d);
}

PyDoc_STRVAR(zstd_dictionary_doc, "zstd_dictionary(data): a digested zstd dictionary for decode_rows");

static PyObject *zstd_dictionary(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    if (zstd.create_ddict == NULL) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_RuntimeError, "no zstd library loaded");
        return NULL;
    }
    void *d = zstd.create_ddict(data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    if (d == NULL) {
        PyErr_SetString(PyExc_ValueError, "ZSTD_createDDict failed on this dictionary");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(d, DDICT_CAPSULE, free_ddict);
    if (capsule == NULL) zstd.free_ddict(d);
    return capsule;
}

/* One batch. The calling thread decodes too and returns once every row is done; a pool
 * thread that wakes only after that finds no rows left and goes back to sleep, so the
 * caller never waits for a thread the OS has not run yet (on a loaded machine, that wait
 * would cost more than the decoding). The job lives on the heap until its last user leaves. */
typedef struct {
    int codec;
    int verify;            /* zstd: check each frame's content checksum */
    const char *const *bases;
    const int32_t *slot;   /* frame i is in bases[slot[i]] */
    const int64_t *where, *offsets, *lengths;
    char *out;
    size_t row;
    int64_t n;
    const void *ddict;
    int64_t perm_a, perm_b; /* each row an [a, b] matrix of `item`-byte values, written transposed */
    size_t item;
    int64_t next;          /* next row to take (atomic) */
    int64_t finished;      /* rows taken and done with, decoded or not (atomic) */
    int users;             /* the caller and the pool threads not yet gone (atomic) */
    int failed;            /* set once (atomic) */
    int64_t failed_row;    /* -1: ZSTD_createDCtx failed */
    int64_t failed_result; /* what the codec returned */
    int failed_zstd;       /* failed_result is a zstd error code */
    pthread_mutex_t lock;
    pthread_cond_t all_done;
} job_t;

static void fail(job_t *job, int64_t i, int64_t result, int zstd_error) {
    int expected = 0;
    if (__atomic_compare_exchange_n(&job->failed, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        job->failed_row = i;
        job->failed_result = result;
        job->failed_zstd = zstd_error;
    }
}

/* The lock is taken only by the last rows done: a thread preempted while holding it
 * would stall the others (on a loaded machine, for a whole time slice). */
static void count_done(job_t *job, int64_t rows) {
    if (__atomic_add_fetch(&job->finished, rows, __ATOMIC_ACQ_REL) < job->n) return;
    pthread_mutex_lock(&job->lock);
    pthread_cond_signal(&job->all_done);
    pthread_mutex_unlock(&job->lock);
}

static void leave(job_t *job) {
    if (__atomic_sub_fetch(&job->users, 1, __ATOMIC_ACQ_REL) == 0) {
        pthread_mutex_destroy(&job->lock);
        pthread_cond_destroy(&job->all_done);
        free(job);
    }
}

/* One zstd decoding context per thread (pool threads and callers alike), made on its first
 * zstd batch and kept: making one costs about as much as decoding a few rows. It is freed
 * when its thread ends. `ignoring` is the checksum setting it was last given. */
typedef struct {
    void *dctx;
    int ignoring;
} thread_dctx_t;

static pthread_key_t dctx_key;
static pthread_once_t dctx_key_once = PTHREAD_ONCE_INIT;

static void free_thread_dctx(void *p) {
    thread_dctx_t *t = p;
    if (t->dctx != NULL && zstd.free_dctx != NULL) zstd.free_dctx(t->dctx);
    free(t);
}

static void make_dctx_key(void) { pthread_key_create(&dctx_key, free_thread_dctx); }

/* This thread's context, set to check checksums or not; NULL if it cannot be made. */
static void *thread_dctx(int verify) {
    pthread_once(&dctx_key_once, make_dctx_key);
    thread_dctx_t *t = pthread_getspecific(dctx_key);
    if (t == NULL) {
        if ((t = calloc(1, sizeof(thread_dctx_t))) == NULL) return NULL;
        if ((t->dctx = zstd.create_dctx()) == NULL || pthread_setspecific(dctx_key, t) != 0) {
            free_thread_dctx(t);
            return NULL;
        }
    }
    int ignore = !verify && can_ignore_checksums;
    if (ignore != t->ignoring) {
        if (zstd.is_error(zstd.set_dparameter(t->dctx, ZSTD_D_FORCE_IGNORE_CHECKSUM, ignore))) {
            /* a fresh context checks checksums: the default */
            zstd.free_dctx(t->dctx);
            if ((t->dctx = zstd.create_dctx()) == NULL) return NULL;
            ignore = 0;
        }
        t->ignoring = ignore;
    }
    return t->dctx;
}

/* dst = the transpose of src, an [a, b] matrix of `item`-byte values ([b, a] in dst):
 * HWC -> CHW is a = H*W, b = C. Read in order, written in b streams. */
static void transpose_into(char *dst, const char *src, int64_t a, int64_t b, size_t item) {
    if (a == 1 || b == 1) {
        memcpy(dst, src, (size_t)(a * b) * item);
        return;
    }
#define TRANSPOSE(T)                                                                   \
    do {                                                                               \
        const T *s_ = (const T *)src;                                                  \
        T *d_ = (T *)dst;                                                              \
        for (int64_t i = 0; i < a; i++)                                                \
            for (int64_t j = 0; j < b; j++) d_[j * a + i] = s_[i * b + j];             \
    } while (0)
    switch (item) {
    case 1: TRANSPOSE(uint8_t); break;
    case 2: TRANSPOSE(uint16_t); break;
    case 4: TRANSPOSE(uint32_t); break;
    case 8: TRANSPOSE(uint64_t); break;
    default:
        for (int64_t i = 0; i < a; i++)
            for (int64_t j = 0; j < b; j++) memcpy(dst + (size_t)(j * a + i) * item, src + (size_t)(i * b + j) * item, item);
    }
#undef TRANSPOSE
}

/* Decode rows taken a few at a time until none are left (or one failed). */
static void decode_some(job_t *job) {
    void *dctx = NULL;
    /* rows written transposed are decoded here first: one row, in this thread's cache */
    int permuted = job->perm_a > 1 && job->perm_b > 1;
    char *scratch = permuted ? malloc(job->row) : NULL;
    if (permuted && scratch == NULL) {
        fail(job, -1, 0, 0);
        permuted = 0;
    }
    for (;;) {
        int64_t a = __atomic_fetch_add(&job->next, ROWS_PER_GRAB, __ATOMIC_RELAXED);
        if (a >= job->n) break;
        int64_t b = a + ROWS_PER_GRAB < job->n ? a + ROWS_PER_GRAB : job->n;
        if (__atomic_load_n(&job->failed, __ATOMIC_RELAXED)) {
            count_done(job, b - a);
            continue;
        }
        if (job->codec == CODEC_ZSTD && dctx == NULL && (dctx = thread_dctx(job->verify)) == NULL) {
            fail(job, -1, 0, 0);
            count_done(job, b - a);
            continue;
        }
        for (int64_t i = a; i < b; i++) {
            const char *src = job->bases[job->slot[i]] + job->offsets[i];
            char *row_out = job->out + (size_t)job->where[i] * job->row;
            char *dst = permuted ? scratch : row_out;
            if (job->codec == CODEC_LZ4) {
                /* numcodecs' LZ4 layout: a little-endian uint32 size, then the block */
                const unsigned char *s = (const unsigned char *)src;
                uint32_t size = (uint32_t)s[0] | (uint32_t)s[1] << 8 | (uint32_t)s[2] << 16 | (uint32_t)s[3] << 24;
                if (size != job->row) {
                    fail(job, i, (int64_t)size, 0);
                    break;
                }
                int r = lz4_decompress_safe(src + 4, dst, (int)(job->lengths[i] - 4), (int)job->row);
                if (r != (int)job->row) {
                    fail(job, i, r, 0);
                    break;
                }
            } else {
                size_t r = job->ddict != NULL
                               ? zstd.decompress_ddict(dctx, dst, job->row, src, (size_t)job->lengths[i], job->ddict)
                               : zstd.decompress_dctx(dctx, dst, job->row, src, (size_t)job->lengths[i]);
                if (zstd.is_error(r) || r != job->row) {
                    fail(job, i, (int64_t)r, (int)zstd.is_error(r));
                    break;
                }
            }
            if (permuted) transpose_into(row_out, scratch, job->perm_a, job->perm_b, job->item);
        }
        count_done(job, b - a);
    }
    free(scratch);
}

/* The pool: threads started on first use, as many as a batch has asked for so far, that
 * sleep until a batch is open to them. One batch at a time is open; a caller that finds
 * the pool busy with another thread's batch decodes its own alone. The threads end before
 * a fork (see pool_before_fork) and start again on the next batch, in parent and child. */
static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int started;  /* threads running */
    job_t *job;   /* the batch open to pool threads, or NULL */
    int wanted;   /* pool threads that batch still takes */
    int stopping; /* a fork is under way: threads end, none start */
    pthread_t threads[MAX_THREADS];
    long tids[MAX_THREADS]; /* their kernel thread ids (Linux) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, NULL, 0};

static void *pool_main(void *arg) {
#ifdef __linux__
    pool.tids[(intptr_t)arg] = (long)syscall(SYS_gettid); /* read by pool_before_fork after the join */
#else
    (void)arg;
#endif
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (!pool.stopping && (pool.job == NULL || pool.wanted <= 0)) pthread_cond_wait(&pool.wake, &pool.lock);
        if (pool.stopping) break;
        job_t *job = pool.job;
        pool.wanted--;
        __atomic_add_fetch(&job->users, 1, __ATOMIC_ACQ_REL); /* before the caller can close it */
        pthread_mutex_unlock(&pool.lock);
        decode_some(job);
        leave(job);
        pthread_mutex_lock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.lock);
    return NULL;
}

/* --- Forks -------------------------------------------------------------------------------
 * Python 3.12+ warns that a process which forks while other threads run "may deadlock in
 * the child": it counts the process's threads right after fork() returns in the parent.
 * So before a fork the pool's threads end (a thread busy with a batch finishes its rows
 * first; callers then decode alone), and the pool starts again on the next batch, in the
 * parent and in the child (which has none of the parent's threads in any case). */
static void pool_before_fork(void) {
    pthread_mutex_lock(&pool.lock);
    pool.stopping = 1;
    int n = pool.started;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < n; i++) {
        pthread_join(pool.threads[i], NULL);
#ifdef __linux__
        /* pthread_join returns when the kernel clears the thread's id, a little before
         * the thread stops counting as one of the process's threads: wait for that too
         * (at most a second), or the count right after the fork may still include it */
        char path[64];
        snprintf(path, sizeof path, "/proc/self/task/%ld", pool.tids[i]);
        struct timespec pause = {0, 50000};
        for (int tries = 0; tries < 20000 && access(path, F_OK) == 0; tries++) nanosleep(&pause, NULL);
#endif
    }
    pool.started = 0;
}

static void pool_after_fork_parent(void) {
    pthread_mutex_lock(&pool.lock);
    pool.stopping = 0;
    pthread_mutex_unlock(&pool.lock);
}

static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
    pool.job = NULL;
    pool.wanted = 0;
    pool.stopping = 0;
}

/* Open `job` to `helpers` pool threads, starting threads up to that many; 0 if the pool
 * is busy with another batch (or no thread could be started). */
static int pool_open(job_t *job, int helpers) {
    pthread_mutex_lock(&pool.lock);
    if (pool.job != NULL || pool.stopping) {
        pthread_mutex_unlock(&pool.lock);
        return 0;
    }
    while (pool.started < helpers) { /* joinable: pool_before_fork joins them */
        if (pthread_create(&pool.threads[pool.started], NULL, pool_main, (void *)(intptr_t)pool.started) != 0) break;
        pool.started++;
    }
    if (helpers > pool.started) helpers = pool.started;
    if (helpers > 0) {
        pool.job = job;
        pool.wanted = helpers;
        if (helpers == pool.started)
            pthread_cond_broadcast(&pool.wake);
        else
            for (int i = 0; i < helpers; i++) pthread_cond_signal(&pool.wake);
    }
    pthread_mutex_unlock(&pool.lock);
    return helpers > 0;
}

/* No more pool threads join `job` (its rows are all taken by now). */
static void pool_close(job_t *job) {
    pthread_mutex_lock(&pool.lock);
    if (pool.job == job) {
        pool.job = NULL;
        pool.wanted = 0;
    }
    pthread_mutex_unlock(&pool.lock);
}

static int get_array(PyObject *obj, Py_buffer *view, int64_t n, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len != n * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %lld", what, view->len, (long long)(n * itemsize));
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(decode_rows_doc,
             "decode_rows(codec, buffers, which, where, offsets, lengths, out, row_nbytes, threads, ddict=None,\n"
             "            verify=True, perm_a=1, perm_b=row_nbytes, item=1)\n\n"
             "Decode frame i (bytes offsets[i]:offsets[i]+lengths[i] of buffers[which[i]]) into row where[i]\n"
             "of out (rows of row_nbytes), on up to `threads` threads without the GIL. which is int32,\n"
             "where/offsets/lengths int64. Only the buffers some frame is in are read (the others may be\n"
             "None). verify=False skips zstd's content checksums where the library allows it (see\n"
             "zstd_skips_checksums). With perm_a, perm_b and item, each row is an [perm_a, perm_b] matrix of\n"
             "item-byte values, written to out transposed (HWC -> CHW: H*W, C). Raises ValueError naming the\n"
             "first frame that does not decode.");

/* The distinct buffers the frames are in: slot[i] is frame i's among them. A small hash
 * table, so a caller can pass a long list (one buffer per segment) of which a batch uses
 * a few. */
typedef struct {
    Py_buffer *views;
    const char **bases;
    int32_t *slot;
    Py_ssize_t count;
} used_buffers_t;

static int use_buffers(used_buffers_t *u, PyObject *seq, const int32_t *which, int64_t n) {
    Py_ssize_t nbuf = PySequence_Fast_GET_SIZE(seq);
    size_t cap = 16;
    while (cap < 2 * (size_t)n) cap *= 2;
    int32_t *keys = PyMem_Malloc(cap * 2 * sizeof(int32_t)), *vals = keys + cap;
    int64_t most = n < nbuf ? n : nbuf;
    u->views = PyMem_Calloc(most ? most : 1, sizeof(Py_buffer));
    u->bases = PyMem_Calloc(most ? most : 1, sizeof(char *));
    u->slot = PyMem_Malloc((n ? n : 1) * sizeof(int32_t));
    if (keys == NULL || u->views == NULL || u->bases == NULL || u->slot == NULL) {
        PyMem_Free(keys);
        PyErr_NoMemory();
        return -1;
    }
    memset(keys, 0xff, cap * sizeof(int32_t));
    int rc = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t w = which[i];
        if (w < 0 || w >= nbuf) {
            PyErr_Format(PyExc_ValueError, "frame %lld is in buffer %d, not one of the %zd given", (long long)i,
                         (int)w, nbuf);
            rc = -1;
            break;
        }
        size_t h = ((uint32_t)w * 2654435761u) & (cap - 1);
        while (keys[h] != -1 && keys[h] != w) h = (h + 1) & (cap - 1);
        if (keys[h] == -1) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, w);
            if (item == Py_None) {
                PyErr_Format(PyExc_ValueError, "frame %lld is in buffer %d, which is None", (long long)i, (int)w);
                rc = -1;
                break;
            }
            if (PyObject_GetBuffer(item, &u->views[u->count], PyBUF_SIMPLE) < 0) {
                rc = -1;
                break;
            }
            u->bases[u->count] = u->views[u->count].buf;
            keys[h] = w;
            vals[h] = (int32_t)u->count++;
        }
        u->slot[i] = vals[h];
    }
    PyMem_Free(keys);
    return rc;
}

static void release_buffers(used_buffers_t *u) {
    for (Py_ssize_t i = 0; i < u->count; i++) PyBuffer_Release(&u->views[i]);
    PyMem_Free(u->views);
    PyMem_Free(u->bases);
    PyMem_Free(u->slot);
}

static PyObject *decode_rows(PyObject *self, PyObject *args) {
    const char *name;
    PyObject *buffers, *which_o, *where_o, *offsets_o, *lengths_o, *out_o, *ddict_o = Py_None;
    Py_ssize_t row;
    int threads, verify = 1;
    Py_ssize_t perm_a = 1, perm_b = 0, item = 1;
    if (!PyArg_ParseTuple(args, "sOOOOOOni|Opnnn", &name, &buffers, &which_o, &where_o, &offsets_o, &lengths_o, &out_o,
                          &row, &threads, &ddict_o, &verify, &perm_a, &perm_b, &item))
        return NULL;
    int codec = codec_of(name);
    if (codec < 0) return NULL;
    if (codec == CODEC_LZ4 ? lz4_decompress_safe == NULL : zstd.decompress_dctx == NULL) {
        PyErr_Format(PyExc_RuntimeError, "no %s library loaded", name);
        return NULL;
    }
    if (row <= 0 || row > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "row_nbytes must be in 1..%d, not %zd", INT32_MAX, row);
        return NULL;
    }
    if (perm_b == 0) perm_b = row / (item > 0 ? item : 1);
    if (perm_a < 1 || perm_b < 1 || item < 1 || perm_a * perm_b * item != row) {
        PyErr_Format(PyExc_ValueError, "a row of %zd bytes is no [%zd, %zd] matrix of %zd-byte values", row, perm_a,
                     perm_b, item);
        return NULL;
    }
    const void *ddict = NULL;
    if (ddict_o != Py_None) {
        if (codec != CODEC_ZSTD) {
            PyErr_SetString(PyExc_ValueError, "a dictionary is for zstd only");
            return NULL;
        }
        if ((ddict = PyCapsule_GetPointer(ddict_o, DDICT_CAPSULE)) == NULL) return NULL;
    }
    PyObject *seq = PySequence_Fast(buffers, "buffers must be a sequence");
    if (seq == NULL) return NULL;
    used_buffers_t used = {0};
    Py_buffer which = {0}, where = {0}, offsets = {0}, lengths = {0}, out = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(where_o, &where, PyBUF_C_CONTIGUOUS) < 0) goto done;
    int64_t n = where.len / 8;
    if (where.len % 8) {
        PyErr_SetString(PyExc_ValueError, "where must be int64");
        goto done;
    }
    if (get_array(which_o, &which, n, 4, "which") < 0) goto done;
    if (get_array(offsets_o, &offsets, n, 8, "offsets") < 0) goto done;
    if (get_array(lengths_o, &lengths, n, 8, "lengths") < 0) goto done;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    if (use_buffers(&used, seq, which.buf, n) < 0) goto done;
    {
        const int32_t *w = which.buf, *slot = used.slot;
        const int64_t *pos = where.buf, *off = offsets.buf, *len = lengths.buf;
        int64_t out_rows = out.len / row;
        int64_t min_len = codec == CODEC_LZ4 ? 4 : 1;
        /* every frame inside its buffer and every row inside out, before any thread runs */
        for (int64_t i = 0; i < n; i++) {
            if (pos[i] < 0 || pos[i] >= out_rows || off[i] < 0 || len[i] < min_len || len[i] > INT32_MAX ||
                off[i] > used.views[slot[i]].len - len[i]) {
                PyErr_Format(PyExc_ValueError,
                             "frame %lld (buffer %d, offset %lld, length %lld, row %lld) lies outside its buffer "
                             "or the output",
                             (long long)i, (int)w[i], (long long)off[i], (long long)len[i], (long long)pos[i]);
                goto done;
            }
        }
        job_t *job = calloc(1, sizeof(job_t));
        if (job == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        *job = (job_t){.codec = codec, .verify = verify, .bases = used.bases, .slot = slot, .where = pos,
                       .offsets = off, .lengths = len, .out = out.buf, .row = (size_t)row, .n = n, .ddict = ddict,
                       .perm_a = perm_a, .perm_b = perm_b, .item = (size_t)item, .users = 1};
        pthread_mutex_init(&job->lock, NULL);
        pthread_cond_init(&job->all_done, NULL);
        int nthreads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
        int64_t useful = (n + 15) / 16; /* a thread is worth waking for ~16 rows */
        if (nthreads > useful) nthreads = useful < 1 ? 1 : (int)useful;
        Py_BEGIN_ALLOW_THREADS
        int opened = nthreads > 1 && pool_open(job, nthreads - 1);
        decode_some(job);
        if (opened) pool_close(job);
        pthread_mutex_lock(&job->lock);
        while (__atomic_load_n(&job->finished, __ATOMIC_ACQUIRE) < job->n) pthread_cond_wait(&job->all_done, &job->lock);
        pthread_mutex_unlock(&job->lock);
        Py_END_ALLOW_THREADS
        int failed = job->failed;
        int64_t failed_row = job->failed_row, failed_result = job->failed_result;
        int failed_zstd = job->failed_zstd;
        leave(job);
        if (failed) {
            if (failed_row < 0)
                PyErr_SetString(PyExc_MemoryError, "ZSTD_createDCtx failed");
            else if (failed_zstd)
                PyErr_Format(PyExc_ValueError, "zstd frame %lld (offset %lld) does not decode: %s",
                             (long long)failed_row, (long long)off[failed_row], zstd.error_name((size_t)failed_result));
            else if (failed_result < 0)
                PyErr_Format(PyExc_ValueError, "lz4 frame %lld (offset %lld) does not decode: not a valid LZ4 block",
                             (long long)failed_row, (long long)off[failed_row]);
            else
                PyErr_Format(PyExc_ValueError, "%s frame %lld (offset %lld) decodes to %lld bytes, not the row's %zd",
                             name, (long long)failed_row, (long long)off[failed_row], (long long)failed_result, row);
            goto done;
        }
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_buffers(&used);
    if (which.obj) PyBuffer_Release(&which);
    if (where.obj) PyBuffer_Release(&where);
    if (offsets.obj) PyBuffer_Release(&offsets);
    if (lengths.obj) PyBuffer_Release(&lengths);
    if (out.obj) PyBuffer_Release(&out);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(zstd_skips_checksums_doc,
             "zstd_skips_checksums(): True if the loaded zstd library can skip content checksums\n"
             "(decode_rows(..., verify=False) then does); False if it checks them always");

static PyObject *zstd_skips_checksums(PyObject *self, PyObject *args) { return PyBool_FromLong(can_ignore_checksums); }
/* frame stacks added to a store that keeps each frame once: defined at the end of the file */
static PyObject *check_stacks(PyObject *self, PyObject *args);
static PyObject *stack_simd(PyObject *self, PyObject *args);
static void stack_init(void);
/* --- Encoding a batch of rows in one call, without the GIL -------------------------------
 *
 * The frames are the ones the Python encoders write: numcodecs' LZ4 layout (a little-endian
 * uint32 size, then an LZ4 block of acceleration 1) and zstd frames with a content checksum
 * (ZSTD_compress2 at the encoder's level, as zstandard's ZstdCompressor(level=L,
 * write_checksum=True) writes them, with a dictionary loaded into the context for :dict).
 * The functions come from the library load opened (load_encoding). An encoder keeps its
 * zstd context and its scratch space between calls; its lock makes it safe, not fast, to
 * share between threads.
 */
typedef int (*lz4_compress_fast_fn)(const char *, char *, int, int, int);
typedef int (*lz4_compress_bound_fn)(int);
typedef void *(*zstd_create_cctx_fn)(void);
typedef size_t (*zstd_free_cctx_fn)(void *);
typedef size_t (*zstd_cctx_set_parameter_fn)(void *, int, int);
typedef size_t (*zstd_cctx_load_dictionary_fn)(void *, const void *, size_t);
typedef size_t (*zstd_compress2_fn)(void *, void *, size_t, const void *, size_t);
typedef size_t (*zstd_compress_bound_fn)(size_t);

static struct {
    lz4_compress_fast_fn compress_fast;
    lz4_compress_bound_fn compress_bound;
} lz4_enc;
static struct {
    zstd_create_cctx_fn create_cctx;
    zstd_free_cctx_fn free_cctx;
    zstd_cctx_set_parameter_fn set_parameter;
    zstd_cctx_load_dictionary_fn load_dictionary;
    zstd_compress2_fn compress2;
    zstd_compress_bound_fn compress_bound;
    zstd_is_error_fn is_error;
    zstd_error_name_fn error_name;
} zstd_enc;

/* zstd.h's ZSTD_cParameter values (stable API) */
enum { ZSTD_C_COMPRESSION_LEVEL = 100, ZSTD_C_CHECKSUM_FLAG = 201 };
#define ENCODER_CAPSULE "mmreplay._rowdecode.encoder"

/* The encoding functions of the library load opened, if it has them all (else encoding
 * stays off: can_encode says so, and rows encode in Python). */
static void load_encoding(int codec, void *lib) {
    if (codec == CODEC_LZ4) {
        void *fast = dlsym(lib, "LZ4_compress_fast"), *bound = dlsym(lib, "LZ4_compressBound");
        lz4_enc.compress_bound = bound ? (lz4_compress_bound_fn)bound : NULL;
        lz4_enc.compress_fast = fast && bound ? (lz4_compress_fast_fn)fast : NULL;
        return;
    }
    void *f[8];
    const char *names[8] = {"ZSTD_createCCtx",          "ZSTD_freeCCtx",  "ZSTD_CCtx_setParameter",
                            "ZSTD_CCtx_loadDictionary", "ZSTD_compress2", "ZSTD_compressBound",
                            "ZSTD_isError",             "ZSTD_getErrorName"};
    zstd_enc.create_cctx = NULL;
    for (int i = 0; i < 8; i++)
        if ((f[i] = dlsym(lib, names[i])) == NULL) return;
    zstd_enc.free_cctx = (zstd_free_cctx_fn)f[1];
    zstd_enc.set_parameter = (zstd_cctx_set_parameter_fn)f[2];
    zstd_enc.load_dictionary = (zstd_cctx_load_dictionary_fn)f[3];
    zstd_enc.compress2 = (zstd_compress2_fn)f[4];
    zstd_enc.compress_bound = (zstd_compress_bound_fn)f[5];
    zstd_enc.is_error = (zstd_is_error_fn)f[6];
    zstd_enc.error_name = (zstd_error_name_fn)f[7];
    zstd_enc.create_cctx = (zstd_create_cctx_fn)f[0]; /* last: it marks the set as loaded */
}

PyDoc_STRVAR(can_encode_doc, "can_encode(codec): whether the library load opened for codec has the encoding functions");

static PyObject *can_encode(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    int codec = codec_of(name);
    if (codec < 0) return NULL;
    return PyBool_FromLong(codec == CODEC_LZ4 ? lz4_enc.compress_fast != NULL : zstd_enc.create_cctx != NULL);
}

typedef struct {
    int codec;
    int level;     /* zstd level, or lz4 acceleration */
    void *cctx;    /* zstd only */
    char *scratch; /* room for a batch of frames, kept between calls */
    size_t scratch_size;
    pthread_mutex_t lock;
} encoder_t;

static void free_encoder(PyObject *capsule) {
    encoder_t *enc = PyCapsule_GetPointer(capsule, ENCODER_CAPSULE);
    if (enc == NULL) return;
    if (enc->cctx != NULL) zstd_enc.free_cctx(enc->cctx);
    free(enc->scratch);
    pthread_mutex_destroy(&enc->lock);
    free(enc);
}

static int zstd_check(size_t r, const char *what) {
    if (!zstd_enc.is_error(r)) return 0;
    PyErr_Format(PyExc_ValueError, "%s failed: %s", what, zstd_enc.error_name(r));
    return -1;
}

PyDoc_STRVAR(new_encoder_doc,
             "new_encoder(codec, level, dictionary=None): an encoder for encode_rows; level is zstd's level\n"
             "(1..22) or lz4's acceleration; dictionary (zstd only) the bytes of a zstd dictionary");

static PyObject *new_encoder(PyObject *self, PyObject *args) {
    const char *name;
    int level;
    Py_buffer dict = {0};
    if (!PyArg_ParseTuple(args, "si|z*", &name, &level, &dict)) return NULL;
    PyObject *result = NULL;
    encoder_t *enc = NULL;
    int codec = codec_of(name);
    if (codec < 0) goto done;
    if (codec == CODEC_LZ4 ? lz4_enc.compress_fast == NULL : zstd_enc.create_cctx == NULL) {
        PyErr_Format(PyExc_RuntimeError, "no %s library loaded for encoding", name);
        goto done;
    }
    if (dict.obj != NULL && codec != CODEC_ZSTD) {
        PyErr_SetString(PyExc_ValueError, "a dictionary is for zstd only");
        goto done;
    }
    if ((enc = calloc(1, sizeof(encoder_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    enc->codec = codec;
    enc->level = level;
    pthread_mutex_init(&enc->lock, NULL);
    if (codec == CODEC_ZSTD) {
        if ((enc->cctx = zstd_enc.create_cctx()) == NULL) {
            PyErr_SetString(PyExc_MemoryError, "ZSTD_createCCtx failed");
            goto done;
        }
        if (zstd_check(zstd_enc.set_parameter(enc->cctx, ZSTD_C_COMPRESSION_LEVEL, level), "setting the zstd level") ||
            zstd_check(zstd_enc.set_parameter(enc->cctx, ZSTD_C_CHECKSUM_FLAG, 1), "setting the zstd checksum flag"))
            goto done;
        if (dict.obj != NULL &&
            zstd_check(zstd_enc.load_dictionary(enc->cctx, dict.buf, (size_t)dict.len), "loading the zstd dictionary"))
            goto done;
    }
    result = PyCapsule_New(enc, ENCODER_CAPSULE, free_encoder);
done:
    if (result == NULL && enc != NULL) {
        if (enc->cctx != NULL) zstd_enc.free_cctx(enc->cctx);
        pthread_mutex_destroy(&enc->lock);
        free(enc);
    }
    if (dict.obj != NULL) PyBuffer_Release(&dict);
    return result;
}

/* Encode n rows of row bytes at src into out (frame i at i * bound), their sizes into sizes;
 * with enc->lock held and without the GIL. The row that failed, or -1. */
static int64_t encode_into(encoder_t *enc, const char *src, int64_t n, size_t row, size_t bound, char *out,
                           size_t *sizes, size_t *failed_result) {
    for (int64_t i = 0; i < n; i++) {
        const char *from = src + i * row;
        char *dst = out + i * bound;
        if (enc->codec == CODEC_LZ4) {
            uint32_t size = (uint32_t)row;
            unsigned char head[4] = {size & 0xFF, (size >> 8) & 0xFF, (size >> 16) & 0xFF, (size >> 24) & 0xFF};
            memcpy(dst, head, 4);
            int r = lz4_enc.compress_fast(from, dst + 4, (int)row, (int)(bound - 4), enc->level);
            if (r <= 0) return i;
            sizes[i] = 4 + (size_t)r;
        } else {
            size_t r = zstd_enc.compress2(enc->cctx, dst, bound, from, row);
            if (zstd_enc.is_error(r)) {
                *failed_result = r;
                return i;
            }
            sizes[i] = r;
        }
    }
    return -1;
}

static size_t frame_bound(encoder_t *enc, size_t row) {
    return enc->codec == CODEC_LZ4 ? 4 + (size_t)lz4_enc.compress_bound((int)row) : zstd_enc.compress_bound(row);
}

static PyObject *encode_error(encoder_t *enc, int64_t failed, size_t failed_result) {
    if (enc->codec == CODEC_LZ4)
        return PyErr_Format(PyExc_ValueError, "LZ4_compress_fast failed on row %lld", (long long)failed);
    return PyErr_Format(PyExc_ValueError, "ZSTD_compress2 failed on row %lld: %s", (long long)failed,
                        zstd_enc.error_name(failed_result));
}

/* The frames as a list of bytes. */
static PyObject *frames_list(const char *out, const size_t *sizes, int64_t n, size_t bound) {
    PyObject *result = PyList_New(n);
    for (int64_t i = 0; result != NULL && i < n; i++) {
        PyObject *frame = PyBytes_FromStringAndSize(out + i * bound, (Py_ssize_t)sizes[i]);
        if (frame == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, frame);
    }
    return result;
}

PyDoc_STRVAR(encode_rows_doc,
             "encode_rows(encoder, rows, row_nbytes) -> list of bytes\n\n"
             "Encode each row of `rows` (a C-contiguous buffer of whole rows of row_nbytes) as one frame,\n"
             "without the GIL; the frames are bytes objects in row order.");

static PyObject *encode_rows(PyObject *self, PyObject *args) {
    PyObject *capsule, *rows_o;
    Py_ssize_t row;
    if (!PyArg_ParseTuple(args, "OOn", &capsule, &rows_o, &row)) return NULL;
    encoder_t *enc = PyCapsule_GetPointer(capsule, ENCODER_CAPSULE);
    if (enc == NULL) return NULL;
    if (row <= 0 || row > INT32_MAX - 4) {
        PyErr_Format(PyExc_ValueError, "row_nbytes must be in 1..%d, not %zd", INT32_MAX - 4, row);
        return NULL;
    }
    Py_buffer rows;
    if (PyObject_GetBuffer(rows_o, &rows, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *result = NULL;
    size_t *sizes = NULL;
    if (rows.len % row) {
        PyErr_Format(PyExc_ValueError, "rows has %zd bytes, not a whole number of rows of %zd", rows.len, row);
        goto done;
    }
    int64_t n = rows.len / row;
    size_t bound = frame_bound(enc, (size_t)row);
    if (n > 0 && bound > SIZE_MAX / (size_t)n) {
        PyErr_NoMemory();
        goto done;
    }
    if ((sizes = malloc((n ? n : 1) * sizeof(size_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t failed = -1;
    size_t failed_result = 0;
    int no_room = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&enc->lock);
    if (enc->scratch_size < n * bound) {
        char *grown = malloc(n * bound);
        if (grown == NULL) {
            no_room = 1;
        } else {
            free(enc->scratch);
            enc->scratch = grown;
            enc->scratch_size = n * bound;
        }
    }
    if (!no_room) failed = encode_into(enc, rows.buf, n, (size_t)row, bound, enc->scratch, sizes, &failed_result);
    Py_END_ALLOW_THREADS
    if (no_room || failed >= 0) {
        pthread_mutex_unlock(&enc->lock);
        if (no_room) PyErr_NoMemory();
        else encode_error(enc, failed, failed_result);
        goto done;
    }
    /* the frames become bytes with the GIL held and the encoder still locked: the scratch
       space is not another call's yet */
    result = frames_list(enc->scratch, sizes, n, bound);
    pthread_mutex_unlock(&enc->lock);
done:
    free(sizes);
    PyBuffer_Release(&rows);
    return result;
}

/* Worker threads that run the jobs handed to them in order, without ever taking the GIL: a
 * Python thread would wait up to the interpreter's switch interval (5 ms) for the GIL before
 * and after each job while the writer runs Python code, so it would fall behind the writer.
 * Two kinds of job:
 * - a batch of rows to encode (submit_rows): the rows stay where they are, held as a buffer,
 *   and the writer takes their frames later (job_frames), in order;
 * - a segment's shard to store (submit_shard): its frames (bytes, and the frames of encoding
 *   jobs it waits for), its index and the index's CRC-32C, written to a new file renamed over
 *   the shard (shard_done says when, or why not). */
#define WORKER_CAPSULE "mmreplay._rowdecode.worker"
#define JOB_CAPSULE "mmreplay._rowdecode.job"
#define SHARD_CAPSULE "mmreplay._rowdecode.shard"

typedef struct task {
    struct task *next;
    void (*run)(struct task *);
    int done; /* under the worker's lock */
    struct worker *worker;
} task_t;

typedef struct {
    task_t head;
    encoder_t *enc;
    PyObject *encoder_capsule; /* kept alive until the frames are taken */
    Py_buffer rows;
    size_t row, bound;
    int64_t n;
    char *out; /* n frames of up to bound bytes */
    size_t *sizes;
    int64_t failed; /* -1, or the row that failed */
    size_t failed_result;
} encode_job_t;

typedef struct worker {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake, finished;
    task_t *head, *tail; /* jobs not started, in order */
    int stop;
    char name[16]; /* the thread's name, as the OS shows it */
} worker_t;

static void run_encode(task_t *j) {
    encode_job_t *job = (encode_job_t *)j;
    pthread_mutex_lock(&job->enc->lock);
    job->failed = encode_into(job->enc, job->rows.buf, job->n, job->row, job->bound, job->out, job->sizes,
                              &job->failed_result);
    pthread_mutex_unlock(&job->enc->lock);
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
#ifdef __linux__
    pthread_setname_np(pthread_self(), w->name);
#endif
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (w->head == NULL && !w->stop) pthread_cond_wait(&w->wake, &w->lock);
        if (w->head == NULL) break; /* stopped, and nothing left */
        task_t *job = w->head;
        w->head = job->next;
        if (w->head == NULL) w->tail = NULL;
        pthread_mutex_unlock(&w->lock);
        job->run(job);
        pthread_mutex_lock(&w->lock);
        job->done = 1;
        pthread_cond_broadcast(&w->finished);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void free_worker(PyObject *capsule) {
    worker_t *w = PyCapsule_GetPointer(capsule, WORKER_CAPSULE);
    if (w == NULL) return;
    /* every job holds a reference to its worker's capsule: none is left here */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&w->lock);
    pthread_cond_destroy(&w->wake);
    pthread_cond_destroy(&w->finished);
    free(w);
}

PyDoc_STRVAR(new_worker_doc,
             "new_worker(name='mmreplay-encode'): a thread that runs the jobs of submit_rows and submit_shard,\n"
             "in order, without the GIL; name (at most 15 bytes) is its name as the OS shows it");

static PyObject *new_worker(PyObject *self, PyObject *args) {
    const char *name = "mmreplay-encode";
    if (!PyArg_ParseTuple(args, "|s", &name)) return NULL;
    worker_t *w = calloc(1, sizeof(worker_t));
    if (w == NULL) return PyErr_NoMemory();
    strncpy(w->name, name, sizeof(w->name) - 1);
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->wake, NULL);
    pthread_cond_init(&w->finished, NULL);
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) {
        pthread_mutex_destroy(&w->lock);
        pthread_cond_destroy(&w->wake);
        pthread_cond_destroy(&w->finished);
        free(w);
        PyErr_SetString(PyExc_OSError, "cannot start the encoding thread");
        return NULL;
    }
    PyObject *capsule = PyCapsule_New(w, WORKER_CAPSULE, free_worker);
    if (capsule == NULL) {
        pthread_mutex_lock(&w->lock);
        w->stop = 1;
        pthread_cond_signal(&w->wake);
        pthread_mutex_unlock(&w->lock);
        pthread_join(w->thread, NULL);
        free(w);
    }
    return capsule;
}

/* Wait until the worker is done with the job (the caller does not hold the GIL). */
static void wait_done(task_t *job) {
    worker_t *w = job->worker;
    pthread_mutex_lock(&w->lock);
    while (!job->done) pthread_cond_wait(&w->finished, &w->lock);
    pthread_mutex_unlock(&w->lock);
}

/* The same, letting go of the GIL meanwhile. */
static void wait_job(task_t *job) {
    Py_BEGIN_ALLOW_THREADS
    wait_done(job);
    Py_END_ALLOW_THREADS
}

static int job_done(task_t *job) {
    pthread_mutex_lock(&job->worker->lock);
    int done = job->done;
    pthread_mutex_unlock(&job->worker->lock);
    return done;
}

/* Whether the job is done; with wait, once it is (the GIL let go meanwhile). */
static int finished(task_t *job, int wait) {
    if (job_done(job)) return 1;
    if (!wait) return 0;
    wait_job(job);
    return 1;
}

/* Hand `job` to `w`, after the jobs handed to it before; the job's capsule keeps a
 * reference to the worker's, which outlives its jobs. */
static void enqueue(worker_t *w, PyObject *worker_capsule, PyObject *job_capsule, task_t *job) {
    job->worker = w;
    Py_INCREF(worker_capsule);
    PyCapsule_SetContext(job_capsule, worker_capsule);
    pthread_mutex_lock(&w->lock);
    if (w->tail) w->tail->next = job;
    else w->head = job;
    w->tail = job;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
}

static void free_job(PyObject *capsule) {
    encode_job_t *job = PyCapsule_GetPointer(capsule, JOB_CAPSULE);
    if (job == NULL) return;
    wait_job(&job->head); /* the worker may still be reading the rows */
    PyBuffer_Release(&job->rows);
    Py_DECREF(job->encoder_capsule);
    PyObject *worker_capsule = PyCapsule_GetContext(capsule);
    free(job->out);
    free(job->sizes);
    free(job);
    Py_XDECREF(worker_capsule);
}

PyDoc_STRVAR(submit_rows_doc,
             "submit_rows(worker, encoder, rows, row_nbytes) -> job\n\n"
             "Hand the rows (a C-contiguous buffer of whole rows, kept until the job is freed) to the\n"
             "worker; job_frames(job) gives their frames.");

static PyObject *submit_rows(PyObject *self, PyObject *args) {
    PyObject *worker_o, *encoder_o, *rows_o;
    Py_ssize_t row;
    if (!PyArg_ParseTuple(args, "OOOn", &worker_o, &encoder_o, &rows_o, &row)) return NULL;
    worker_t *w = PyCapsule_GetPointer(worker_o, WORKER_CAPSULE);
    if (w == NULL) return NULL;
    encoder_t *enc = PyCapsule_GetPointer(encoder_o, ENCODER_CAPSULE);
    if (enc == NULL) return NULL;
    if (row <= 0 || row > INT32_MAX - 4) {
        PyErr_Format(PyExc_ValueError, "row_nbytes must be in 1..%d, not %zd", INT32_MAX - 4, row);
        return NULL;
    }
    encode_job_t *job = calloc(1, sizeof(encode_job_t));
    if (job == NULL) return PyErr_NoMemory();
    if (PyObject_GetBuffer(rows_o, &job->rows, PyBUF_C_CONTIGUOUS) < 0) {
        free(job);
        return NULL;
    }
    if (job->rows.len % row) {
        PyErr_Format(PyExc_ValueError, "rows has %zd bytes, not a whole number of rows of %zd", job->rows.len, row);
        goto fail;
    }
    job->head.run = run_encode;
    job->row = (size_t)row;
    job->n = job->rows.len / row;
    job->bound = frame_bound(enc, (size_t)row);
    job->failed = -1;
    if ((job->n > 0 && job->bound > SIZE_MAX / (size_t)job->n) ||
        (job->out = malloc(job->n ? job->n * job->bound : 1)) == NULL ||
        (job->sizes = malloc((job->n ? job->n : 1) * sizeof(size_t))) == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    job->enc = enc;
    job->encoder_capsule = encoder_o;
    PyObject *capsule = PyCapsule_New(job, JOB_CAPSULE, NULL);
    if (capsule == NULL) goto fail;
    Py_INCREF(encoder_o);
    enqueue(w, worker_o, capsule, &job->head);
    PyCapsule_SetDestructor(capsule, free_job);
    return capsule;
fail:
    PyBuffer_Release(&job->rows);
    free(job->out);
    free(job->sizes);
    free(job);
    return NULL;
}

PyDoc_STRVAR(job_frames_doc,
             "job_frames(job, wait) -> list of bytes, or None when not done and not wait\n\n"
             "The frames of a submit_rows job, in row order (waiting for them without the GIL when wait);\n"
             "ValueError if the codec failed.");

static PyObject *job_frames(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int wait;
    if (!PyArg_ParseTuple(args, "Op", &capsule, &wait)) return NULL;
    encode_job_t *job = PyCapsule_GetPointer(capsule, JOB_CAPSULE);
    if (job == NULL) return NULL;
    if (!finished(&job->head, wait)) Py_RETURN_NONE;
    if (job->failed >= 0) return encode_error(job->enc, job->failed, job->failed_result);
    return frames_list(job->out, job->sizes, job->n, job->bound);
}

/* CRC-32C (Castagnoli, reflected), the checksum of a shard's index (zarr's crc32c codec). */
static uint32_t crc32c_table[256];

static void crc32c_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        crc32c_table[i] = c;
    }
}

static uint32_t crc32c(const unsigned char *p, size_t n) {
    uint32_t c = 0xFFFFFFFFu;
    while (n--) c = crc32c_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

static void put_le(unsigned char *p, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) p[i] = (unsigned char)(v >> (8 * i));
}

typedef struct {
    task_t head;
    int dirfd;        /* where the shard's folders start (a duplicate, closed when done) */
    char *folders;    /* the shard's folders from there ("a/b/c"; "": none), made if missing */
    char *tmp, *name; /* the new file, and the shard it is renamed over */
    int64_t rows;
    const char **frame; /* per row: its frame, or NULL (none: a missing row) */
    size_t *length;
    PyObject *frames;   /* a tuple holding the bytes frame[] points into */
    int64_t njobs;
    encode_job_t **jobs; /* their frames take the place of frame[] from row lo[i] on, in order */
    int64_t *lo;
    PyObject **job_capsules;
    int error;               /* errno of the file operation that failed, or 0 */
    const char *failed_call; /* which */
    encode_job_t *failed_job; /* an encoding job that failed */
} shard_job_t;

/* Enter job->folders from job->dirfd, making the missing ones, never through a link; on
 * success job->dirfd is the shard's folder. 0, or -1 with the error set. */
static int enter_folders(shard_job_t *job) {
    char *path = strdup(job->folders), *save = NULL; /* (strtok_r writes into it) */
    if (path == NULL) {
        job->error = ENOMEM;
        job->failed_call = "malloc";
        return -1;
    }
    for (char *part = strtok_r(path, "/", &save); part != NULL; part = strtok_r(NULL, "/", &save)) {
        int inner = openat(job->dirfd, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (inner < 0 && errno == ENOENT) { /* made only where missing: most folders are there */
            if (mkdirat(job->dirfd, part, 0755) != 0 && errno != EEXIST) {
                job->error = errno;
                job->failed_call = "mkdir";
                break;
            }
            inner = openat(job->dirfd, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        }
        if (inner < 0) {
            job->error = errno;
            job->failed_call = "open folder";
            break;
        }
        close(job->dirfd);
        job->dirfd = inner;
    }
    free(path);
    return job->error ? -1 : 0;
}

static void run_shard(task_t *j) {
    shard_job_t *job = (shard_job_t *)j;
    unsigned char *buf = NULL;
    int fd = -1, created = 0;
    for (int64_t i = 0; i < job->njobs; i++) wait_done(&job->jobs[i]->head);
    for (int64_t i = 0; i < job->njobs; i++) {
        encode_job_t *e = job->jobs[i];
        if (e->failed >= 0) {
            job->failed_job = e;
            goto done;
        }
        for (int64_t r = 0; r < e->n && job->lo[i] + r < job->rows; r++) {
            job->frame[job->lo[i] + r] = e->out + r * e->bound;
            job->length[job->lo[i] + r] = e->sizes[r];
        }
    }
    size_t body = 0, index = (size_t)job->rows * 16;
    for (int64_t r = 0; r < job->rows; r++)
        if (job->frame[r] != NULL) body += job->length[r];
    size_t total = body + index + 4;
    if ((buf = malloc(total)) == NULL) {
        job->error = ENOMEM;
        job->failed_call = "malloc";
        goto done;
    }
    size_t pos = 0;
    for (int64_t r = 0; r < job->rows; r++) {
        unsigned char *entry = buf + body + (size_t)r * 16;
        if (job->frame[r] == NULL) {
            memset(entry, 0xFF, 16); /* MISSING: a row never written */
            continue;
        }
        memcpy(buf + pos, job->frame[r], job->length[r]);
        put_le(entry, pos, 8);
        put_le(entry + 8, job->length[r], 8);
        pos += job->length[r];
    }
    put_le(buf + body + index, crc32c(buf + body, index), 4);
    if (enter_folders(job) != 0) goto done;
    fd = openat(job->dirfd, job->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        job->error = errno;
        job->failed_call = "open";
        goto done;
    }
    created = 1;
    for (size_t at = 0; at < total;) {
        ssize_t got = write(fd, buf + at, total - at);
        if (got < 0) {
            if (errno == EINTR) continue;
            job->error = errno;
            job->failed_call = "write";
            goto done;
        }
        at += (size_t)got;
    }
    int closed = close(fd);
    fd = -1;
    if (closed != 0) {
        job->error = errno;
        job->failed_call = "close";
        goto done;
    }
    if (renameat(job->dirfd, job->tmp, job->dirfd, job->name) != 0) {
        job->error = errno;
        job->failed_call = "rename";
    }
done:
    if (fd >= 0) close(fd);
    if (job->error && created) unlinkat(job->dirfd, job->tmp, 0);
    free(buf);
    close(job->dirfd);
    job->dirfd = -1;
}

static void free_shard(PyObject *capsule) {
    shard_job_t *job = PyCapsule_GetPointer(capsule, SHARD_CAPSULE);
    if (job == NULL) return;
    if (job->head.worker != NULL) wait_job(&job->head);
    if (job->dirfd >= 0) close(job->dirfd);
    for (int64_t i = 0; i < job->njobs; i++) Py_XDECREF(job->job_capsules[i]);
    Py_XDECREF(job->frames);
    PyObject *worker_capsule = PyCapsule_GetContext(capsule);
    free(job->folders);
    free(job->tmp);
    free(job->name);
    free(job->frame);
    free(job->length);
    free(job->jobs);
    free(job->lo);
    free(job->job_capsules);
    free(job);
    Py_XDECREF(worker_capsule);
}

PyDoc_STRVAR(submit_shard_doc,
             "submit_shard(worker, dirfd, folders, tmp, name, frames, jobs) -> job\n\n"
             "Hand a segment's shard to the worker: frames is a sequence of bytes or None (a missing row),\n"
             "one per row; jobs a sequence of (row, submit_rows job) whose frames take the place of frames\n"
             "from that row on, in order, once encoded. The shard (frames, index, CRC-32C) is written to a\n"
             "new file tmp in the folder dirfd/folders ('a/b', '' for dirfd itself: made where missing,\n"
             "entered without following links; dirfd stays the caller's), renamed over name; shard_done(job)\n"
             "says when.");

static PyObject *submit_shard(PyObject *self, PyObject *args) {
    PyObject *worker_o, *frames_o, *jobs_o;
    int dirfd;
    const char *folders, *tmp, *name;
    if (!PyArg_ParseTuple(args, "OisssOO", &worker_o, &dirfd, &folders, &tmp, &name, &frames_o, &jobs_o)) return NULL;
    worker_t *w = PyCapsule_GetPointer(worker_o, WORKER_CAPSULE);
    if (w == NULL) return NULL;
    shard_job_t *job = calloc(1, sizeof(shard_job_t));
    if (job == NULL) return PyErr_NoMemory();
    job->head.run = run_shard;
    job->dirfd = -1;
    PyObject *capsule = PyCapsule_New(job, SHARD_CAPSULE, free_shard);
    if (capsule == NULL) {
        free(job);
        return NULL;
    }
    /* from here the capsule frees what is set, should a step fail */
    if ((job->frames = PySequence_Tuple(frames_o)) == NULL) goto fail;
    PyObject *jobs = PySequence_Fast(jobs_o, "jobs must be a sequence of (row, job)");
    if (jobs == NULL) goto fail;
    job->rows = PyTuple_GET_SIZE(job->frames);
    Py_ssize_t njobs = PySequence_Fast_GET_SIZE(jobs);
    job->frame = calloc(job->rows ? job->rows : 1, sizeof(char *));
    job->length = calloc(job->rows ? job->rows : 1, sizeof(size_t));
    job->jobs = calloc(njobs ? njobs : 1, sizeof(encode_job_t *));
    job->lo = calloc(njobs ? njobs : 1, sizeof(int64_t));
    job->job_capsules = calloc(njobs ? njobs : 1, sizeof(PyObject *));
    job->folders = strdup(folders);
    job->tmp = strdup(tmp);
    job->name = strdup(name);
    if (!job->frame || !job->length || !job->jobs || !job->lo || !job->job_capsules || !job->folders || !job->tmp ||
        !job->name) {
        Py_DECREF(jobs);
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < njobs; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(jobs, i), *job_o;
        long long lo;
        if (!PyArg_ParseTuple(item, "LO", &lo, &job_o) ||
            (job->jobs[i] = PyCapsule_GetPointer(job_o, JOB_CAPSULE)) == NULL) {
            Py_DECREF(jobs);
            goto fail;
        }
        if (lo < 0 || lo > job->rows) {
            Py_DECREF(jobs);
            PyErr_Format(PyExc_ValueError, "a job's first row %lld is outside the %lld rows", lo, (long long)job->rows);
            goto fail;
        }
        job->lo[i] = lo;
        Py_INCREF(job_o);
        job->job_capsules[i] = job_o;
        job->njobs = i + 1;
    }
    Py_DECREF(jobs);
    for (int64_t r = 0; r < job->rows; r++) {
        PyObject *f = PyTuple_GET_ITEM(job->frames, r);
        if (f == Py_None) continue;
        if (!PyBytes_Check(f)) {
            PyErr_Format(PyExc_TypeError, "frame %lld is %.100s, not bytes or None", (long long)r, Py_TYPE(f)->tp_name);
            goto fail;
        }
        job->frame[r] = PyBytes_AS_STRING(f);
        job->length[r] = (size_t)PyBytes_GET_SIZE(f);
    }
    if ((job->dirfd = fcntl(dirfd, F_DUPFD_CLOEXEC, 0)) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto fail;
    }
    enqueue(w, worker_o, capsule, &job->head);
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

PyDoc_STRVAR(shard_done_doc,
             "shard_done(job, wait) -> bool\n\n"
             "Whether a submit_shard job is done (waiting for it without the GIL when wait): True once\n"
             "the shard is in place; OSError (errno, the call) if a file operation failed, ValueError if\n"
             "one of its encoding jobs did (the shard was not written).");

static PyObject *shard_done(PyObject *self, PyObject *args) {
    PyObject *capsule;
    int wait;
    if (!PyArg_ParseTuple(args, "Op", &capsule, &wait)) return NULL;
    shard_job_t *job = PyCapsule_GetPointer(capsule, SHARD_CAPSULE);
    if (job == NULL) return NULL;
    if (!finished(&job->head, wait)) Py_RETURN_FALSE;
    encode_job_t *failed = job->failed_job;
    if (failed != NULL) return encode_error(failed->enc, failed->failed, failed->failed_result);
    if (job->error) {
        errno = job->error;
        PyObject *what = PyUnicode_FromFormat("%s/%s (%s)", job->folders, job->tmp, job->failed_call);
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, what);
        Py_XDECREF(what);
        return NULL;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(gather_rows_doc,
             "gather_rows(src, stride, offset, rows, out, a, b, item)\n\n"
             "Row i of out (a * b * item bytes) = the [a, b] matrix of item-byte values at byte\n"
             "offset + rows[i] * stride of src, transposed (a == 1 or b == 1: copied as it is), without the\n"
             "GIL. rows is int64; out is C-contiguous. ValueError for a row outside src.");

static PyObject *gather_rows(PyObject *self, PyObject *args) {
    PyObject *src_o, *rows_o, *out_o;
    Py_ssize_t stride, offset, a, b, item;
    if (!PyArg_ParseTuple(args, "OnnOOnnn", &src_o, &stride, &offset, &rows_o, &out_o, &a, &b, &item)) return NULL;
    Py_buffer src = {0}, rows = {0}, out = {0};
    PyObject *result = NULL;
    if (a < 1 || b < 1 || item < 1 || stride < 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "a, b and item must be positive, stride and offset not negative");
        return NULL;
    }
    size_t nbytes = (size_t)a * (size_t)b * (size_t)item;
    if (PyObject_GetBuffer(src_o, &src, PyBUF_SIMPLE) < 0) goto done;
    if (PyObject_GetBuffer(rows_o, &rows, PyBUF_C_CONTIGUOUS) < 0) goto done;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    int64_t n = rows.len / 8;
    if (rows.len % 8 || (size_t)out.len != (size_t)n * nbytes) {
        PyErr_Format(PyExc_ValueError, "rows must be int64 and out %lld rows of %zu bytes", (long long)n, nbytes);
        goto done;
    }
    const int64_t *r = rows.buf;
    for (int64_t i = 0; i < n; i++) {
        if (r[i] < 0 || (size_t)offset + (size_t)r[i] * (size_t)stride + nbytes > (size_t)src.len) {
            PyErr_Format(PyExc_ValueError, "row %lld (%lld) lies outside the source", (long long)i, (long long)r[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < n; i++)
        transpose_into((char *)out.buf + (size_t)i * nbytes, (const char *)src.buf + offset + (size_t)r[i] * stride, a, b,
                       (size_t)item);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    if (src.obj) PyBuffer_Release(&src);
    if (rows.obj) PyBuffer_Release(&rows);
    if (out.obj) PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, load_doc},
    {"zstd_dictionary", zstd_dictionary, METH_VARARGS, zstd_dictionary_doc},
    {"decode_rows", decode_rows, METH_VARARGS, decode_rows_doc},
    {"gather_rows", gather_rows, METH_VARARGS, gather_rows_doc},
    {"zstd_skips_checksums", zstd_skips_checksums, METH_NOARGS, zstd_skips_checksums_doc},
    {"check_stacks", check_stacks, METH_VARARGS,
     "check_stacks(obs, nxt, kept, kept_out, newest_out, flags, outer, k, inner): see mmreplay.frames"},
    {"stack_simd", stack_simd, METH_VARARGS,
     "stack_simd(name=None) -> str: the vector loop of check_stacks for HWC stacks of four 1-byte frames "
     "('avx2' where the CPU has it, else 'sse2'); with name, use that one"},
    {"can_encode", can_encode, METH_VARARGS, can_encode_doc},
    {"new_encoder", new_encoder, METH_VARARGS, new_encoder_doc},
    {"encode_rows", encode_rows, METH_VARARGS, encode_rows_doc},
    {"new_worker", new_worker, METH_VARARGS, new_worker_doc},
    {"submit_rows", submit_rows, METH_VARARGS, submit_rows_doc},
    {"job_frames", job_frames, METH_VARARGS, job_frames_doc},
    {"submit_shard", submit_shard, METH_VARARGS, submit_shard_doc},
    {"shard_done", shard_done, METH_VARARGS, shard_done_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mmreplay._rowdecode",
    "Batch decoding of row frames in one call, without the GIL (see mmreplay.backends.native_rows).", -1, methods,
};

PyMODINIT_FUNC PyInit__rowdecode(void) {
    static int registered;
    if (!registered && pthread_atfork(pool_before_fork, pool_after_fork_parent, pool_after_fork) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    registered = 1;
    stack_init();
    crc32c_init();
    return PyModule_Create(&module);
}

/* ---------------------------------------------------------------------------------------
 * Frame stacks added to a store that keeps each frame once (mmreplay/frames.py).
 *
 * One pass over memory per pair of observation / next-observation leaves and step, over all
 * envs: each env's stacks are C-contiguous bytes [outer, k, inner] (k frames on the stack
 * axis; inner: bytes after it, outer: positions before it), so HWC stacks are [H*W, k, 1]
 * and CHW stacks [1, k, H*W]. Per env it sets in flags:
 *   STACK_FOLLOWS       obs frames 0..k-2 are kept's frames 0..k-2 (kept: the previous
 *                       step's next stacks, already checked to be the stacks before
 *                       them shifted by one frame)
 *   STACK_NEWEST_SAME   obs frame k-1 is kept's frame k-1
 *   STACK_NEXT_FOLLOWS  nxt frames 0..k-2 are obs frames 1..k-1
 * and it copies obs frame k-1 (the frame to store) to newest_out [outer, inner] and nxt to
 * kept_out (the stacks the next step is checked against). Bytes are compared, so the
 * caller passes integer or bool stacks only; the GIL is released during the pass.
 * ------------------------------------------------------------------------------------ */

enum { STACK_FOLLOWS = 1, STACK_NEWEST_SAME = 2, STACK_NEXT_FOLLOWS = 4 };

#if defined(__GNUC__)
#define STACK_INLINE static inline __attribute__((always_inline))
#else
#define STACK_INLINE static inline
#endif

/* What differs, as ORs of XORs: obs frames 0..k-2 vs kept's, obs frame k-1 vs kept's, nxt
 * frames 0..k-2 vs obs frames 1..k-1. */
typedef struct {
    uint64_t prefix, last, next;
} stack_acc;

STACK_INLINE uint64_t stack_load(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

STACK_INLINE void stack_store(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }

/* Non-zero iff the n bytes at a and b differ. */
static uint64_t stack_differ(const unsigned char *a, const unsigned char *b, size_t n) {
    uint64_t d0 = 0, d1 = 0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        d0 |= stack_load(a + i) ^ stack_load(b + i);
        d1 |= stack_load(a + i + 8) ^ stack_load(b + i + 8);
    }
    for (; i < n; i++) d0 |= (uint64_t)(a[i] ^ b[i]);
    return d0 | d1;
}

/* Any layout: frames as runs of `inner` bytes, positions o in [0, outer). */
static void stack_runs(stack_acc *acc, const unsigned char *obs, const unsigned char *nxt, const unsigned char *kept,
                       unsigned char *kept_out, unsigned char *newest, size_t outer, size_t k, size_t inner) {
    size_t stack = k * inner, head = (k - 1) * inner;
    for (size_t o = 0; o < outer; o++) {
        const unsigned char *ob = obs + o * stack, *nb = nxt + o * stack;
        if (kept != NULL) {
            const unsigned char *kb = kept + o * stack;
            acc->prefix |= stack_differ(ob, kb, head);
            acc->last |= stack_differ(ob + head, kb + head, inner);
        }
        acc->next |= stack_differ(nb, ob + inner, head);
        memcpy(newest + o * inner, ob + head, inner);
        memcpy(kept_out + o * stack, nb, stack);
    }
}

/* Pixels (a stack of k frames of `inner` bytes: pixel = k * inner bytes) of 2, 4 or 8 bytes,
 * as little-endian 64-bit words: within a pixel frame f is bytes f*inner.., so shifting a word
 * right by `inner` bytes lines frame f+1 up with frame f, and `keep` masks frames 0..k-2 of
 * each pixel. Inlined with constant sizes. */
STACK_INLINE void stack_words(stack_acc *acc, const unsigned char *obs, const unsigned char *nxt,
                              const unsigned char *kept, unsigned char *kept_out, unsigned char *newest,
                              size_t words, size_t pixel, size_t inner) {
    uint64_t keep = 0, prefix = 0, last = 0, next = 0;
    for (size_t p = 0; p < 8; p += pixel) keep |= (((uint64_t)1 << (8 * (pixel - inner))) - 1) << (8 * p);
    size_t per_word = 8 / pixel, shift = 8 * inner, top = 8 * (pixel - inner);
    for (size_t w = 0; w < words; w++) {
        uint64_t o = stack_load(obs + 8 * w), n = stack_load(nxt + 8 * w);
        if (kept != NULL) {
            uint64_t d = o ^ stack_load(kept + 8 * w);
            prefix |= d & keep;
            last |= d & ~keep;
        }
        next |= ((o >> shift) ^ n) & keep;
        stack_store(kept_out + 8 * w, n);
        for (size_t p = 0; p < per_word; p++) {
            uint64_t v = o >> (8 * pixel * p + top);
            unsigned char *dst = newest + (w * per_word + p) * inner;
            for (size_t b = 0; b < inner; b++) dst[b] = (unsigned char)(v >> (8 * b));
        }
    }
    acc->prefix |= prefix;
    acc->last |= last;
    acc->next |= next;
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* bytes ahead of the two input streams to prefetch (measured on HWC stacks: the cold pass
 * took 0.7x the time with 2 KiB; it did not help the CHW pass) */
#define STACK_AHEAD 2048

STACK_INLINE uint64_t stack_fold(__m128i v) {
    uint64_t lo, hi;
    _mm_storel_epi64((__m128i *)&lo, v);
    _mm_storel_epi64((__m128i *)&hi, _mm_unpackhi_epi64(v, v));
    return lo | hi;
}

/* HWC stacks of four 1-byte frames: 16 pixels (64 bytes) a round; the pixels done. */
STACK_INLINE size_t stack_hwc4_sse2(stack_acc *acc, const unsigned char *obs, const unsigned char *nxt,
                                    const unsigned char *kept, unsigned char *kept_out, unsigned char *newest,
                                    size_t pixels) {
    const __m128i keep = _mm_set1_epi32(0x00FFFFFF);
    __m128i prefix = _mm_setzero_si128(), last = prefix, next = prefix;
    size_t p = 0;
    for (; p + 16 <= pixels; p += 16) {
        __m128i top[4];
        __builtin_prefetch(obs + 4 * p + STACK_AHEAD);
        __builtin_prefetch(nxt + 4 * p + STACK_AHEAD);
        for (int j = 0; j < 4; j++) {
            size_t at = 4 * p + 16 * j;
            __m128i o = _mm_loadu_si128((const __m128i *)(obs + at));
            __m128i n = _mm_loadu_si128((const __m128i *)(nxt + at));
            if (kept != NULL) {
                __m128i d = _mm_xor_si128(o, _mm_loadu_si128((const __m128i *)(kept + at)));
                prefix = _mm_or_si128(prefix, _mm_and_si128(d, keep));
                last = _mm_or_si128(last, _mm_andnot_si128(keep, d));
            }
            next = _mm_or_si128(next, _mm_and_si128(_mm_xor_si128(_mm_srli_epi32(o, 8), n), keep));
            _mm_storeu_si128((__m128i *)(kept_out + at), n);
            top[j] = _mm_srli_epi32(o, 24);
        }
        __m128i packed = _mm_packus_epi16(_mm_packs_epi32(top[0], top[1]), _mm_packs_epi32(top[2], top[3]));
        _mm_storeu_si128((__m128i *)(newest + p), packed);
    }
    acc->prefix |= stack_fold(prefix);
    acc->last |= stack_fold(last);
    acc->next |= stack_fold(next);
    return p;
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define STACK_AVX2 1
/* Use the AVX2 loop (set at import where the CPU has AVX2; stack_simd() switches it). */
static int stack_use_avx2 = -1;

/* stack_hwc4_sse2 with 32-byte vectors: 32 pixels (128 bytes) a round; the pixels done. */
__attribute__((target("avx2"))) static size_t stack_hwc4_avx2(stack_acc *acc, const unsigned char *obs,
                                                              const unsigned char *nxt, const unsigned char *kept,
                                                              unsigned char *kept_out, unsigned char *newest,
                                                              size_t pixels) {
    const __m256i keep = _mm256_set1_epi32(0x00FFFFFF);
    /* the packs below work within 128-bit lanes: dwords of 4 pixels come out as 0, 2, 4, 6, 1, 3, 5, 7 */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i prefix = _mm256_setzero_si256(), last = prefix, next = prefix;
    size_t p = 0;
    for (; p + 32 <= pixels; p += 32) {
        __m256i top[4];
        __builtin_prefetch(obs + 4 * p + STACK_AHEAD);
        __builtin_prefetch(obs + 4 * p + STACK_AHEAD + 64);
        __builtin_prefetch(nxt + 4 * p + STACK_AHEAD);
        __builtin_prefetch(nxt + 4 * p + STACK_AHEAD + 64);
        for (int j = 0; j < 4; j++) {
            size_t at = 4 * p + 32 * j;
            __m256i o = _mm256_loadu_si256((const __m256i *)(obs + at));
            __m256i n = _mm256_loadu_si256((const __m256i *)(nxt + at));
            if (kept != NULL) {
                __m256i d = _mm256_xor_si256(o, _mm256_loadu_si256((const __m256i *)(kept + at)));
                prefix = _mm256_or_si256(prefix, _mm256_and_si256(d, keep));
                last = _mm256_or_si256(last, _mm256_andnot_si256(keep, d));
            }
            next = _mm256_or_si256(next, _mm256_and_si256(_mm256_xor_si256(_mm256_srli_epi32(o, 8), n), keep));
            _mm256_storeu_si256((__m256i *)(kept_out + at), n);
            top[j] = _mm256_srli_epi32(o, 24);
        }
        __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(top[0], top[1]), _mm256_packs_epi32(top[2], top[3]));
        _mm256_storeu_si256((__m256i *)(newest + p), _mm256_permutevar8x32_epi32(packed, order));
    }
    acc->prefix |= stack_fold(_mm_or_si128(_mm256_castsi256_si128(prefix), _mm256_extracti128_si256(prefix, 1)));
    acc->last |= stack_fold(_mm_or_si128(_mm256_castsi256_si128(last), _mm256_extracti128_si256(last, 1)));
    acc->next |= stack_fold(_mm_or_si128(_mm256_castsi256_si128(next), _mm256_extracti128_si256(next, 1)));
    return p;
}
#endif

/* Frames as runs of `inner` bytes, inner a multiple of 16 (CHW stacks: outer is 1): all k
 * frames of a position compared, copied and extracted in one pass, 16 bytes at a time. */
STACK_INLINE void stack_planar_sse2(stack_acc *acc, const unsigned char *obs, const unsigned char *nxt,
                                    const unsigned char *kept, unsigned char *kept_out, unsigned char *newest,
                                    size_t outer, size_t k, size_t inner) {
    __m128i prefix = _mm_setzero_si128(), last = prefix, next = prefix;
    size_t stack = k * inner;
    for (size_t o = 0; o < outer; o++) {
        const unsigned char *ob = obs + o * stack, *nb = nxt + o * stack, *kb = kept ? kept + o * stack : NULL;
        unsigned char *ko = kept_out + o * stack, *nw = newest + o * inner;
        for (size_t i = 0; i < inner; i += 16) {
            __m128i cur = _mm_loadu_si128((const __m128i *)(ob + i));
            for (size_t f = 0; f + 1 < k; f++) {
                __m128i after = _mm_loadu_si128((const __m128i *)(ob + (f + 1) * inner + i));
                __m128i n = _mm_loadu_si128((const __m128i *)(nb + f * inner + i));
                if (kb != NULL)
                    prefix = _mm_or_si128(prefix,
                                          _mm_xor_si128(cur, _mm_loadu_si128((const __m128i *)(kb + f * inner + i))));
                next = _mm_or_si128(next, _mm_xor_si128(n, after));
                _mm_storeu_si128((__m128i *)(ko + f * inner + i), n);
                cur = after;
            }
            if (kb != NULL)
                last = _mm_or_si128(last,
                                    _mm_xor_si128(cur, _mm_loadu_si128((const __m128i *)(kb + (k - 1) * inner + i))));
            _mm_storeu_si128((__m128i *)(nw + i), cur);
            _mm_storeu_si128((__m128i *)(ko + (k - 1) * inner + i),
                             _mm_loadu_si128((const __m128i *)(nb + (k - 1) * inner + i)));
        }
    }
    acc->prefix |= stack_fold(prefix);
    acc->last |= stack_fold(last);
    acc->next |= stack_fold(next);
}
#endif

STACK_INLINE void stack_env_with(stack_acc *acc, const unsigned char *obs, const unsigned char *nxt,
                                 const unsigned char *kept, unsigned char *kept_out, unsigned char *newest,
                                 size_t outer, size_t k, size_t inner) {
    size_t pixel = k * inner, bytes = outer * pixel;
#if defined(__SSE2__)
    if (inner % 16 == 0) {
        stack_planar_sse2(acc, obs, nxt, kept, kept_out, newest, outer, k, inner);
        return;
    }
#endif
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (bytes % 8 == 0) {
        size_t words = bytes / 8;
        /* the common stacks, with constant sizes so that the loops are unrolled */
        if (pixel == 4 && inner == 1) {
            size_t done = 0;
#if defined(STACK_AVX2)
            if (stack_use_avx2 > 0) done = stack_hwc4_avx2(acc, obs, nxt, kept, kept_out, newest, outer);
#endif
#if defined(__SSE2__)
            done += stack_hwc4_sse2(acc, obs + 4 * done, nxt + 4 * done, kept ? kept + 4 * done : NULL,
                                    kept_out + 4 * done, newest + done, outer - done);
#endif
            stack_words(acc, obs + 4 * done, nxt + 4 * done, kept ? kept + 4 * done : NULL, kept_out + 4 * done,
                        newest + done, words - done / 2, 4, 1);
            return;
        }
        if (pixel == 2 && inner == 1) return stack_words(acc, obs, nxt, kept, kept_out, newest, words, 2, 1);
        if (pixel == 8 && inner == 1) return stack_words(acc, obs, nxt, kept, kept_out, newest, words, 8, 1);
        if (pixel == 8 && inner == 2) return stack_words(acc, obs, nxt, kept, kept_out, newest, words, 8, 2);
        if (pixel == 4 && inner == 2) return stack_words(acc, obs, nxt, kept, kept_out, newest, words, 4, 2);
        if (pixel == 8 && inner == 4) return stack_words(acc, obs, nxt, kept, kept_out, newest, words, 8, 4);
    }
#endif
    stack_runs(acc, obs, nxt, kept, kept_out, newest, outer, k, inner);
}

/* The flags of one env (see above). */
static int stack_env(const unsigned char *obs, const unsigned char *nxt, const unsigned char *kept,
                     unsigned char *kept_out, unsigned char *newest, size_t outer, size_t k, size_t inner) {
    stack_acc acc = {0, 0, 0};
    if (kept != NULL)
        stack_env_with(&acc, obs, nxt, kept, kept_out, newest, outer, k, inner);
    else /* the first step: nothing to compare with (inlined apart, without the test per word) */
        stack_env_with(&acc, obs, nxt, NULL, kept_out, newest, outer, k, inner);
    return (kept != NULL && !acc.prefix ? STACK_FOLLOWS : 0) | (kept != NULL && !acc.last ? STACK_NEWEST_SAME : 0) |
           (!acc.next ? STACK_NEXT_FOLLOWS : 0);
}

static void stack_init(void) {
#if defined(STACK_AVX2)
    __builtin_cpu_init();
    stack_use_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
}

static PyObject *stack_simd(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s", &name)) return NULL;
#if defined(STACK_AVX2)
    if (name != NULL) {
        if (strcmp(name, "avx2") == 0 && __builtin_cpu_supports("avx2")) stack_use_avx2 = 1;
        else if (strcmp(name, "sse2") == 0) stack_use_avx2 = 0;
        else return PyErr_Format(PyExc_ValueError, "stack_simd: %s is not available here", name);
    }
    return PyUnicode_FromString(stack_use_avx2 ? "avx2" : "sse2");
#else
    if (name != NULL && strcmp(name, "sse2") != 0)
        return PyErr_Format(PyExc_ValueError, "stack_simd: %s is not available here", name);
    return PyUnicode_FromString("sse2");
#endif
}

static int stack_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t len, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->len != len) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd", what, view->len, len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *check_stacks(PyObject *self, PyObject *args) {
    PyObject *obs_o, *nxt_o, *kept_o, *kept_out_o, *newest_o, *flags_o;
    Py_ssize_t outer, k, inner;
    if (!PyArg_ParseTuple(args, "OOOOOOnnn", &obs_o, &nxt_o, &kept_o, &kept_out_o, &newest_o, &flags_o, &outer, &k,
                          &inner))
        return NULL;
    if (outer < 1 || k < 2 || inner < 1 || outer > PY_SSIZE_T_MAX / k / inner) {
        PyErr_Format(PyExc_ValueError, "bad stack layout: outer=%zd, k=%zd, inner=%zd", outer, k, inner);
        return NULL;
    }
    Py_buffer flags = {0}, obs = {0}, nxt = {0}, kept = {0}, kept_out = {0}, newest = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(flags_o, &flags, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    Py_ssize_t ne = flags.len, stack = outer * k * inner;
    if (ne > PY_SSIZE_T_MAX / stack) {
        PyErr_SetString(PyExc_ValueError, "stacks too large");
        goto done;
    }
    if (stack_buffer(obs_o, &obs, ne * stack, 0, "obs") < 0) goto done;
    if (stack_buffer(nxt_o, &nxt, ne * stack, 0, "nxt") < 0) goto done;
    if (kept_o != Py_None && stack_buffer(kept_o, &kept, ne * stack, 0, "kept") < 0) goto done;
    if (stack_buffer(kept_out_o, &kept_out, ne * stack, 1, "kept_out") < 0) goto done;
    if (stack_buffer(newest_o, &newest, ne * outer * inner, 1, "newest_out") < 0) goto done;
    {
        const unsigned char *o = obs.buf, *n = nxt.buf, *kp = kept.obj ? kept.buf : NULL;
        unsigned char *ko = kept_out.buf, *nw = newest.buf, *fl = flags.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t e = 0; e < ne; e++)
            fl[e] = (unsigned char)stack_env(o + e * stack, n + e * stack, kp ? kp + e * stack : NULL,
                                             ko + e * stack, nw + e * outer * inner, (size_t)outer,
                                             (size_t)k, (size_t)inner);
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (flags.obj) PyBuffer_Release(&flags);
    if (obs.obj) PyBuffer_Release(&obs);
    if (nxt.obj) PyBuffer_Release(&nxt);
    if (kept.obj) PyBuffer_Release(&kept);
    if (kept_out.obj) PyBuffer_Release(&kept_out);
    if (newest.obj) PyBuffer_Release(&newest);
    return result;
}
