/* One-token decode of a decoder layer in fp32 on x86-64 CPUs with AVX2 and FMA (hivekeeper.core.runtime.kernels.native_kernels
 * compiles this file at first use and calls it through ctypes).
 *
 * Why native code: at batch 1 a layer is four matrix-vector products that stream megabytes of weights, with ~30
 * small vector ops between them. From Python each small op costs microseconds, cache-cold after every matmul, and
 * the matmuls go through OpenBLAS, whose worker threads spin between calls. Here a layer is one call: the small ops
 * run in a few microseconds, and the matrix-vector products run on a small thread pool of our own whose workers
 * wait spinning for a moment, then sleep.
 *
 * The arithmetic is Block.forward's, in the same order (tests/core/runtime/kernels/test_native_kernels.py and test_model.py compare
 * it with the torch and numpy paths and with transformers). Weights [out, in] are row-major, or column-major (the
 * runtime stores tall ones so, see cpu_matmul.store_tall_by_column).
 * Calls are serialized by one lock: the pool and the scratch buffers are shared.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_THREADS 64

/* Busy-wait step. Not PAUSE: in a KVM guest a PAUSE loop traps to the hypervisor (pause-loop exiting), which may
   deschedule the waiting vCPU; a 125M model decoded 10-20% slower with it. OpenBLAS spins with NOPs as well. */
#define SPIN_STEP() __asm__ __volatile__("nop; nop; nop; nop; nop; nop; nop; nop")

/* ---- thread pool ---------------------------------------------------------------------------------------------- */
typedef void (*task_fn)(void *ctx, int index, int count);

static struct {
    int count;             /* threads running tasks, the caller's included; 0 before the first task */
    int wanted;            /* hk_set_threads */
    pid_t owner;           /* the process that started the workers: a forked child starts its own */
    pthread_t workers[MAX_THREADS];
    _Atomic uint64_t generation; /* bumped once per task: workers watch it */
    uint64_t start_generation;
    _Atomic int running, sleepers, stop;
    task_fn fn;
    void *ctx;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    double spin_seconds;   /* how long an idle worker spins before it sleeps */
} pool = {.wanted = 1, .spin_seconds = 0.001};

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

/* A child forked while another thread held the lock would wait forever; its pool restarts on first use. */
static void reset_in_child(void) { pthread_mutex_init(&call_lock, NULL); }
__attribute__((constructor)) static void register_fork_handler(void) { pthread_atfork(NULL, NULL, reset_in_child); }

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    uint64_t seen = pool.start_generation, current;
    for (;;) {
        double deadline = 0;
        unsigned spins = 0;
        while ((current = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            SPIN_STEP();
            if ((++spins & 255) != 0) continue;
            double now = seconds_now();
            if (deadline == 0) {
                deadline = now + pool.spin_seconds;
            } else if (now > deadline) {
                /* sleepers is raised before generation is read again under the mutex, and the caller bumps
                   generation before it reads sleepers: one of the two sees the other (no lost wake-up) */
                pthread_mutex_lock(&pool.mutex);
                atomic_fetch_add(&pool.sleepers, 1);
                while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.mutex);
                atomic_fetch_sub(&pool.sleepers, 1);
                pthread_mutex_unlock(&pool.mutex);
                deadline = 0;
            }
        }
        seen = current;
        if (atomic_load(&pool.stop)) return NULL;
        pool.fn(pool.ctx, index, pool.count);
        atomic_fetch_sub_explicit(&pool.running, 1, memory_order_release);
    }
}

static void pool_stop(void) {
    if (pool.count > 1) {
        atomic_store(&pool.stop, 1);
        atomic_fetch_add(&pool.generation, 1);
        pthread_mutex_lock(&pool.mutex);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mutex);
        for (int i = 1; i < pool.count; i++) pthread_join(pool.workers[i], NULL);
    }
    pool.count = 0;
}

static void pool_start(void) {
    pool.owner = getpid();
    pthread_mutex_init(&pool.mutex, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    atomic_store(&pool.stop, 0);
    pool.start_generation = atomic_load(&pool.generation);
    pool.count = 1;
    for (int i = 1; i < pool.wanted; i++) {
        if (pthread_create(&pool.workers[i], NULL, worker_main, (void *)(intptr_t)i) != 0) break;
        pool.count = i + 1;
    }
}

/* The pool's thread count, after (re)starting it if needed. */
static int pool_ready(void) {
    if (pool.owner != getpid()) {
        pool.count = 0; /* a forked child: the workers stayed in the parent */
        pool_start();
    } else if (pool.count != pool.wanted) {
        pool_stop();
        pool_start();
    }
    return pool.count;
}

/* Run fn(ctx, index, count) on every thread of the pool (the caller is index 0) and wait for all of them. */
static void parallel(task_fn fn, void *ctx) {
    if (pool_ready() == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.running, pool.count - 1);
    atomic_fetch_add(&pool.generation, 1);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mutex);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mutex);
    }
    fn(ctx, 0, pool.count);
    while (atomic_load_explicit(&pool.running, memory_order_acquire) > 0) SPIN_STEP();
}

/* Threads for the next calls (the pool restarts when it changes); returns the count in effect. */
int hk_set_threads(int count) {
    pthread_mutex_lock(&call_lock);
    pool.wanted = count < 1 ? 1 : count > MAX_THREADS ? MAX_THREADS : count;
    pthread_mutex_unlock(&call_lock);
    return pool.wanted;
}

/* ---- matrix-vector product ------------------------------------------------------------------------------------ */
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static float dot(const float *a, const float *b, long n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0; /* four chains: more loads in flight */
    long j = 0;
    for (; j + 32 <= n; j += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 8), _mm256_loadu_ps(b + j + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 16), _mm256_loadu_ps(b + j + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j + 24), _mm256_loadu_ps(b + j + 24), s3);
    }
    for (; j + 8 <= n; j += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), s0);
    float s = sum8(_mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3)));
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

/* A few rows of a batch (one new token each) go through here; more go to BLAS, where they are no longer
   memory-bound. hivekeeper.core.runtime.kernels.native_kernels.MAX_ROWS must say the same. */
#define MAX_ROWS 8

typedef struct {
    _Atomic long next; /* the first output row not yet claimed */
    long end;
    char padding[48];  /* one cache line each: the threads claim from their own without sharing a line */
} share;

typedef struct {
    const float *w, *x, *bias; /* w [outs, cols] row-major, x [batch, cols], bias [outs] or NULL */
    float *y;                  /* [batch, outs]: y = x w^T + bias, or y += x w^T + bias when accumulate */
    long outs, cols, batch, chunk;
    int accumulate;
    share shares[MAX_THREADS];
} matvec_task;

static inline void put(const matvec_task *t, long row, long out, float s) {
    if (t->bias) s += t->bias[out];
    float *y = t->y + row * t->outs + out;
    *y = t->accumulate ? *y + s : s;
}

/* One weight row times every batch row: the weights are read from memory once for all of them. */
static void row_times_batch(const float *w, const float *x, long cols, long batch, float *sums) {
    __m256 acc[MAX_ROWS];
    for (long b = 0; b < batch; b++) acc[b] = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= cols; j += 8) {
        __m256 wv = _mm256_loadu_ps(w + j);
        for (long b = 0; b < batch; b++) acc[b] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + b * cols + j), acc[b]);
    }
    for (long b = 0; b < batch; b++) {
        float s = sum8(acc[b]);
        for (long k = j; k < cols; k++) s += w[k] * x[b * cols + k];
        sums[b] = s;
    }
}

static void matvec_rows(const matvec_task *t, long r0, long r1) {
    float sums[MAX_ROWS];
    for (long r = r0; r < r1; r++) {
        const float *w = t->w + r * t->cols;
        if (t->batch == 1) {
            put(t, 0, r, dot(w, t->x, t->cols));
        } else {
            row_times_batch(w, t->x, t->cols, t->batch, sums);
            for (long b = 0; b < t->batch; b++) put(t, b, r, sums[b]);
        }
    }
}

/* Each thread reads its share of the matrix, one weight row after the next: one forward stream, which this CPU's
   prefetchers follow best (4- and 8-row blocks and software prefetching measured slower). It claims the share a
   chunk at a time and then helps with the others', so a thread the OS took off its core (other programs, BLAS
   threads still spinning after a prefill) delays the product by a chunk, not by its whole share. */
static void matvec_part(void *ctx, int index, int count) {
    matvec_task *t = ctx;
    for (int k = 0; k < count; k++) {
        share *own = &t->shares[(index + k) % count];
        for (;;) {
            long r0 = atomic_fetch_add_explicit(&own->next, t->chunk, memory_order_relaxed);
            if (r0 >= own->end) break;
            matvec_rows(t, r0, r0 + t->chunk < own->end ? r0 + t->chunk : own->end);
        }
    }
}

#define CHUNK_BYTES (64 * 1024)

static void matvec_by_rows(const float *w, const float *x, const float *bias, float *y, long outs, long cols,
                           long batch, int accumulate) {
    matvec_task t = {.w = w, .x = x, .bias = bias, .y = y, .outs = outs, .cols = cols, .batch = batch,
                     .accumulate = accumulate};
    int count = pool_ready();
    long per = (outs + count - 1) / count;
    t.chunk = CHUNK_BYTES / (cols * (long)sizeof(float)) > 0 ? CHUNK_BYTES / (cols * (long)sizeof(float)) : 1;
    for (int i = 0; i < count; i++) {
        long start = per * i < outs ? per * i : outs;
        atomic_init(&t.shares[i].next, start);
        t.shares[i].end = start + per < outs ? start + per : outs;
    }
    parallel(matvec_part, &t);
}

/* The same product for a weight stored column-major (element (o, j) at wt[j * outs + o]; the runtime stores tall
   matrices so, because OpenBLAS's prefill products read them faster). Each thread reads a contiguous range of
   the weight's columns into its own partial sums [batch, outs] (in its L1/L2), then the partials are added up.
   The ranges are fixed per thread, not shared out, so the sums are added in the same order on every call. */
typedef struct {
    const float *wt, *x, *bias;
    float *y, *partials; /* partials [threads, batch, outs] */
    long outs, cols, batch;
    int accumulate;
} column_task;

static void column_partial(void *ctx, int index, int count) {
    const column_task *t = ctx;
    long outs = t->outs, cols = t->cols, batch = t->batch, per = (cols + count - 1) / count;
    long j0 = per * index < cols ? per * index : cols, j1 = j0 + per < cols ? j0 + per : cols;
    float *part = t->partials + (long)index * batch * outs;
    memset(part, 0, (size_t)(batch * outs) * sizeof(float));
    long j = j0;
    for (; j + 4 <= j1; j += 4) { /* four columns at a time: each partial is loaded and stored once for four */
        const float *w0 = t->wt + j * outs, *w1 = w0 + outs, *w2 = w1 + outs, *w3 = w2 + outs;
        __m256 xs[MAX_ROWS][4];
        for (long b = 0; b < batch; b++)
            for (int k = 0; k < 4; k++) xs[b][k] = _mm256_set1_ps(t->x[b * cols + j + k]);
        long o = 0;
        for (; o + 8 <= outs; o += 8) {
            __m256 a = _mm256_loadu_ps(w0 + o), c = _mm256_loadu_ps(w1 + o);
            __m256 e = _mm256_loadu_ps(w2 + o), g = _mm256_loadu_ps(w3 + o);
            for (long b = 0; b < batch; b++) {
                float *p = part + b * outs + o;
                __m256 acc = _mm256_fmadd_ps(a, xs[b][0], _mm256_loadu_ps(p));
                acc = _mm256_fmadd_ps(c, xs[b][1], acc);
                acc = _mm256_fmadd_ps(e, xs[b][2], acc);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(g, xs[b][3], acc));
            }
        }
        for (; o < outs; o++)
            for (long b = 0; b < batch; b++) {
                const float *xb = t->x + b * cols + j;
                part[b * outs + o] += w0[o] * xb[0] + w1[o] * xb[1] + w2[o] * xb[2] + w3[o] * xb[3];
            }
    }
    for (; j < j1; j++)
        for (long b = 0; b < batch; b++) {
            float xb = t->x[b * cols + j];
            for (long o = 0; o < outs; o++) part[b * outs + o] += t->wt[j * outs + o] * xb;
        }
}

static void column_sum(void *ctx, int index, int count) {
    const column_task *t = ctx;
    long outs = t->outs, per = (outs + count - 1) / count;
    long o0 = per * index < outs ? per * index : outs, o1 = o0 + per < outs ? o0 + per : outs;
    for (long b = 0; b < t->batch; b++)
        for (long o = o0; o < o1; o++) {
            float s = 0;
            for (int i = 0; i < count; i++) s += t->partials[((long)i * t->batch + b) * outs + o];
            if (t->bias) s += t->bias[o];
            float *y = t->y + b * outs + o;
            *y = t->accumulate ? *y + s : s;
        }
}

static float *partials;
static size_t partial_floats;

/* y [batch, outs] = x [batch, cols] w^T (+ bias), or y += that; w [outs, cols] is row-major, or column-major when
   column_major. Returns 0, or -1 when the partial sums of a column-major product found no memory (y unchanged). */
static int matvec(const float *w, int column_major, const float *x, const float *bias, float *y, long outs,
                  long cols, long batch, int accumulate) {
    if (!column_major) {
        matvec_by_rows(w, x, bias, y, outs, cols, batch, accumulate);
        return 0;
    }
    int count = pool_ready();
    size_t need = (size_t)count * (size_t)(batch * outs);
    if (need > partial_floats) {
        float *grown = realloc(partials, need * sizeof(float));
        if (!grown) return -1;
        partials = grown;
        partial_floats = need;
    }
    column_task t = {w, x, bias, y, partials, outs, cols, batch, accumulate};
    parallel(column_partial, &t);
    parallel(column_sum, &t);
    return 0;
}

/* y [batch, outs] = x [batch, cols] w [outs, cols]^T (+ bias) on the pool; batch <= MAX_ROWS; w row-major, or
   column-major when column_major. Returns 0, or -1 when memory ran out. */
int hk_gemv(const float *w, int column_major, const float *x, const float *bias, float *y, long outs, long cols,
            long batch) {
    pthread_mutex_lock(&call_lock);
    int status = matvec(w, column_major, x, bias, y, outs, cols, batch, 0);
    pthread_mutex_unlock(&call_lock);
    return status;
}

/* ---- one decoder layer ---------------------------------------------------------------------------------------- */
typedef struct {
    long hidden, heads, kv_heads, head_dim, intermediate;
    const float *norm1, *norm2; /* input_layernorm, post_attention_layernorm weights [hidden] */
    double eps1, eps2;
    const float *qkv_w, *qkv_b;         /* [(heads + 2 kv_heads) head_dim, hidden]: q, k, v rows */
    const float *o_w, *o_b;             /* [hidden, heads head_dim] */
    const float *gate_up_w, *gate_up_b; /* [2 intermediate, hidden]: gate rows, then up rows */
    const float *down_w, *down_b;       /* [hidden, intermediate] */
    long column_major;                  /* bits: 1 qkv_w, 2 o_w, 4 gate_up_w, 8 down_w stored column-major */
} hk_block;

typedef struct {
    float *k, *v;                       /* caches [batch, kv_heads, max_length, head_dim], head_dim contiguous */
    long batch_stride, head_stride, position_stride; /* in floats */
    long window;                        /* the layer's sliding window (the last `window` keys), 0 for none */
} hk_cache;

typedef struct {
    long position;                      /* the new token's K/V go there (the same position in every row) */
    const float *cos, *signed_sin;      /* [head_dim]: rotate_half's sign folded into signed_sin */
} hk_token;

static void rms_norm(const float *x, const float *weight, double eps, float *out, long n) {
    double squares = 0;
    for (long i = 0; i < n; i++) squares += (double)x[i] * x[i];
    float inv_rms = (float)(1.0 / sqrt(squares / (double)n + eps));
    for (long i = 0; i < n; i++) out[i] = x[i] * weight[i] * inv_rms;
}

static void rotate(float *v, const float *cos, const float *signed_sin, long d) {
    long half = d / 2;
    for (long i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] + b * signed_sin[i];
        v[i + half] = b * cos[i + half] + a * signed_sin[i + half];
    }
}

typedef struct {
    const hk_block *b;
    const hk_cache *c;
    long batch, first_key, keys; /* attend to keys [first_key, first_key + keys) */
    const float *qkv;            /* [batch, (heads + 2 kv_heads) head_dim], q and k rotated */
    float *scores;               /* [batch, heads, keys] */
    float *context;              /* [batch, heads head_dim] */
} attention_task;

/* softmax(q k^T / sqrt(d)) v for this thread's share of (row, kv head) pairs, each with its group of query heads */
static void attention_part(void *ctx, int index, int count) {
    const attention_task *t = ctx;
    const hk_block *b = t->b;
    const hk_cache *c = t->c;
    long d = b->head_dim, nh = b->heads, nkv = b->kv_heads, group = nh / nkv, keys = t->keys;
    long qkv_width = (nh + 2 * nkv) * d;
    float scale = (float)(1.0 / sqrt((double)d));
    for (long pair = index; pair < t->batch * nkv; pair += count) {
        long row = pair / nkv, g = pair % nkv;
        long at = row * c->batch_stride + g * c->head_stride + t->first_key * c->position_stride;
        const float *k = c->k + at, *v = c->v + at;
        for (long h = g * group; h < (g + 1) * group; h++) {
            const float *q = t->qkv + row * qkv_width + h * d;
            float *p = t->scores + (row * nh + h) * keys, *out = t->context + (row * nh + h) * d;
            float top = -INFINITY, total = 0;
            for (long n = 0; n < keys; n++) {
                p[n] = dot(q, k + n * c->position_stride, d) * scale;
                top = p[n] > top ? p[n] : top;
            }
            for (long n = 0; n < keys; n++) total += (p[n] = expf(p[n] - top));
            memset(out, 0, (size_t)d * sizeof(float));
            for (long n = 0; n < keys; n++) {
                const float *vn = v + n * c->position_stride;
                float weight = p[n] / total;
                for (long i = 0; i < d; i++) out[i] += weight * vn[i];
            }
        }
    }
}

static float *scratch;
static size_t scratch_floats;

static int reserve_scratch(size_t floats) {
    if (floats <= scratch_floats) return 0;
    float *grown = realloc(scratch, floats * sizeof(float));
    if (!grown) return -1;
    scratch = grown;
    scratch_floats = floats;
    return 0;
}

/* x [batch, hidden] <- the layer's output for one new token per row at t->position; writes their K/V into the
   caches (call_lock held). */
static int block_decode(const hk_block *b, const hk_cache *c, const hk_token *t, float *x, long batch) {
    long d = b->head_dim, nh = b->heads, nkv = b->kv_heads, width = b->hidden, size = b->intermediate;
    long end = t->position + 1, first_key = c->window > 0 && end > c->window ? end - c->window : 0;
    long keys = end - first_key;
    long qkv_width = (nh + 2 * nkv) * d;
    size_t need = (size_t)(batch * (width + qkv_width + nh * keys + nh * d + 3 * size));
    if (reserve_scratch(need) != 0) return -1;
    float *normed = scratch, *qkv = normed + batch * width, *scores = qkv + batch * qkv_width;
    float *context = scores + batch * nh * keys, *gate_up = context + batch * nh * d, *act = gate_up + batch * 2 * size;

    /* attention: q, k, v from one product; q and k rotated; the new tokens' k and v into the cache */
    for (long r = 0; r < batch; r++) rms_norm(x + r * width, b->norm1, b->eps1, normed + r * width, width);
    if (matvec(b->qkv_w, b->column_major & 1, normed, b->qkv_b, qkv, qkv_width, width, batch, 0)) return -1;
    for (long r = 0; r < batch; r++) {
        float *row = qkv + r * qkv_width;
        for (long h = 0; h < nh + nkv; h++) rotate(row + h * d, t->cos, t->signed_sin, d);
        for (long g = 0; g < nkv; g++) {
            long at = r * c->batch_stride + g * c->head_stride + t->position * c->position_stride;
            memcpy(c->k + at, row + (nh + g) * d, (size_t)d * sizeof(float));
            memcpy(c->v + at, row + (nh + nkv + g) * d, (size_t)d * sizeof(float));
        }
    }
    attention_task attention = {b, c, batch, first_key, keys, qkv, scores, context};
    if (batch * keys * nh * d >= (1L << 16)) /* long contexts over the pool; short ones cost less than a hand-off */
        parallel(attention_part, &attention);
    else
        attention_part(&attention, 0, 1);
    if (matvec(b->o_w, b->column_major & 2, context, b->o_b, x, width, nh * d, batch, 1)) return -1; /* x += o(context) */

    /* MLP: gate and up from one product */
    for (long r = 0; r < batch; r++) rms_norm(x + r * width, b->norm2, b->eps2, normed + r * width, width);
    if (matvec(b->gate_up_w, b->column_major & 4, normed, b->gate_up_b, gate_up, 2 * size, width, batch, 0)) return -1;
    for (long r = 0; r < batch; r++)
        for (long i = 0; i < size; i++) {
            float g = gate_up[r * 2 * size + i];
            act[r * size + i] = g / (1.0f + expf(-g)) * gate_up[r * 2 * size + size + i];
        }
    if (matvec(b->down_w, b->column_major & 8, act, b->down_b, x, width, size, batch, 1)) return -1; /* x += down(act) */
    return 0;
}

/* y [batch, outs] = rms_norm(x [batch, cols]) * norm, times w [outs, cols]^T: the final norm and LM head of a
   decode step. Returns 0, or -1 when scratch memory ran out. */
int hk_norm_gemv(const float *norm, double eps, const float *w, int column_major, const float *x, float *y, long outs,
                 long cols, long batch) {
    pthread_mutex_lock(&call_lock);
    int status = reserve_scratch((size_t)(batch * cols));
    if (status == 0) {
        for (long r = 0; r < batch; r++) rms_norm(x + r * cols, norm, eps, scratch + r * cols, cols);
        status = matvec(w, column_major, scratch, NULL, y, outs, cols, batch, 0);
    }
    pthread_mutex_unlock(&call_lock);
    return status;
}

/* `count` consecutive layers (one or more) in one call (one Python call per token instead of one per layer:
   between layers Python runs cache-cold and costs ~0.2 ms). Returns 0, or -1-i when layer i ran out of scratch memory (layers
   before it are done). */
int hk_span_decode(const hk_block *blocks, const hk_cache *caches, long count, const hk_token *t, float *x,
                   long batch) {
    pthread_mutex_lock(&call_lock);
    int status = 0;
    for (long i = 0; i < count && status == 0; i++)
        if (block_decode(blocks + i, caches + i, t, x, batch) != 0) status = -1 - (int)i;
    pthread_mutex_unlock(&call_lock);
    return status;
}
