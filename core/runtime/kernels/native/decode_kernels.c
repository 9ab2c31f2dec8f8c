/* One-token decode of a decoder layer in fp32, and matrix-vector products with block-quantized weights (GGUF's
 * Q8_0, Q4_0, Q4_1), on the CPU (hivekeeper.core.runtime.kernels.native_kernels compiles this file at first use and
 * calls it through ctypes; quant_kernels.py wraps the quantized products).
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
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Three builds of this file (native_kernels.VARIANTS): "avx2" (-mavx2 -mfma -mf16c) takes the intrinsics paths
   below; "avx512vnni" adds AVX512-VNNI (with AVX512VL, on 256-bit vectors) for the block-quantized products' integer
   dot products; "portable" (no instruction-set flags, any CPU) takes plain C loops that the compiler vectorizes as it
   can. The suite runs the kernel tests on each build the CPU runs. */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HK_AVX2 1
#include <immintrin.h>
#else
#define HK_AVX2 0
#endif
#if HK_AVX2 && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HK_VNNI 1
#else
#define HK_VNNI 0
#endif

#define MAX_THREADS 64

/* Busy-wait step. Not PAUSE: in a KVM guest a PAUSE loop traps to the hypervisor (pause-loop exiting), which may
   deschedule the waiting vCPU; a 125M model decoded 10-20% slower with it. OpenBLAS spins with NOPs as well. */
#define SPIN_STEP() __asm__ __volatile__("nop; nop; nop; nop; nop; nop; nop; nop")

/* ---- thread pool ----------------------------------------------------------------------------------------------
 * A task is split into chunks, numbered 0..chunks-1, claimed one at a time from a shared ticket by the caller and by
 * every worker awake to see the task. The caller never waits for a worker that has not claimed anything: when the
 * ticket runs out, the caller waits only for the chunks others are still computing (at most one each), so a worker
 * the OS took off its core (other programs on the machine) costs the step nothing unless it was mid-chunk. What a
 * chunk computes never depends on who runs it (each output is summed by one chunk, in a fixed order), so a step's
 * result is the same whoever took which chunks, and with any thread count.
 *
 * The ticket packs the task's generation (high 32 bits) with the next unclaimed chunk (low 32 bits): a worker claims
 * with a compare-and-swap, which fails when the task it saw is over (a late worker never touches a newer task's
 * chunks). The task's description (fn, ctx, chunks) stays valid until its last chunk is done, and a worker reads it
 * only after a successful claim, so it always reads its own task's. */
typedef void (*chunk_fn)(void *ctx, long chunk);

#define GENERATION(ticket) ((ticket) >> 32)
#define CHUNK(ticket) ((long)((ticket) & 0xffffffffu))
#define CLOSED_CHUNK 0xffffffffu /* a spent task's ticket while the next is published (publish) */

static struct {
    int count;             /* threads running tasks, the caller's included; 0 before the first task */
    int wanted;            /* hk_set_threads */
    pid_t owner;           /* the process that started the workers: a forked child starts its own */
    pthread_t workers[MAX_THREADS];
    _Atomic uint64_t ticket;     /* (generation << 32) | next unclaimed chunk; workers watch the generation */
    char padding[56];            /* the ticket and the done count on lines of their own */
    _Atomic long done;           /* chunks of the current task finished */
    char padding2[56];
    _Atomic long chunks;         /* the current task's chunk count */
    uint64_t start_generation;   /* the generation when the workers were started: they wait for the next one */
    chunk_fn fn;
    void *ctx;
    _Atomic int sleepers, stop;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    double spin_seconds;   /* how long an idle worker spins before it sleeps (hk_set_spin; the loader sets it) */
    _Atomic int caller_sleeps;   /* the caller sleeps until the last chunk is done: its finisher wakes it */
    pthread_mutex_t finished_mutex;
    pthread_cond_t finished;
} pool = {.wanted = 1, .finished_mutex = PTHREAD_MUTEX_INITIALIZER, .finished = PTHREAD_COND_INITIALIZER};

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

/* A child forked while another thread held the lock would wait forever; its pool restarts on first use. */
static void reset_in_child(void) { pthread_mutex_init(&call_lock, NULL); }
__attribute__((constructor)) static void register_fork_handler(void) { pthread_atfork(NULL, NULL, reset_in_child); }

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Profiling (a build with -DHK_PROFILE only: bench/decode_profile.py): the calling thread's CPU seconds per part of
   a decode step, summed over calls, read with hk_profile(part) and cleared with hk_profile(-1). PROFILE(part) adds
   the CPU time since the previous mark to `part`; in other builds both are nothing. */
enum { P_NORM, P_QKV, P_ROPE, P_ATTENTION, P_O, P_GATE_UP, P_SILU, P_DOWN, P_HEAD, P_QUANTIZE, P_WAIT, P_SOLO,
       P_PARTS };
#ifdef HK_PROFILE
static double profile_seconds[P_PARTS], profile_mark;
static int profile_product; /* the part of the product running now (its pool share) */
static double profile_now(void) { /* the calling thread's CPU time: what a part costs, whatever else runs */
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
#define PROFILE(part) do { double now_ = profile_now(); profile_seconds[part] += now_ - profile_mark; \
                           profile_mark = now_; } while (0)
#define PROFILE_START() (profile_mark = profile_now())
#define PROFILE_PRODUCT(part) (profile_product = (part))
double hk_profile(int part) {
    if (part < 0) { memset(profile_seconds, 0, sizeof profile_seconds); return 0; }
    return part < P_PARTS ? profile_seconds[part] : 0;
}
#else
#define PROFILE(part) ((void)0)
#define PROFILE_START() ((void)0)
#define PROFILE_PRODUCT(part) ((void)0)
#endif

/* Test hook (hk_test_hold_worker): worker `index` waits there, before claiming anything (or, mid_chunk 1, after
   claiming a chunk), until released or until the deadline, as a worker the OS took off its core would. */
enum { HOLD_BEFORE_CLAIM, HOLD_MID_CHUNK, HOLD_LATE };
static struct {
    _Atomic int index;     /* the worker to hold, -1 for none */
    _Atomic int mid_chunk; /* where: HOLD_BEFORE_CLAIM, HOLD_MID_CHUNK, or HOLD_LATE (held_late_if_asked) */
    _Atomic int held;      /* 1 while it waits */
    _Atomic long holds;    /* how many times it began waiting */
    _Atomic int late;      /* HOLD_LATE: the held worker's index + 1 until it has left that task's claim loop */
    _Atomic long late_chunk; /* the spent ticket's chunk it read */
    double until;
    pthread_mutex_t mutex;
    pthread_cond_t release;
} hold = {.index = -1, .mutex = PTHREAD_MUTEX_INITIALIZER, .release = PTHREAD_COND_INITIALIZER};

static void held_back_if_asked(int index, int mid_chunk) {
    if (atomic_load_explicit(&hold.index, memory_order_relaxed) != index || atomic_load(&hold.mid_chunk) != mid_chunk)
        return;
    pthread_mutex_lock(&hold.mutex);
    atomic_store(&hold.held, 1);
    atomic_fetch_add(&hold.holds, 1);
    while (atomic_load(&hold.index) == index && seconds_now() < hold.until) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        t.tv_nsec += 10 * 1000 * 1000; /* look again every 10 ms */
        if (t.tv_nsec >= 1000000000L) { t.tv_sec += 1; t.tv_nsec -= 1000000000L; }
        pthread_cond_timedwait(&hold.release, &hold.mutex, &t);
    }
    atomic_store(&hold.held, 0);
    pthread_mutex_unlock(&hold.mutex);
}

/* Test hook, HOLD_LATE: worker `index`, having read a spent ticket (chunk `chunk`, every chunk claimed), waits once
   until a task with more chunks is being published, then goes on (reads the count, tries to claim): the moment
   a worker that lost its core right there comes back. publish waits, between the new count and the new ticket,
   until that worker has left its claim loop (paused_for_a_late_worker), so the test sees what it did then. */
static void held_late_if_asked(int index, long chunk) {
    if (atomic_load_explicit(&hold.index, memory_order_relaxed) != index || atomic_load(&hold.mid_chunk) != HOLD_LATE
        || chunk < atomic_load(&pool.chunks) || chunk == (long)CLOSED_CHUNK)
        return;
    atomic_store(&hold.index, -1); /* once per hk_test_hold_worker */
    atomic_store(&hold.late_chunk, chunk);
    atomic_store(&hold.late, index + 1);
    atomic_store(&hold.held, 1);
    atomic_fetch_add(&hold.holds, 1);
    struct timespec pause = {0, 100 * 1000};
    while (atomic_load(&pool.chunks) <= chunk && seconds_now() < hold.until) nanosleep(&pause, NULL);
    atomic_store(&hold.held, 0);
}

static void left_claim_loop(int index) {
    if (atomic_load_explicit(&hold.late, memory_order_relaxed) == index + 1) atomic_store(&hold.late, 0);
}

static void paused_for_a_late_worker(long chunks) {
    if (!atomic_load_explicit(&hold.late, memory_order_relaxed) || chunks <= atomic_load(&hold.late_chunk)) return;
    struct timespec pause = {0, 100 * 1000};
    double deadline = seconds_now() + 2.0;
    while (atomic_load(&hold.late) && seconds_now() < deadline) nanosleep(&pause, NULL);
}

/* Count chunk done; the thread finishing the task's last chunk wakes the caller if it sleeps (it raises
   caller_sleeps before it reads done again under the mutex: one of the two sees the other). */
static void chunk_done(long chunks) {
    if (atomic_fetch_add(&pool.done, 1) + 1 == chunks && atomic_load(&pool.caller_sleeps)) {
        pthread_mutex_lock(&pool.finished_mutex);
        pthread_cond_broadcast(&pool.finished);
        pthread_mutex_unlock(&pool.finished_mutex);
    }
}

/* Claim and run chunks of the task of `generation` until none is left (or that task is over); `index` is the
   thread's (0: the caller). */
static void claim_chunks(uint64_t generation, int index) {
    uint64_t ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        if (GENERATION(ticket) != generation) return;
        long chunk = CHUNK(ticket);
        held_late_if_asked(index, chunk);
        long chunks = atomic_load_explicit(&pool.chunks, memory_order_acquire);
        if (chunk >= chunks) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.ticket, &ticket, ticket + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* ticket now holds the current value */
        held_back_if_asked(index, HOLD_MID_CHUNK);
        pool.fn(pool.ctx, chunk);
        chunk_done(chunks);
        ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    }
}

/* Wait spinning, up to the spin budget, for a new generation; then sleep until one comes. Returns it. */
static uint64_t next_generation(uint64_t seen) {
    double deadline = 0;
    unsigned spins = 0;
    uint64_t current;
    while ((current = GENERATION(atomic_load_explicit(&pool.ticket, memory_order_acquire))) == seen) {
        SPIN_STEP();
        if ((++spins & 255) != 0) continue;
        double now = seconds_now();
        if (deadline == 0) {
            deadline = now + pool.spin_seconds;
        } else if (now > deadline) {
            /* sleepers is raised before the ticket is read again under the mutex, and the caller publishes the
               ticket before it reads sleepers: one of the two sees the other (no lost wake-up) */
            pthread_mutex_lock(&pool.mutex);
            atomic_fetch_add(&pool.sleepers, 1);
            while (GENERATION(atomic_load(&pool.ticket)) == seen) pthread_cond_wait(&pool.wake, &pool.mutex);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mutex);
            deadline = 0;
        }
    }
    return current;
}

static void free_thread_scratch(void);

static void *worker_main(void *arg) {
    int index = (int)(intptr_t)arg;
    uint64_t seen = pool.start_generation; /* not the ticket now: a task, or the stop, may be out before we run */
    for (;;) {
        seen = next_generation(seen);
        if (atomic_load(&pool.stop)) {
            free_thread_scratch();
            return NULL;
        }
        held_back_if_asked(index, HOLD_BEFORE_CLAIM);
        claim_chunks(seen, index);
        left_claim_loop(index);
    }
}

/* Publish a new generation with `chunks` chunks (0: none, as for stopping) and wake sleeping workers.
   The old task's ticket is closed first (its chunk number set past any count): a worker that read it just before,
   with every chunk claimed, and then reads the new, larger chunk count, would otherwise win its compare-and-swap on
   the old ticket and run a chunk of the new task (fn and ctx are already the new ones) that another thread also
   runs, and count it done, so the caller could return before the product was complete. On a loaded machine (the
   caller preempted between these stores) that gave a column-major product's result unequal to one thread's. */
static uint64_t publish(long chunks) {
    uint64_t generation = GENERATION(atomic_load(&pool.ticket));
    atomic_store_explicit(&pool.ticket, generation << 32 | CLOSED_CHUNK, memory_order_seq_cst);
    atomic_store_explicit(&pool.chunks, chunks, memory_order_release);
    paused_for_a_late_worker(chunks);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    generation++;
    atomic_store_explicit(&pool.ticket, generation << 32, memory_order_seq_cst);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mutex);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.mutex);
    }
    return generation;
}

static void pool_stop(void) {
    if (pool.count > 1) {
        atomic_store(&pool.stop, 1);
        publish(0);
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
    pool.start_generation = GENERATION(atomic_load(&pool.ticket));
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

/* Run fn(ctx, chunk) for every chunk in [0, chunks) on the pool (the caller takes chunks too) and return when all
   are done. Chunks still running elsewhere are waited for spinning, for about a chunk's time; past that their thread
   has most likely lost its core to another process, so the caller sleeps, leaving its own core idle for that thread
   to move to, and the thread finishing the last chunk wakes it. */
#define STRAGGLER_SPIN_SECONDS 50e-6

/* Returns 1 when the caller had to sleep for a straggler (a worker that lost its core mid-chunk), else 0. */
static int wait_for_chunks(long chunks, double spin_seconds) {
    double deadline = 0;
    int slept = 0;
    for (unsigned spins = 1; atomic_load_explicit(&pool.done, memory_order_acquire) < chunks; spins++) {
        SPIN_STEP();
        if ((spins & 255) != 0) continue;
        double now = seconds_now();
        if (deadline == 0) {
            deadline = now + spin_seconds;
        } else if (now > deadline) {
            pthread_mutex_lock(&pool.finished_mutex);
            atomic_store(&pool.caller_sleeps, 1);
            while (atomic_load(&pool.done) < chunks) pthread_cond_wait(&pool.finished, &pool.finished_mutex);
            atomic_store(&pool.caller_sleeps, 0);
            pthread_mutex_unlock(&pool.finished_mutex);
            slept = 1;
        }
    }
    return slept;
}

/* Solo runs. A straggler costs its product the rest of the OS's time slice (milliseconds), and a decode step is
 * hundreds of products: on a machine with more runnable threads than cores, stalls on every step made a 2-thread
 * decode ~10x slower than a 1-thread one (SmolLM2 Q4_1 at load ~17 on 2 cores: 2.4 s vs 0.27 s a step). So after
 * a product stalled within STALL_WINDOW pool products of the previous stall, the next `solo.after_stall` products
 * run on the caller alone (the speed of one core, not worse), then the pool is tried again; each such stall in a
 * row doubles that count (up to SOLO_MAX), and a product that finishes without a stall resets it. A stall on its
 * own starts no solo run: on a quiet machine another process takes a core now and then (SmolLM2 on the 2-core VM of
 * session 8: about one stall per token, ~120 products, at load 0.2-0.8), and a solo run after each (half a token on
 * one core) cost more than the stall itself (34.5 against 54.0 tok/s without solo runs, bench/decode_profile.py).
 * A busy machine stalls product after product, so it still goes solo at once. */
#define SOLO_MIN 64 /* the first run's length (hk_set_solo changes it; 0: no solo runs, every product on the pool) */
#define SOLO_MAX 8192
#define STALL_WINDOW 8 /* pool products: a stall this close after the previous one starts a solo run */
static struct { long left, after_stall, stalls, first, products, last_stall; } solo = {
    0, SOLO_MIN, 0, SOLO_MIN, 0, -STALL_WINDOW - 1};

/* parallel() for chunks that each take about `chunk_seconds` (more than a product's chunk): a chunk still running
   elsewhere is waited for spinning that long before it counts as a straggler's (attention_values' chunks read a
   slice of every V row: ~0.1-0.5 ms at 2-8k keys, and waiting 50 us for them counted ~3 stalls a step at 4-8k
   tokens and sent the next products solo, SmolLM2's steps 10-13% slower). */
static void parallel_long(chunk_fn fn, void *ctx, long chunks, double chunk_seconds);

static void parallel(chunk_fn fn, void *ctx, long chunks) { parallel_long(fn, ctx, chunks, STRAGGLER_SPIN_SECONDS); }

static void parallel_long(chunk_fn fn, void *ctx, long chunks, double chunk_seconds) {
    if (pool_ready() == 1 || chunks <= 1 || solo.left > 0) {
        int solo_run = chunks > 1 && solo.left > 0;
        if (solo_run) solo.left--;
        for (long c = 0; c < chunks; c++) fn(ctx, c);
        if (solo_run) PROFILE(P_SOLO);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    claim_chunks(publish(chunks), 0);
    PROFILE(profile_product);
    int stalled = wait_for_chunks(chunks, chunk_seconds > STRAGGLER_SPIN_SECONDS ? chunk_seconds
                                                                                : STRAGGLER_SPIN_SECONDS);
    PROFILE(P_WAIT);
    solo.products++;
    if (stalled) {
        if (solo.products - solo.last_stall <= STALL_WINDOW) {
            solo.left = solo.after_stall;
            solo.after_stall = solo.after_stall * 2 < SOLO_MAX ? solo.after_stall * 2 : SOLO_MAX;
        }
        solo.last_stall = solo.products;
        solo.stalls++;
    } else {
        solo.after_stall = solo.first;
    }
}

/* Benchmark hook: the first solo run's length after a stall (0: none; the pool's setting is SOLO_MIN); returns it. */
long hk_set_solo(long products) {
    pthread_mutex_lock(&call_lock);
    solo.first = solo.after_stall = products < 0 ? 0 : products;
    solo.left = 0;
    pthread_mutex_unlock(&call_lock);
    return solo.first;
}

/* Test and benchmark hook: products that stalled on a straggler so far (each starts a run of solo products), and
   how many solo products are left now. */
long hk_pool_stalls(void) { return solo.stalls; }
long hk_pool_solo_left(void) { return solo.left; }

/* Threads for the next calls (the pool restarts when it changes); returns the count in effect. */
int hk_set_threads(int count) {
    pthread_mutex_lock(&call_lock);
    pool.wanted = count < 1 ? 1 : count > MAX_THREADS ? MAX_THREADS : count;
    pthread_mutex_unlock(&call_lock);
    return pool.wanted;
}

/* Test hook: worker `index` (1..threads-1) stops before claiming chunks of the next tasks (mid_chunk 1: after it
   claimed one, before computing it; 2, HOLD_LATE: once, after reading a spent ticket, see held_late_if_asked), as a
   worker the OS took off its core would, until hk_test_release_worker or `seconds` from now. hk_test_worker_held
   says whether it is waiting there now. */
void hk_test_hold_worker(int index, double seconds, int mid_chunk) {
    pthread_mutex_lock(&hold.mutex);
    hold.until = seconds_now() + seconds;
    atomic_store(&hold.mid_chunk, mid_chunk);
    atomic_store(&hold.index, index);
    pthread_mutex_unlock(&hold.mutex);
}

void hk_test_release_worker(void) {
    pthread_mutex_lock(&hold.mutex);
    atomic_store(&hold.index, -1);
    hold.until = 0; /* a HOLD_LATE worker, already disarmed, stops waiting too */
    pthread_cond_broadcast(&hold.release);
    pthread_mutex_unlock(&hold.mutex);
}

int hk_test_worker_held(void) { return atomic_load(&hold.held); }

/* Test hook: a task of `chunks` chunks on the pool whose chunk c adds 1 to runs[c] (how often each chunk ran). */
static void count_run(void *ctx, long chunk) { atomic_fetch_add((_Atomic long *)ctx + chunk, 1); }

void hk_test_count_chunks(long chunks, long *runs) {
    pthread_mutex_lock(&call_lock);
    parallel(count_run, runs, chunks);
    pthread_mutex_unlock(&call_lock);
}

long hk_test_worker_holds(void) { return atomic_load(&hold.holds); }

/* How long an idle worker spins before it sleeps (seconds); returns the budget in effect. */
double hk_set_spin(double seconds) {
    pthread_mutex_lock(&call_lock);
    pool.spin_seconds = seconds < 0 ? 0 : seconds;
    pthread_mutex_unlock(&call_lock);
    return pool.spin_seconds;
}

/* ---- matrix-vector product ------------------------------------------------------------------------------------
 * dot_block: W weight rows times R activation rows, each pair's sum in dot's order (the same bits as dot(w, row)
 * whatever R and W are, so a row's result does not depend on the batch it is in). It is inlined with constant W and
 * R into each caller (dot: 1 and 1; matvec_chunk: a case per batch size), so the accumulators stay in registers and
 * the loops test nothing per step. The kernel before this one took the batch as a runtime count: one chain of
 * multiply-adds per row, a test of the count per step, and a 2-row product of a weight larger than the L3 took ~2x
 * a 1-row product's time, 8 rows 3-4x (issue 23). */
#if HK_AVX2
static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Software prefetch of `lines` cache lines from p on. The 4-bit kernels read a few rows side by side, each a short
   stream (a 2048-wide Q4_0 row is 18 lines), which the hardware prefetcher picks up too late: while a group of rows
   is multiplied, the rows of the next group are prefetched at the same pace (Q4_0 products of the 1B demo's shapes,
   matrices larger than the L3: 1.1-1.65x less CPU time per streamed byte on one thread, 1.1-1.5x faster on two in
   an alternating A/B at load 9-12; prefetching two or four groups ahead was no better). A prefetch never faults,
   so one past the weights' end is harmless. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *p, int lines) {
    for (int i = 0; i < lines; i++) _mm_prefetch(p + 64 * i, _MM_HINT_T0);
}

/* How far ahead a few-row product's first pass over a weight row asks for its weights (dot_block; measured faster
   there, slower for one row, which goes without). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

/* Batch rows per pass over a weight row in matvec_chunk, and weight rows per pass (WEIGHT_GROUP): as many as keep
   their four chains each in registers (AVX2 has 16 vector registers: 2 rows of one weight row; AVX512VL 32: 2 rows
   of 2 weight rows, each activation load serving both). More rows take more passes over the weight rows, which are
   in L1 by then. */
#ifndef DOT_GROUP
#define DOT_GROUP 2
#endif
#ifndef WEIGHT_GROUP
#define WEIGHT_GROUP (HK_VNNI ? 2 : 1)
#endif

/* W weight rows (w, w + w_stride) times R activation rows (x, x + stride, ...) into out[v * R + i]. Four chains per
   pair (more loads in flight), 32 floats a step; the prefetch (a product's first pass over the weight rows,
   matvec_chunk) asks for the weights PREFETCH_BYTES ahead as it goes. */
static inline __attribute__((always_inline)) void dot_block(int W, int R, const float *w, long w_stride,
                                                            const float *x, long stride, long n, int prefetch,
                                                            float *out) {
    __m256 s[WEIGHT_GROUP][DOT_GROUP][4];
    for (int v = 0; v < W; v++)
        for (int i = 0; i < R; i++) s[v][i][0] = s[v][i][1] = s[v][i][2] = s[v][i][3] = _mm256_setzero_ps();
    long j = 0;
    for (; j + 32 <= n; j += 32) {
        __m256 wv[WEIGHT_GROUP][4];
        for (int v = 0; v < W; v++) {
            const float *row = w + v * w_stride + j;
            if (prefetch) prefetch_ahead((const char *)row + PREFETCH_BYTES, 2);
            for (int k = 0; k < 4; k++) wv[v][k] = _mm256_loadu_ps(row + 8 * k);
        }
        for (int i = 0; i < R; i++)
            for (int k = 0; k < 4; k++) {
                __m256 xv = _mm256_loadu_ps(x + i * stride + j + 8 * k);
                for (int v = 0; v < W; v++) s[v][i][k] = _mm256_fmadd_ps(wv[v][k], xv, s[v][i][k]);
            }
    }
    for (; j + 8 <= n; j += 8)
        for (int i = 0; i < R; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * stride + j);
            for (int v = 0; v < W; v++) s[v][i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(w + v * w_stride + j), xv, s[v][i][0]);
        }
    for (int v = 0; v < W; v++)
        for (int i = 0; i < R; i++) {
            const float *a = w + v * w_stride, *b = x + i * stride;
            float total = sum8(_mm256_add_ps(_mm256_add_ps(s[v][i][0], s[v][i][2]), _mm256_add_ps(s[v][i][1], s[v][i][3])));
            for (long k = j; k < n; k++) total += a[k] * b[k];
            out[v * R + i] = total;
        }
}
#else
#define DOT_GROUP 4
#define WEIGHT_GROUP 1

/* Eight independent sums per pair (the compiler keeps them in vector registers), in one order whatever R is. */
static inline __attribute__((always_inline)) void dot_block(int W, int R, const float *w, long w_stride,
                                                            const float *x, long stride, long n, int prefetch,
                                                            float *out) {
    (void)prefetch, (void)W, (void)w_stride;
    float lanes[DOT_GROUP][8];
    for (int i = 0; i < R; i++)
        for (int k = 0; k < 8; k++) lanes[i][k] = 0;
    long j = 0;
    for (; j + 8 <= n; j += 8)
        for (int i = 0; i < R; i++)
            for (int k = 0; k < 8; k++) lanes[i][k] += w[j + k] * x[i * stride + j + k];
    for (int i = 0; i < R; i++) {
        const float *l = lanes[i], *b = x + i * stride;
        float total = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
        for (long k = j; k < n; k++) total += w[k] * b[k];
        out[i] = total;
    }
}
#endif

static float dot(const float *a, const float *b, long n) {
    float s;
    dot_block(1, 1, a, 0, b, 0, n, 0, &s);
    return s;
}

/* exp over arrays, for the softmax and SiLU between a layer's products (run on the caller alone: every microsecond
   there is one the pool's workers wait). AVX2: eight at a time, Cephes's single-precision exp (the argument split
   by ln 2 in two parts, a degree-5 polynomial; within ~2 ulp of expf over the clamped range; below -87.3 it gives
   ~1e-38 for 0, above 88.3 ~2e38 for infinity); portable: expf. */
#if HK_AVX2
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

/* silu(g) u = g / (1 + exp(-g)) u for 8 values */
static inline __m256 silu_times8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
#endif

/* v[i] = exp(v[i] - shift) for i < n; returns their sum. */
static float exp_shifted(float *v, long n, float shift) {
    long i = 0;
    float total = 0;
#if HK_AVX2
    __m256 s = _mm256_set1_ps(shift), sums = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), s));
        _mm256_storeu_ps(v + i, e);
        sums = _mm256_add_ps(sums, e);
    }
    if (i < n) { /* the tail through a padded vector: every value the same function */
        float tail[8];
        for (int k = 0; k < 8; k++) tail[k] = i + k < n ? v[i + k] : shift;
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), s)));
        for (long k = 0; i + k < n; k++) total += (v[i + k] = tail[k]);
    }
    return sum8(sums) + total;
#else
    for (; i < n; i++) total += (v[i] = expf(v[i] - shift));
    return total;
#endif
}

/* out[i] = silu(gate[i]) up[i] for i < n. */
static void silu_times(const float *gate, const float *up, float *out, long n) {
    long i = 0;
#if HK_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_times8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0}, u[8] = {0}, o[8];
        for (long k = 0; k < n - i; k++) g[k] = gate[i + k], u[k] = up[i + k];
        _mm256_storeu_ps(o, silu_times8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        for (long k = 0; k < n - i; k++) out[i + k] = o[k];
    }
#else
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
#endif
}

/* A few rows of a batch (one new token each) go through here; more go to BLAS, where they are no longer
   memory-bound. hivekeeper.core.runtime.kernels.native_kernels.MAX_ROWS must say the same. */
#define MAX_ROWS 8

#define CHUNK_BYTES (64 * 1024) /* weight bytes per chunk of a product: ~10 us of streaming, claimed as a whole */

typedef struct {
    const float *w, *x, *bias; /* w [outs, cols] row-major, x [batch, cols] (rows x_stride apart), bias [outs] or NULL */
    float *y;                  /* [batch, outs]: y = x w^T + bias, or y += x w^T + bias when accumulate */
    long outs, cols, batch, rows_per_chunk, x_stride;
    int accumulate;
} matvec_task;

/* Batch rows whose length is a multiple of 4 KiB (2048 or 4096 floats: most models' widths) lie on the same L1 cache
   sets and alias each other's 4 KiB address bits: 8 rows and a weight row or two overflow an 8-way set, and each
   store into a row waits for the loads from the others. So the kernels keep batch rows (a row-major product's
   activations, a column-major product's partial sums) `padded(n)` floats apart: n plus a cache line or two, rows
   one line apart on the sets. */
static long padded(long n) {
    long stride = n + 16;
    return stride % 1024 == 0 ? stride + 16 : stride;
}

static inline void put(const matvec_task *t, long row, long out, float s) {
    if (t->bias) s += t->bias[out];
    float *y = t->y + row * t->outs + out;
    *y = t->accumulate ? *y + s : s;
}

/* Weight rows [r0, r1) times R batch rows: each weight row read from memory once, by the first group of batch rows
   (DOT_GROUP at a time, for W weight rows at a time: 1, or WEIGHT_GROUP); the next groups find them in L1. */
static inline __attribute__((always_inline)) void rows_times_batch(int R, int W, const matvec_task *t, long r0,
                                                                   long r1) {
    float sums[WEIGHT_GROUP * DOT_GROUP];
    long cols = t->cols, r = r0;
    for (; r + W <= r1; r += W)
        for (int i = 0; i < R; i += DOT_GROUP) {
            int n = R - i < DOT_GROUP ? R - i : DOT_GROUP;
            dot_block(W, n, t->w + r * cols, cols, t->x + i * t->x_stride, t->x_stride, cols, i == 0, sums);
            for (int v = 0; v < W; v++)
                for (int b = 0; b < n; b++) put(t, i + b, r + v, sums[v * n + b]);
        }
    for (; r < r1; r++)
        for (int i = 0; i < R; i += DOT_GROUP) {
            int n = R - i < DOT_GROUP ? R - i : DOT_GROUP;
            dot_block(1, n, t->w + r * cols, 0, t->x + i * t->x_stride, t->x_stride, cols, i == 0, sums);
            for (int b = 0; b < n; b++) put(t, i + b, r, sums[b]);
        }
}

/* Pairs of weight rows (WEIGHT_GROUP) from 4 batch rows and rows this wide: 11264 x 2048 streamed, 8 rows took
   ~1.2x less CPU time in pairs; 576- and 768-wide weights ran 1.2-1.3x slower in pairs (2 threads, 4-8 rows), and
   2 rows of either width too. */
#define PAIRS_MIN_COLS 2048

/* A chunk of output rows: one forward stream through the chunk's weight rows, which this CPU's prefetchers follow
   best (4- and 8-row blocks measured slower). A constant row count in each case: see dot_block. */
static void matvec_chunk(void *ctx, long chunk) {
    const matvec_task *t = ctx;
    long r0 = chunk * t->rows_per_chunk, r1 = r0 + t->rows_per_chunk < t->outs ? r0 + t->rows_per_chunk : t->outs;
    switch (t->batch) {
    case 1: /* one row: dot's loop alone, as the one-row decode always ran (pairs of weight rows and software
               prefetching measured slower there) */
        for (long r = r0; r < r1; r++) put(t, 0, r, dot(t->w + r * t->cols, t->x, t->cols));
        break;
#define HK_ROWS_CASE(R) case R: \
        if (R >= 4 && t->cols >= PAIRS_MIN_COLS) rows_times_batch(R, WEIGHT_GROUP, t, r0, r1); \
        else rows_times_batch(R, 1, t, r0, r1); \
        break;
    HK_ROWS_CASE(2) HK_ROWS_CASE(3) HK_ROWS_CASE(4)
    HK_ROWS_CASE(5) HK_ROWS_CASE(6) HK_ROWS_CASE(7) HK_ROWS_CASE(8)
#undef HK_ROWS_CASE
    }
}

_Static_assert(MAX_ROWS == 8, "matvec_chunk and column_piece have a case for each row count up to MAX_ROWS");

static long ceil_div(long a, long b) { return (a + b - 1) / b; }

static float *padded_x;
static size_t padded_x_floats;

/* Returns 0, or -1 when the batch rows' padded copy found no memory (y unchanged). */
static int matvec_by_rows(const float *w, const float *x, const float *bias, float *y, long outs, long cols,
                          long batch, int accumulate) {
    long rows = CHUNK_BYTES / (cols * (long)sizeof(float)), stride = cols;
    if (batch > 1) { /* the rows copied `padded` apart (see padded) */
        stride = padded(cols);
        size_t need = (size_t)(batch * stride);
        if (need > padded_x_floats) {
            float *grown = realloc(padded_x, need * sizeof(float));
            if (!grown) return -1;
            padded_x = grown;
            padded_x_floats = need;
        }
        for (long b = 0; b < batch; b++) memcpy(padded_x + b * stride, x + b * cols, (size_t)cols * sizeof(float));
        x = padded_x;
    }
    matvec_task t = {.w = w, .x = x, .bias = bias, .y = y, .outs = outs, .cols = cols, .batch = batch,
                     .rows_per_chunk = rows > 0 ? rows : 1, .x_stride = stride, .accumulate = accumulate};
    parallel(matvec_chunk, &t, ceil_div(outs, t.rows_per_chunk));
    return 0;
}

/* The same product for a weight stored column-major (element (o, j) at wt[j * outs + o]; the runtime stores tall
   matrices so, because OpenBLAS's prefill products read them faster). The columns are cut into pieces by the
   shape alone (about CHUNK_BYTES of weights each, a multiple of 4 columns); a piece's columns are summed into its own
   partial sums [batch, outs] (in L1/L2), then the partials are added up piece by piece in order: the same sums in
   the same order whoever computes which piece, and with any thread count. */
#define MAX_PIECES 64      /* partial sums kept: pieces x batch x outs floats */
#define SUM_CHUNK 2048     /* outputs per chunk of the final sum */

typedef struct {
    const float *wt, *x, *bias;
    float *y, *partials; /* partials [pieces, batch, outs], rows part_stride (padded(outs)) apart */
    long outs, cols, batch, piece_cols, pieces, part_stride;
    int accumulate;
} column_task;

/* Batch rows per pass over four columns of a piece: their broadcast activations stay in registers (AVX2: 2 x 4 of
   16 registers; AVX512VL: 4 x 4 of 32). More rows take more passes over the four columns (in L2 by then). */
#define COLUMN_GROUP (HK_VNNI ? 4 : 2)
/* A piece's outputs go in blocks whose partial sums (COLUMN_PARTIALS floats over the batch rows) stay in L1 while
   every column of the piece adds into them; the columns' next block is prefetched into L2 meanwhile. */
#ifndef COLUMN_PARTIALS
#define COLUMN_PARTIALS 4096
#endif

/* Columns j .. j + 3 times batch rows b0 .. b0 + R - 1 into their partial sums (each partial loaded and stored once
   for the four columns, in one order whatever R and the group are). */
static inline __attribute__((always_inline)) void columns_times_rows(int R, const column_task *t, long j, long b0,
                                                                     float *part, long o0, long o1) {
    long outs = t->outs, cols = t->cols, o = o0;
    const float *w0 = t->wt + j * outs, *w1 = w0 + outs, *w2 = w1 + outs, *w3 = w2 + outs;
#if HK_AVX2
    long ahead = o1 - o0;
    __m256 xs[COLUMN_GROUP][4];
    for (int i = 0; i < R; i++)
        for (int k = 0; k < 4; k++) xs[i][k] = _mm256_set1_ps(t->x[(b0 + i) * cols + j + k]);
    for (; o + 8 <= o1; o += 8) {
        if (b0 == 0 && (o & 15) == 0) { /* the four columns' next block of outputs, into L2 on the first pass */
            _mm_prefetch((const char *)(w0 + o + ahead), _MM_HINT_T1);
            _mm_prefetch((const char *)(w1 + o + ahead), _MM_HINT_T1);
            _mm_prefetch((const char *)(w2 + o + ahead), _MM_HINT_T1);
            _mm_prefetch((const char *)(w3 + o + ahead), _MM_HINT_T1);
        }
        __m256 a = _mm256_loadu_ps(w0 + o), c = _mm256_loadu_ps(w1 + o);
        __m256 e = _mm256_loadu_ps(w2 + o), g = _mm256_loadu_ps(w3 + o);
        for (int i = 0; i < R; i++) {
            float *p = part + (b0 + i) * t->part_stride + o;
            __m256 acc = _mm256_fmadd_ps(a, xs[i][0], _mm256_loadu_ps(p));
            acc = _mm256_fmadd_ps(c, xs[i][1], acc);
            acc = _mm256_fmadd_ps(e, xs[i][2], acc);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(g, xs[i][3], acc));
        }
    }
#endif
    for (int i = 0; i < R; i++) {
        const float *xb = t->x + (b0 + i) * cols + j;
        float *p = part + (b0 + i) * t->part_stride;
        for (long k = o; k < o1; k++) p[k] += w0[k] * xb[0] + w1[k] * xb[1] + w2[k] * xb[2] + w3[k] * xb[3];
    }
}

/* A piece's columns times R batch rows (a constant in each case of column_piece: see dot_block). */
static inline __attribute__((always_inline)) void column_piece_rows(int R, const column_task *t, long piece) {
    long outs = t->outs, cols = t->cols;
    long j0 = piece * t->piece_cols, j1 = j0 + t->piece_cols < cols ? j0 + t->piece_cols : cols;
    float *part = t->partials + piece * R * t->part_stride;
    memset(part, 0, (size_t)(R * t->part_stride) * sizeof(float));
    long block = COLUMN_PARTIALS / R / 8 * 8;
    for (long o0 = 0; o0 < outs; o0 += block) { /* a block of outputs: its partial sums stay in L1 */
        long o1 = o0 + block < outs ? o0 + block : outs, j = j0;
        for (; j + 4 <= j1; j += 4) /* four columns at a time: each partial is loaded and stored once for four */
            for (int b0 = 0; b0 < R; b0 += COLUMN_GROUP)
                columns_times_rows(R - b0 < COLUMN_GROUP ? R - b0 : COLUMN_GROUP, t, j, b0, part, o0, o1);
        for (; j < j1; j++)
            for (long b = 0; b < R; b++) {
                float xb = t->x[b * cols + j];
                for (long o = o0; o < o1; o++) part[b * t->part_stride + o] += t->wt[j * outs + o] * xb;
            }
    }
}

static void column_piece(void *ctx, long piece) {
    const column_task *t = ctx;
    switch (t->batch) {
#define HK_ROWS_CASE(R) case R: column_piece_rows(R, t, piece); break;
    HK_ROWS_CASE(1) HK_ROWS_CASE(2) HK_ROWS_CASE(3) HK_ROWS_CASE(4)
    HK_ROWS_CASE(5) HK_ROWS_CASE(6) HK_ROWS_CASE(7) HK_ROWS_CASE(8)
#undef HK_ROWS_CASE
    }
}

static void column_sum(void *ctx, long chunk) {
    const column_task *t = ctx;
    long outs = t->outs, o0 = chunk * SUM_CHUNK, o1 = o0 + SUM_CHUNK < outs ? o0 + SUM_CHUNK : outs;
    for (long b = 0; b < t->batch; b++)
        for (long o = o0; o < o1; o++) {
            float s = 0;
            for (long i = 0; i < t->pieces; i++) s += t->partials[(i * t->batch + b) * t->part_stride + o];
            if (t->bias) s += t->bias[o];
            float *y = t->y + b * outs + o;
            *y = t->accumulate ? *y + s : s;
        }
}

static float *partials;
static size_t partial_floats;

/* y [batch, outs] = x [batch, cols] w^T (+ bias), or y += that; w [outs, cols] is row-major, or column-major when
   column_major. Returns 0, or -1 when the partial sums of a column-major product, or the padded rows of a row-major
   one, found no memory (y unchanged). */
static int matvec(const float *w, int column_major, const float *x, const float *bias, float *y, long outs,
                  long cols, long batch, int accumulate) {
    if (!column_major) return matvec_by_rows(w, x, bias, y, outs, cols, batch, accumulate);
    long pieces = outs * cols * (long)sizeof(float) / CHUNK_BYTES;
    pieces = pieces < 1 ? 1 : pieces > MAX_PIECES ? MAX_PIECES : pieces;
    long piece_cols = (ceil_div(cols, pieces) + 3) / 4 * 4;
    pieces = ceil_div(cols, piece_cols);
    long part_stride = padded(outs);
    size_t need = (size_t)pieces * (size_t)(batch * part_stride);
    if (need > partial_floats) {
        float *grown = realloc(partials, need * sizeof(float));
        if (!grown) return -1;
        partials = grown;
        partial_floats = need;
    }
    column_task t = {w, x, bias, y, partials, outs, cols, batch, piece_cols, pieces, part_stride, accumulate};
    parallel(column_piece, &t, pieces);
    parallel(column_sum, &t, ceil_div(outs, SUM_CHUNK));
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
    const void *qkv_w;                  /* [(heads + 2 kv_heads) head_dim, hidden]: q, k, v rows */
    const float *qkv_b;
    const void *o_w;                    /* [hidden, heads head_dim] */
    const float *o_b;
    const void *gate_up_w;              /* [2 intermediate, hidden]: gate rows, then up rows */
    const float *gate_up_b;
    const void *down_w;                 /* [hidden, intermediate] */
    const float *down_b;
    long column_major;                  /* bits: 1 qkv_w, 2 o_w, 4 gate_up_w, 8 down_w stored column-major */
    long formats;                       /* byte i (qkv_w, o_w, gate_up_w, down_w): 0 for fp32, else the weight's
                                           block format (a GGML type id: Q8_0, Q4_0, Q4_1), rows contiguous */
} hk_block;

typedef struct {
    float *k, *v;                       /* caches [batch, kv_heads, max_length, head_dim], head_dim contiguous */
    long batch_stride, head_stride, position_stride; /* in floats */
    long window;                        /* the layer's sliding window (the last `window` keys), 0 for none */
} hk_cache;

typedef struct {
    long position;                      /* the new token's K/V go there (hk_span_decode: the same in every row) */
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

/* Attention, one KV head's query group at a time (grouped-query attention: `heads / kv_heads` query heads share a
   K and a V). Each key and value row is loaded once per layer for the whole group: the loop before this one ran a
   query head at a time, loading every K and V row once per query head (3x for SmolLM2: 9 heads, 3 KV heads), one
   score's horizontal sum and one output's loads and stores per (key, query head). At long contexts a step is mostly
   attention (SmolLM2's 8k-token cache is 368 MB): the built-in model's engine step took 38-40 ms at 8000 cached
   tokens and 9 at 1024 (4.4 at 64), 29 and 5.8-6.8 with these passes (2-core EPYC VM, load ~1-1.5; session 25).
   Three passes, each split into chunks for the pool:
   attention_scores (a KV head's group against a run of keys), attention_softmax (a query head's scores),
   attention_values (a KV head's group, a slice of head_dim, over every key: each output summed by one chunk in key
   order). Every score, sum and output is computed in the order the per-head loop used, so the results are the same
   bits. */
typedef struct {
    const hk_block *b;
    const hk_cache *c;
    const hk_token *tokens;      /* row r's token: tokens[r * token_step] (step 0: one position for every row) */
    long token_step, keys;       /* keys: the scores' row stride, the most keys any row attends to */
    long key_chunks, value_parts; /* scores: chunks of KEY_CHUNK keys per KV head; values: head_dim slices */
    const float *qkv;            /* [batch, (heads + 2 kv_heads) head_dim], q and k rotated */
    float *scores;               /* [batch, heads, keys], row r using its own key count */
    float *context;              /* [batch, heads head_dim] */
} attention_task;

#define KEY_CHUNK 256   /* keys per chunk of the scores pass (64 KiB of K rows at head_dim 64) */
#define VALUE_PART 32   /* head_dim floats per chunk of the values pass (two cache lines of each V row) */

/* The keys a new token at `position` attends to in a layer with cache c: [*first_key, position]. */
static long key_range(const hk_cache *c, long position, long *first_key) {
    long end = position + 1;
    *first_key = c->window > 0 && end > c->window ? end - c->window : 0;
    return end - *first_key;
}

/* Row `row`'s keys (the count, returned) and the offset of KV head g's first one in the caches. */
static long row_keys(const attention_task *t, long row, long g, long *at) {
    const hk_cache *c = t->c;
    long first_key, keys = key_range(c, t->tokens[row * t->token_step].position, &first_key);
    *at = row * c->batch_stride + g * c->head_stride + first_key * c->position_stride;
    return keys;
}

/* Up to DOT_GROUP queries (q, q + d, ...) times one key row into s: dot(q_i, key) with constant counts. */
static inline void dot_queries(long count, const float *key, const float *q, long d, float *s) {
    switch (count) {
    case 1: dot_block(1, 1, key, 0, q, d, d, 0, s); break;
    case 2: dot_block(1, 2, key, 0, q, d, d, 0, s); break;
#if DOT_GROUP > 2
    case 3: dot_block(1, 3, key, 0, q, d, d, 0, s); break;
    default: dot_block(1, 4, key, 0, q, d, d, 0, s); break;
#endif
    }
}

/* Bytes of K and V rows the attention passes read, each pass over a run of keys counting its rows once (for up to
   4 query heads per KV head, the cache's bytes once a step); hk_attention_bytes reads it (reset 1: and zeroes it).
   Tests check that a step reads each cached byte once (the loop before read it once per query head). */
static _Atomic long attention_bytes;

long hk_attention_bytes(int reset) {
    return reset ? atomic_exchange(&attention_bytes, 0) : atomic_load(&attention_bytes);
}

#if HK_AVX2
/* The AVX2 paths of the passes below, for head_dim a multiple of 32 and H query heads at a time (1 to 4, constant
   where inlined: their sums stay in registers). scores_of_heads: what dot() computes for each (key, query), four
   chains of eight lanes 32 floats a step and sum8, with each key row loaded once for the H queries. values_of_heads:
   for each output float, 0 + w0 v0 + w1 v1 + ... in key order, a product then a sum as the plain loop's
   `out[i] += weight * vn[i]` (fp-contract off: -std=c11). Single-thread, the plain loops took ~13 ms (scores) and
   ~12-17 ms (values) for SmolLM2's 30 layers at 8000 keys. */
static inline __attribute__((always_inline)) void scores_of_heads(int H, const float *k, long stride, const float *q,
                                                                  long d, long n0, long n1, float scale, float *p,
                                                                  long p_stride) {
    for (long n = n0; n < n1; n++) {
        const float *kn = k + n * stride;
        __m256 s[4][4];
        for (int h = 0; h < H; h++)
            for (int c = 0; c < 4; c++) s[h][c] = _mm256_setzero_ps();
        for (long j = 0; j < d; j += 32) {
            __m256 kv[4];
            for (int c = 0; c < 4; c++) kv[c] = _mm256_loadu_ps(kn + j + 8 * c);
            for (int h = 0; h < H; h++)
                for (int c = 0; c < 4; c++)
                    s[h][c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d + j + 8 * c), kv[c], s[h][c]);
        }
        for (int h = 0; h < H; h++)
            p[h * p_stride + n] = sum8(_mm256_add_ps(_mm256_add_ps(s[h][0], s[h][2]),
                                                     _mm256_add_ps(s[h][1], s[h][3]))) * scale;
    }
}

static inline __attribute__((always_inline)) void values_of_heads(int H, const float *v, long stride, const float *p,
                                                                  long p_stride, long keys, float *out, long d) {
    __m256 sums[4][VALUE_PART / 8];
    for (int h = 0; h < H; h++)
        for (int c = 0; c < VALUE_PART / 8; c++) sums[h][c] = _mm256_setzero_ps();
    for (long n = 0; n < keys; n++) {
        const float *vn = v + n * stride;
        for (int h = 0; h < H; h++) {
            __m256 weight = _mm256_broadcast_ss(p + h * p_stride + n);
            for (int c = 0; c < VALUE_PART / 8; c++)
                sums[h][c] = _mm256_add_ps(sums[h][c], _mm256_mul_ps(weight, _mm256_loadu_ps(vn + 8 * c)));
        }
    }
    for (int h = 0; h < H; h++)
        for (int c = 0; c < VALUE_PART / 8; c++) _mm256_storeu_ps(out + h * d + 8 * c, sums[h][c]);
}
#endif

/* Scores q k / sqrt(d) of KV head g's query group against keys [chunk KEY_CHUNK, +KEY_CHUNK) of one row. */
static void attention_scores(void *ctx, long index) {
    const attention_task *t = ctx;
    const hk_block *b = t->b;
    long d = b->head_dim, nh = b->heads, nkv = b->kv_heads, group = nh / nkv;
    long row = index / (nkv * t->key_chunks), g = index / t->key_chunks % nkv, chunk = index % t->key_chunks, at;
    long keys = row_keys(t, row, g, &at), n0 = chunk * KEY_CHUNK, n1 = n0 + KEY_CHUNK < keys ? n0 + KEY_CHUNK : keys;
    float scale = (float)(1.0 / sqrt((double)d)), s[DOT_GROUP];
    const float *k = t->c->k + at, *q = t->qkv + row * (nh + 2 * nkv) * d + g * group * d;
    float *p = t->scores + (row * nh + g * group) * t->keys;
    if (n1 <= n0) return; /* a row with fewer keys than the longest */
#if HK_AVX2
    if (d % 32 == 0) {
        for (long h = 0; h < group; h += 4) {
            atomic_fetch_add_explicit(&attention_bytes, (n1 - n0) * d * (long)sizeof(float), memory_order_relaxed);
            const float *qh = q + h * d;
            float *ph = p + h * t->keys;
            switch (group - h) {
            case 1: scores_of_heads(1, k, t->c->position_stride, qh, d, n0, n1, scale, ph, t->keys); break;
            case 2: scores_of_heads(2, k, t->c->position_stride, qh, d, n0, n1, scale, ph, t->keys); break;
            case 3: scores_of_heads(3, k, t->c->position_stride, qh, d, n0, n1, scale, ph, t->keys); break;
            default: scores_of_heads(4, k, t->c->position_stride, qh, d, n0, n1, scale, ph, t->keys); break;
            }
        }
        return;
    }
#endif
    atomic_fetch_add_explicit(&attention_bytes, (n1 - n0) * d * (long)sizeof(float), memory_order_relaxed);
    for (long n = n0; n < n1; n++) {
        const float *kn = k + n * t->c->position_stride;
        for (long h = 0; h < group; h += DOT_GROUP) {
            long count = group - h < DOT_GROUP ? group - h : DOT_GROUP;
            dot_queries(count, kn, q + h * d, d, s);
            for (long i = 0; i < count; i++) p[(h + i) * t->keys + n] = s[i] * scale;
        }
    }
}

/* One (row, query head)'s scores into softmax weights, in place. */
static void attention_softmax(void *ctx, long index) {
    const attention_task *t = ctx;
    long nh = t->b->heads, row = index / nh, first_key;
    long keys = key_range(t->c, t->tokens[row * t->token_step].position, &first_key);
    float *p = t->scores + index * t->keys, top = -INFINITY;
    for (long n = 0; n < keys; n++) top = p[n] > top ? p[n] : top;
    float total = exp_shifted(p, keys, top);
    for (long n = 0; n < keys; n++) p[n] = p[n] / total;
}

/* Head_dim slice [part VALUE_PART, +VALUE_PART) of KV head g's query group's outputs: sum over keys of weight v,
   VALUE_HEADS query heads per pass over the values. Summed in a buffer of the chunk's own: two chunks' slices of
   one output may share a cache line, and storing into it key after key from two threads (the outputs themselves)
   made the pass ~4x slower than the per-head loop. */
#define VALUE_HEADS 16
static void attention_values(void *ctx, long index) {
    const attention_task *t = ctx;
    const hk_block *b = t->b;
    long d = b->head_dim, nh = b->heads, nkv = b->kv_heads, group = nh / nkv;
    long row = index / (nkv * t->value_parts), g = index / t->value_parts % nkv, at;
    long i0 = index % t->value_parts * VALUE_PART, width = d - i0 < VALUE_PART ? d - i0 : VALUE_PART;
    long keys = row_keys(t, row, g, &at);
    const float *v = t->c->v + at + i0;
#if HK_AVX2
    if (width == VALUE_PART) {
        for (long h = 0; h < group; h += 4) {
            atomic_fetch_add_explicit(&attention_bytes, keys * width * (long)sizeof(float), memory_order_relaxed);
            const float *p = t->scores + (row * nh + g * group + h) * t->keys;
            float *out = t->context + (row * nh + g * group + h) * d + i0;
            long stride = t->c->position_stride;
            switch (group - h) {
            case 1: values_of_heads(1, v, stride, p, t->keys, keys, out, d); break;
            case 2: values_of_heads(2, v, stride, p, t->keys, keys, out, d); break;
            case 3: values_of_heads(3, v, stride, p, t->keys, keys, out, d); break;
            default: values_of_heads(4, v, stride, p, t->keys, keys, out, d); break;
            }
        }
        return;
    }
#endif
    float sums[VALUE_HEADS][VALUE_PART];
    for (long h0 = 0; h0 < group; h0 += VALUE_HEADS) {
        long heads = group - h0 < VALUE_HEADS ? group - h0 : VALUE_HEADS;
        atomic_fetch_add_explicit(&attention_bytes, keys * width * (long)sizeof(float), memory_order_relaxed);
        const float *p = t->scores + (row * nh + g * group + h0) * t->keys;
        memset(sums, 0, sizeof sums);
        for (long n = 0; n < keys; n++) {
            const float *vn = v + n * t->c->position_stride;
            for (long h = 0; h < heads; h++) {
                float weight = p[h * t->keys + n];
                if (width == VALUE_PART) /* the common case, a constant count the compiler unrolls */
                    for (long i = 0; i < VALUE_PART; i++) sums[h][i] += weight * vn[i];
                else
                    for (long i = 0; i < width; i++) sums[h][i] += weight * vn[i];
            }
        }
        float *out = t->context + (row * nh + g * group + h0) * d + i0;
        for (long h = 0; h < heads; h++) memcpy(out + h * d, sums[h], (size_t)width * sizeof(float));
    }
}

/* softmax(q k^T / sqrt(d)) v for every row and query head into t->context, over the pool or on the caller. */
static void attention(attention_task *t, long batch, int pooled) {
    long nkv = t->b->kv_heads;
    t->key_chunks = ceil_div(t->keys, KEY_CHUNK);
    t->value_parts = ceil_div(t->b->head_dim, VALUE_PART);
    long chunks[3] = {batch * nkv * t->key_chunks, batch * t->b->heads, batch * nkv * t->value_parts};
    chunk_fn passes[3] = {attention_scores, attention_softmax, attention_values};
    /* a values chunk reads VALUE_PART floats of each of its keys' V rows (at ~1 GB/s of such slices a thread) */
    double seconds[3] = {0, 0, (double)t->keys * VALUE_PART * sizeof(float) / 1e9};
    for (int i = 0; i < 3; i++) {
        if (pooled)
            parallel_long(passes[i], t, chunks[i], seconds[i]);
        else
            for (long index = 0; index < chunks[i]; index++) passes[i](t, index);
    }
}

/* Attention runs over the pool from this many score-times-head_dim products (batch x keys x heads x head_dim) up;
   below, on the caller: a hand-off costs about as much, and on a busy machine each one more is one more chance to
   stall on a worker that lost its core (SmolLM2 Q4_1, 65-112 keys, at load ~19, bench/decode_profile.py
   --attention-pool: from 16k, every step pooled, 14.0 tok/s with 31-39 stalls a run; never, 21.5 with 22-28; this
   machine's quiet figures are not measured). For SmolLM2 64k is 114 keys. hk_set_attention_pool changes it. */
static long attention_pool_min = 1L << 16;

long hk_set_attention_pool(long products) {
    pthread_mutex_lock(&call_lock);
    attention_pool_min = products < 0 ? 0 : products;
    pthread_mutex_unlock(&call_lock);
    return attention_pool_min;
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

static int qmatvec(int format, const void *w, const float *x, const float *bias, float *y, long outs, long cols,
                   long batch, int accumulate);

/* The layer's product with weight `which` (0 qkv, 1 o, 2 gate_up, 3 down), fp32 or block-quantized as its table
   says. Returns 0, or nonzero when memory ran out. */
static int product(const hk_block *b, int which, const void *w, const float *x, const float *bias, float *y,
                   long outs, long cols, long batch, int accumulate) {
    int format = (int)((b->formats >> (8 * which)) & 0xff);
    static const int parts[] = {P_QKV, P_O, P_GATE_UP, P_DOWN};
    PROFILE_PRODUCT(parts[which]);
    (void)parts;
    if (format) return qmatvec(format, w, x, bias, y, outs, cols, batch, accumulate);
    return matvec(w, (int)(b->column_major >> which) & 1, x, bias, y, outs, cols, batch, accumulate);
}

/* x [batch, hidden] <- the layer's output for one new token per row, row r's at t[r * token_step] (its position
   and rotary angles; step 0: every row at t->position); writes their K/V into the caches (call_lock held). */
static int block_decode(const hk_block *b, const hk_cache *c, const hk_token *t, long token_step, float *x,
                        long batch) {
    long d = b->head_dim, nh = b->heads, nkv = b->kv_heads, width = b->hidden, size = b->intermediate;
    long keys = 0, first_key;
    for (long r = 0; r < batch; r++) {
        long row_keys = key_range(c, t[r * token_step].position, &first_key);
        keys = row_keys > keys ? row_keys : keys;
    }
    long qkv_width = (nh + 2 * nkv) * d;
    size_t need = (size_t)(batch * (width + qkv_width + nh * keys + nh * d + 3 * size));
    if (reserve_scratch(need) != 0) return -1;
    float *normed = scratch, *qkv = normed + batch * width, *scores = qkv + batch * qkv_width;
    float *context = scores + batch * nh * keys, *gate_up = context + batch * nh * d, *act = gate_up + batch * 2 * size;

    /* attention: q, k, v from one product; q and k rotated; the new tokens' k and v into the cache */
    for (long r = 0; r < batch; r++) rms_norm(x + r * width, b->norm1, b->eps1, normed + r * width, width);
    PROFILE(P_NORM);
    if (product(b, 0, b->qkv_w, normed, b->qkv_b, qkv, qkv_width, width, batch, 0)) return -1;
    PROFILE(P_QKV);
    for (long r = 0; r < batch; r++) {
        float *row = qkv + r * qkv_width;
        const hk_token *token = t + r * token_step;
        for (long h = 0; h < nh + nkv; h++) rotate(row + h * d, token->cos, token->signed_sin, d);
        for (long g = 0; g < nkv; g++) {
            long at = r * c->batch_stride + g * c->head_stride + token->position * c->position_stride;
            memcpy(c->k + at, row + (nh + g) * d, (size_t)d * sizeof(float));
            memcpy(c->v + at, row + (nh + nkv + g) * d, (size_t)d * sizeof(float));
        }
    }
    PROFILE(P_ROPE);
    attention_task task = {b, c, t, token_step, keys, 0, 0, qkv, scores, context};
    PROFILE_PRODUCT(P_ATTENTION);
    attention(&task, batch, batch * keys * nh * d >= attention_pool_min); /* short ones on the caller */
    PROFILE(P_ATTENTION);
    if (product(b, 1, b->o_w, context, b->o_b, x, width, nh * d, batch, 1)) return -1; /* x += o(context) */
    PROFILE(P_O);

    /* MLP: gate and up from one product */
    for (long r = 0; r < batch; r++) rms_norm(x + r * width, b->norm2, b->eps2, normed + r * width, width);
    PROFILE(P_NORM);
    if (product(b, 2, b->gate_up_w, normed, b->gate_up_b, gate_up, 2 * size, width, batch, 0)) return -1;
    PROFILE(P_GATE_UP);
    for (long r = 0; r < batch; r++)
        silu_times(gate_up + r * 2 * size, gate_up + r * 2 * size + size, act + r * size, size);
    PROFILE(P_SILU);
    if (product(b, 3, b->down_w, act, b->down_b, x, width, size, batch, 1)) return -1; /* x += down(act) */
    PROFILE(P_DOWN);
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
static int span_decode(const hk_block *blocks, const hk_cache *caches, long count, const hk_token *t,
                       long token_step, float *x, long batch) {
    pthread_mutex_lock(&call_lock);
    PROFILE_START();
    int status = 0;
    for (long i = 0; i < count && status == 0; i++)
        if (block_decode(blocks + i, caches + i, t, token_step, x, batch) != 0) status = -1 - (int)i;
    pthread_mutex_unlock(&call_lock);
    return status;
}

int hk_span_decode(const hk_block *blocks, const hk_cache *caches, long count, const hk_token *t, float *x,
                   long batch) {
    return span_decode(blocks, caches, count, t, 0, x, batch);
}

/* hk_span_decode for rows at different positions (a continuous batch's step): row r's token is tokens[r], its
   position and rotary angles; each row attends to its own keys. */
int hk_span_decode_rows(const hk_block *blocks, const hk_cache *caches, long count, const hk_token *tokens, float *x,
                        long batch) {
    return span_decode(blocks, caches, count, tokens, 1, x, batch);
}

/* ---- block-quantized weights ----------------------------------------------------------------------------------
 * GGUF's block formats, byte for byte as llama.cpp writes them (a weight row is cols / 32 blocks in a row, rows one
 * after another), so a GGUF file's tensors are used as they are (hivekeeper.core.runtime.quant.blocks packs them,
 * or quantizes fp32 weights the way llama.cpp's reference code does):
 *   Q8_0: fp16 scale d, 32 int8 q                         weight = d q                          34 bytes
 *   Q4_0: fp16 scale d, 16 bytes of 4-bit q (low nibbles weights 0-15, high nibbles 16-31)  d (q - 8)  18 bytes
 *   Q4_1: fp16 scale d, fp16 min m, 16 bytes of 4-bit q as Q4_0's                 d q + m       20 bytes
 * The activations are quantized per block of 32 to int8 with an fp32 scale (as llama.cpp's Q8_0/Q8_1 activations,
 * kept in fp32), so a block's product is an integer dot product, exact in int32, times the two scales; Q4_1's min
 * adds m times the block's activation sum, d_x sum(q_x). The only error beyond the weights' own is the activations'
 * rounding: at most half their block's scale per element.
 * Several rows (a continuous batch's decode step, up to MAX_ROWS) take one pass over the weights: each weight block
 * is loaded and unpacked once and multiplied with every row's activations (qdot_pair, qdot_quad, qdot_q8_0; plain C:
 * qdot_rows), so a batch of 8 costs far less than 8 products; a row's arithmetic, and so its result, is the same
 * whatever batch it is in. */
enum { HK_Q4_0 = 2, HK_Q4_1 = 3, HK_Q8_0 = 8 }; /* GGML type ids */
#define QK 32
/* Activation rows one quantized product takes (a prefill's prompt tokens in one pass over the weights; a decode step
   still takes up to MAX_ROWS). Each chunk of weight rows stays in L1/L2 while every activation row is multiplied
   with it, so a prefill is integer dot products at the cores' speed, not a stream of weights per token; a row's
   result is the same bits whatever batch it is in, so a prompt's products equal its tokens' decoded one by one.
   hivekeeper.core.runtime.kernels.native_kernels.QUANT_MAX_ROWS must say the same. */
#define QUANT_MAX_ROWS 512
long hk_quant_max_rows(void) { return QUANT_MAX_ROWS; }
/* Batch rows a 4-bit weight block is unpacked once for: as many as keep their accumulators (two chains, two offset
   chains each) in registers (AVX2 has 16 vector registers, AVX512VL 32; with VNNI, groups of 8 measured slower than
   4 on Q4_1: spills); a larger batch goes in groups. Q8_0 has its own (Q8_0_ROW_GROUP). */
#define ROW_GROUP (HK_VNNI ? 4 : HK_AVX2 ? 2 : MAX_ROWS)

typedef struct { uint16_t d; int8_t qs[QK]; } block_q8_0;
typedef struct { uint16_t d; uint8_t qs[QK / 2]; } block_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } block_q4_1;
_Static_assert(sizeof(block_q8_0) == 34 && sizeof(block_q4_0) == 18 && sizeof(block_q4_1) == 20, "GGUF block sizes");

/* Bytes per block of 32 weights of `format`, 0 for a format these kernels do not take. */
long hk_quant_block_bytes(int format) {
    switch (format) {
    case HK_Q8_0: return (long)sizeof(block_q8_0);
    case HK_Q4_0: return (long)sizeof(block_q4_0);
    case HK_Q4_1: return (long)sizeof(block_q4_1);
    default: return 0;
    }
}

static inline float half_to_float(uint16_t h) {
#if HK_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) { /* zero or subnormal: mantissa x 2^-24 */
        float f = ldexpf((float)mantissa, -24);
        return sign ? -f : f;
    }
    if (exponent == 31) bits = sign | 0x7f800000u | (mantissa << 13);
    else bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* Activations [batch, cols] quantized per block of 32: q int8 [batch, cols], and per block and row a pair: the
   scale d_x and the offset unit, what a weight offset of 1 adds (d_x sum(q_x); Q4_0: -8 d_x sum(q_x), its weights
   being d_w (q - 8)), laid [blocks][batch][2] (a block's pairs for the rows side by side).
   Rounding half to even; the AVX2 builds do a block in vectors (it runs on the caller alone, once per product),
   with the same arithmetic as the plain C, so the same bits in every build (the maximum is exact in any order; the
   scale, its inverse and the products are the same fp32 operations; the integers are exact). */
#if HK_AVX2
static inline int quantize_block(const float *xb, float inverse, int8_t *q) {
    __m256 k = _mm256_set1_ps(inverse);
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), k));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), k));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16), k));
    __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 24), k));
    __m256i sums = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d)); /* lanes interleaved */
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

static inline float block_amax(const float *xb) {
    __m256 signless = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb), signless),
                             _mm256_and_ps(_mm256_loadu_ps(xb + 8), signless));
    m = _mm256_max_ps(m, _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + 16), signless),
                                       _mm256_and_ps(_mm256_loadu_ps(xb + 24), signless)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
#else
static inline int quantize_block(const float *xb, float inverse, int8_t *q) {
    int total = 0;
    for (int j = 0; j < QK; j++) {
        int v = (int)nearbyintf(xb[j] * inverse);
        q[j] = (int8_t)v;
        total += v;
    }
    return total;
}

static inline float block_amax(const float *xb) {
    float amax = 0;
    for (int j = 0; j < QK; j++) amax = fabsf(xb[j]) > amax ? fabsf(xb[j]) : amax;
    return amax;
}
#endif

static void quantize_activations(int format, const float *x, long batch, long cols, int8_t *q, float *ds) {
    long blocks = cols / QK;
    float unit = format == HK_Q4_0 ? -8.0f : 1.0f;
    for (long b = 0; b < batch * blocks; b++) {
        float amax = block_amax(x + b * QK);
        float scale = amax / 127.0f, inverse = scale != 0 ? 1.0f / scale : 0.0f;
        int total = quantize_block(x + b * QK, inverse, q + b * QK);
        long at = 2 * ((b % blocks) * batch + b / blocks);
        ds[at] = scale;
        ds[at + 1] = unit * (scale * (float)total);
    }
}

typedef struct {
    int format;
    const uint8_t *w;        /* [outs, row_bytes] */
    long row_bytes, blocks;  /* per weight row */
    const int8_t *q;         /* activations [batch, cols] */
    const float *ds;         /* [blocks, batch, 2]: quantize_activations's (d_x, offset unit) */
    const float *bias;
    float *y;                /* [batch, outs]: y = x w^T + bias, or y += that when accumulate */
    long outs, cols, batch, rows_per_chunk; /* rows_per_chunk a multiple of 4: chunks start on whole pairs, quads */
    int accumulate;
} qmatvec_task;

/* y[row, o] = v (+ bias), or y += that when accumulating. */
static inline __attribute__((always_inline)) void put_q(const qmatvec_task *t, long row, long o, float v) {
    float *y = t->y + row * t->outs + o;
    v += t->bias ? t->bias[o] : 0.0f;
    *y = t->accumulate ? *y + v : v;
}

#if HK_AVX2
/* 8 int32 sums of u[i] * s[i] over 32 bytes, lane k summing bytes 4k..4k+3; u unsigned (<= 128), s signed (> -128).
   AVX512-VNNI does it in one instruction (vpdpbusd); AVX2 in two (vpmaddubsw, whose 16-bit pair sums cannot saturate
   at these ranges, then vpmaddwd): the same exact integers, so both builds give the same products bit for bit. */
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if HK_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* The arithmetic, the same in the avx2 and avx512vnni builds and for any batch (so a row's result has the same bits
 * in both builds and in any batch). The 4-bit formats' weight rows go in pairs, one 256-bit vector holding 16 bytes
 * of each row's block (lanes 0-3 the first row, 4-7 the second). For block b, lane k of a row holds the exact int32
 * dot product of weights 4k..4k+3 and 16+4k..16+4k+3 with their activations, times the scales' product d_w d_x,
 * added into one of two chains (even and odd blocks: a chain's multiply-add waits for the previous one); the
 * block's offset (Q4_1: m d_x sum q_x; Q4_0: -8 d_w d_x sum q_x) goes into two chains too. A row's result:
 * ((lane 0 + lane 1) + (lane 2 + lane 3)) of the chains' sum, plus the offset chains' sum. Against one row at a
 * time (the kernel before this one), a pair shares each activation load and the scales' conversion, and a row
 * needs no horizontal sum per block: the 4-bit products take 25-45% less CPU time (bench/quant_matvec.py). */

/* Block b of a pair of 4-bit weight rows, unpacked once for every activation row: the unsigned codes, weights 0-15
   in `lo`, 16-31 in `hi`, and `dm`: the rows' (scale, Q4_1 min) as [d0, m0, d1, m1] (Q4_0: [d0, d0, d1, d1]). */
typedef struct { __m256i lo, hi; __m128 dm; } pair_block;

static inline uint16_t load16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline __attribute__((always_inline)) pair_block unpack_pair(int format, const uint8_t *row0,
                                                                    const uint8_t *row1, long b) {
    pair_block u;
    long size = format == HK_Q4_0 ? (long)sizeof(block_q4_0) : (long)sizeof(block_q4_1);
    long codes = format == HK_Q4_0 ? 2 : 4; /* where the 16 code bytes start in a block */
    const uint8_t *w0 = row0 + b * size, *w1 = row1 + b * size;
    __m256i both = _mm256_loadu2_m128i((const __m128i *)(w1 + codes), (const __m128i *)(w0 + codes));
    __m256i low_nibbles = _mm256_set1_epi8(0x0f);
    u.lo = _mm256_and_si256(both, low_nibbles);
    u.hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), low_nibbles);
    if (format == HK_Q4_1) {
        u.dm = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)(load32(w0) | (uint64_t)load32(w1) << 32)));
    } else {
        __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(load16(w0) | (uint32_t)load16(w1) << 16)));
        u.dm = _mm_unpacklo_ps(d, d);
    }
    return u;
}

/* The pair's block times one activation row's block x (32 int8): per row, 4 lanes of exact int32 sums. */
static inline __attribute__((always_inline)) __m256i pair_dot(int format, const pair_block *u, const int8_t *x) {
    (void)format; /* the VNNI build's dot product is one for both 4-bit formats */
    __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)x));
    __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(x + QK / 2)));
#if HK_VNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u->lo, xlo), u->hi, xhi);
#else
    /* 4-bit codes: two 16-bit pair sums (each <= 2 x 15 x 127) add without saturating */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u->lo, xlo), _mm256_maddubs_epi16(u->hi, xhi)),
                             _mm256_set1_epi16(1));
#endif
}

/* One activation row's block into a pair's chains: `pair` is its (d_x, offset unit) from quantize_activations. */
static inline __attribute__((always_inline)) void pair_block_into(int format, const pair_block *u, const int8_t *x,
                                                                  const float *pair, __m256 *acc, __m128 *offset) {
    __m128 p = _mm_mul_ps(u->dm, _mm_castpd_ps(_mm_loaddup_pd((const double *)pair))); /* [s0, o0, s1, o1] */
    *offset = _mm_add_ps(*offset, p);
    __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(p), _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
    *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(pair_dot(format, u, x)), *acc);
}

/* Q8_0, one weight row at a time (taking a pair's two rows together measured ~20% slower for its 34-byte blocks):
   each activation row keeps 8 lanes (weights 0-15 in lanes 0-3, 16-31 in 4-7: a block's 32 codes as they lie) in
   two chains (even and odd blocks), summed at the end (sum8). |q| times the activations with q's signs: unsigned
   times signed, as the dot product takes them. */
#define Q8_0_ROW_GROUP 4 /* Q8_0's batch rows per pass over a weight row, in both builds (two accumulators each) */
/* Q8_0's rows are read one after another, one forward stream, and still the hardware prefetcher left the product
   waiting on memory: prefetching 4 KB ahead took 1.3-1.4x less CPU time per streamed byte (one thread, matrices
   larger than the L3, 2048- and 8192-wide; 1 KB ahead 1.15x, 8 and 16 KB the same as 4). */
#define Q8_0_PREFETCH_BYTES 4096

/* Block w of a Q8_0 row times block b of activation rows 0 .. R-1 (x: row 0's block; ds: row 0's pair). */
static inline __attribute__((always_inline)) void q8_0_block_into(int R, const block_q8_0 *w, const int8_t *x,
                                                                  long cols, const float *ds, __m256 *acc) {
    __m256i signs = _mm256_loadu_si256((const __m256i *)w->qs), codes = _mm256_sign_epi8(signs, signs);
    float d = half_to_float(w->d);
    for (int i = 0; i < R; i++) {
        __m256i xs = _mm256_loadu_si256((const __m256i *)(x + i * cols));
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(d * ds[2 * i]),
                                 _mm256_cvtepi32_ps(dot_u8_i8(codes, _mm256_sign_epi8(xs, signs))), acc[i]);
    }
}

static inline __attribute__((always_inline)) void qdot_q8_0(int R, const qmatvec_task *t, const uint8_t *row,
                                                            long r0, float *out) {
    __m256 even[Q8_0_ROW_GROUP], odd[Q8_0_ROW_GROUP];
    for (int i = 0; i < R; i++) even[i] = odd[i] = _mm256_setzero_ps();
    const block_q8_0 *w = (const block_q8_0 *)row;
    const int8_t *x = t->q + r0 * t->cols;
    const float *ds = t->ds + 2 * r0;
    long b = 0, blocks = t->blocks, cols = t->cols, step = 2 * t->batch;
    for (; b + 2 <= blocks; b += 2, x += 2 * QK, ds += 2 * step) {
        prefetch_ahead((const char *)(w + b) + Q8_0_PREFETCH_BYTES, 2);
        q8_0_block_into(R, w + b, x, cols, ds, even);
        q8_0_block_into(R, w + b + 1, x + QK, cols, ds + step, odd);
    }
    if (b < blocks) q8_0_block_into(R, w + b, x, cols, ds, even);
    for (int i = 0; i < R; i++) out[i] = sum8(_mm256_add_ps(even[i], odd[i]));
}

/* One Q8_0 row times one activation row: qdot_q8_0's arithmetic for R = 1, in the same order (the same bits), with
   both blocks' dot products taken before their multiply-adds (measured ~5-15% faster on the LM head). */
static inline __attribute__((always_inline)) float qdot_q8_0_one(const qmatvec_task *t, const uint8_t *row, long r) {
    const block_q8_0 *w = (const block_q8_0 *)row;
    const int8_t *q = t->q + r * t->cols;
    const float *d = t->ds + 2 * r;
    long step = 2 * t->batch, b = 0;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    for (; b + 2 <= t->blocks; b += 2) {
        prefetch_ahead((const char *)(w + b) + Q8_0_PREFETCH_BYTES, 2); /* two blocks: 68 bytes */
        __m256i s0 = _mm256_loadu_si256((const __m256i *)w[b].qs);
        __m256i s1 = _mm256_loadu_si256((const __m256i *)w[b + 1].qs);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(q + (b + 1) * QK));
        __m256i p0 = dot_u8_i8(_mm256_sign_epi8(s0, s0), _mm256_sign_epi8(x0, s0));
        __m256i p1 = dot_u8_i8(_mm256_sign_epi8(s1, s1), _mm256_sign_epi8(x1, s1));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b].d) * d[b * step]), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b + 1].d) * d[(b + 1) * step]), _mm256_cvtepi32_ps(p1),
                               acc1);
    }
    if (b < t->blocks) {
        __m256i s0 = _mm256_loadu_si256((const __m256i *)w[b].qs);
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        __m256i p0 = dot_u8_i8(_mm256_sign_epi8(s0, s0), _mm256_sign_epi8(x0, s0));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[b].d) * d[b * step]), _mm256_cvtepi32_ps(p0), acc0);
    }
    return sum8(_mm256_add_ps(acc0, acc1));
}

#if HK_VNNI
/* The avx512vnni build takes Q8_0 rows two at a time for several activation rows (a continuous batch, a prefill's
   prompt): one 512-bit vector holds a block of each row (lanes 0-7 the first, 8-15 the second), each activation
   block is loaded once for both, and |q| times the activations with q's signs comes from a mask (AVX512 has no
   byte sign instruction). Per row it is qdot_q8_0's arithmetic lane for lane (the same exact integers, scales,
   chains and final sums), so the same bits; a 64-row product ran at 24.5 G multiply-adds a second on one core,
   against 16.5 one row at a time (matrices in cache, CPU time). */
/* A block of each of the two rows, unpacked: |q| (lanes 0-7 the first row's), q's signs, the scales. */
typedef struct { __m512i codes; __m512 d; __mmask64 negative; } q8_0_pair_block;

static inline __attribute__((always_inline)) q8_0_pair_block unpack_q8_0_pair(const block_q8_0 *w0,
                                                                              const block_q8_0 *w1) {
    q8_0_pair_block u;
    __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)w0->qs)),
                                      _mm256_loadu_si256((const __m256i *)w1->qs), 1);
    u.codes = _mm512_abs_epi8(both);
    u.negative = _mm512_movepi8_mask(both);
    u.d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(half_to_float(w0->d))),
                                              _mm256_castps_pd(_mm256_set1_ps(half_to_float(w1->d))), 1));
    return u;
}

static inline __attribute__((always_inline)) void q8_0_pair_block_into(int R, const q8_0_pair_block *u,
                                                                       const int8_t *x, long cols, const float *ds,
                                                                       __m512 *acc) {
    for (int i = 0; i < R; i++) {
        __m512i xs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + i * cols)));
        __m512i signed_x = _mm512_mask_sub_epi8(xs, u->negative, _mm512_setzero_si512(), xs);
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u->codes, signed_x);
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(u->d, _mm512_set1_ps(ds[2 * i])), _mm512_cvtepi32_ps(dot), acc[i]);
    }
}

/* Rows row0 and row1 times activation rows r0 .. r0 + R - 1; their blocks unpacked here, or taken from `unpacked`
   (unpack_q8_0_pairs: a prefill's many groups of rows). */
static inline __attribute__((always_inline)) void qdot_q8_0_pair(int R, const qmatvec_task *t, const uint8_t *row0,
                                                                 const uint8_t *row1,
                                                                 const q8_0_pair_block *unpacked, long r0,
                                                                 float *out0, float *out1) {
    __m512 even[Q8_0_ROW_GROUP], odd[Q8_0_ROW_GROUP];
    for (int i = 0; i < R; i++) even[i] = odd[i] = _mm512_setzero_ps();
    const block_q8_0 *w0 = (const block_q8_0 *)row0, *w1 = (const block_q8_0 *)row1;
    const int8_t *x = t->q + r0 * t->cols;
    const float *ds = t->ds + 2 * r0;
    long b = 0, blocks = t->blocks, cols = t->cols, step = 2 * t->batch;
    for (; b + 2 <= blocks; b += 2, x += 2 * QK, ds += 2 * step) {
        q8_0_pair_block u0, u1;
        if (unpacked) {
            u0 = unpacked[b], u1 = unpacked[b + 1];
        } else {
            prefetch_ahead((const char *)(w0 + b) + Q8_0_PREFETCH_BYTES, 2);
            prefetch_ahead((const char *)(w1 + b) + Q8_0_PREFETCH_BYTES, 2);
            u0 = unpack_q8_0_pair(w0 + b, w1 + b), u1 = unpack_q8_0_pair(w0 + b + 1, w1 + b + 1);
        }
        q8_0_pair_block_into(R, &u0, x, cols, ds, even);
        q8_0_pair_block_into(R, &u1, x + QK, cols, ds + step, odd);
    }
    if (b < blocks) {
        q8_0_pair_block last = unpacked ? unpacked[b] : unpack_q8_0_pair(w0 + b, w1 + b);
        q8_0_pair_block_into(R, &last, x, cols, ds, even);
    }
    for (int i = 0; i < R; i++) {
        __m512 sum = _mm512_add_ps(even[i], odd[i]);
        out0[i] = sum8(_mm512_castps512_ps256(sum));
        out1[i] = sum8(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sum), 1)));
    }
}

/* A pair's blocks unpacked once for a prefill's many groups of rows (a thread's own buffer, grown as needed; as the
   4-bit quads' unpack_quads: the same blocks, so the same bits). NULL when no memory was found. */
static _Thread_local q8_0_pair_block *q8_0_scratch;
static _Thread_local long q8_0_scratch_blocks;

static q8_0_pair_block *unpack_q8_0_pairs(const qmatvec_task *t, const uint8_t *row0, const uint8_t *row1) {
    if (t->blocks > q8_0_scratch_blocks) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, (size_t)t->blocks * sizeof(q8_0_pair_block)) != 0) return NULL;
        free(q8_0_scratch);
        q8_0_scratch = grown;
        q8_0_scratch_blocks = t->blocks;
    }
    const block_q8_0 *w0 = (const block_q8_0 *)row0, *w1 = (const block_q8_0 *)row1;
    for (long b = 0; b < t->blocks; b++) q8_0_scratch[b] = unpack_q8_0_pair(w0 + b, w1 + b);
    return q8_0_scratch;
}

static inline __attribute__((always_inline)) void qmatvec_q8_0_pairs(const qmatvec_task *t, long o0, long o1) {
    float s0[Q8_0_ROW_GROUP], s1[Q8_0_ROW_GROUP];
    for (long o = o0; o < o1; o += 2) {
        const uint8_t *row0 = t->w + o * t->row_bytes, *row1 = o + 1 < o1 ? row0 + t->row_bytes : row0;
        const q8_0_pair_block *u = t->batch > Q8_0_ROW_GROUP ? unpack_q8_0_pairs(t, row0, row1) : NULL;
        for (long r0 = 0; r0 < t->batch; r0 += Q8_0_ROW_GROUP) {
            long n = t->batch - r0 < Q8_0_ROW_GROUP ? t->batch - r0 : Q8_0_ROW_GROUP;
            switch (n) { /* a constant R in each: the accumulators stay in registers */
#define HK_ROWS_CASE(R) case R: u ? qdot_q8_0_pair(R, t, row0, row1, u, r0, s0, s1) \
                                  : qdot_q8_0_pair(R, t, row0, row1, NULL, r0, s0, s1); break;
            HK_ROWS_CASE(1) HK_ROWS_CASE(2) HK_ROWS_CASE(3)
#undef HK_ROWS_CASE
            default: u ? qdot_q8_0_pair(4, t, row0, row1, u, r0, s0, s1)
                       : qdot_q8_0_pair(4, t, row0, row1, NULL, r0, s0, s1); break;
            }
            for (long i = 0; i < n; i++) {
                put_q(t, r0 + i, o, s0[i]);
                if (o + 1 < o1) put_q(t, r0 + i, o + 1, s1[i]);
            }
        }
    }
}
#endif

/* Q8_0's rows one at a time, the batch in groups of Q8_0_ROW_GROUP (the avx512vnni build: two at a time for more
   than one activation row). */
static inline __attribute__((always_inline)) void qmatvec_q8_0_rows(const qmatvec_task *t, long o0, long o1) {
    float s[Q8_0_ROW_GROUP];
    if (t->batch == 1) {
        for (long o = o0; o < o1; o++) put_q(t, 0, o, qdot_q8_0_one(t, t->w + o * t->row_bytes, 0));
        return;
    }
#if HK_VNNI
    (void)s;
    qmatvec_q8_0_pairs(t, o0, o1);
    return;
#endif
    for (long o = o0; o < o1; o++) {
        const uint8_t *row = t->w + o * t->row_bytes;
        for (long r0 = 0; r0 < t->batch; r0 += Q8_0_ROW_GROUP) {
            long n = t->batch - r0 < Q8_0_ROW_GROUP ? t->batch - r0 : Q8_0_ROW_GROUP;
            switch (n) { /* a constant R in each: the accumulators stay in registers */
            case 1: qdot_q8_0(1, t, row, r0, s); break;
            case 2: qdot_q8_0(2, t, row, r0, s); break;
            case 3: qdot_q8_0(3, t, row, r0, s); break;
            default: qdot_q8_0(4, t, row, r0, s); break;
            }
            for (long i = 0; i < n; i++) put_q(t, r0 + i, o, s[i]);
        }
    }
}

/* Weight rows row0 and row1 of a 4-bit format (a pair; the same row twice for an odd one out) times activation rows
   r0 .. r0 + R - 1 into out0[i], out1[i]. Each block of the pair is unpacked once for the R rows. Inlined with a
   constant format and R into each caller, so the loops have no tests and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void qdot_pair(int format, int R, const qmatvec_task *t,
                                                            const uint8_t *row0, const uint8_t *row1,
                                                            const pair_block *unpacked, long r0, float *out0,
                                                            float *out1) {
    __m256 acc0[ROW_GROUP], acc1[ROW_GROUP];
    __m128 offset0[ROW_GROUP], offset1[ROW_GROUP];
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm256_setzero_ps(), offset0[i] = offset1[i] = _mm_setzero_ps();
    const int8_t *x = t->q + r0 * t->cols;
    const float *ds = t->ds + 2 * r0;
    long b = 0, cols = t->cols, step = 2 * t->batch;
    const char *next = (const char *)row0 + 4 * t->row_bytes; /* the rows two pairs on, prefetched as we go */
    long size = format == HK_Q4_0 ? (long)sizeof(block_q4_0) : (long)sizeof(block_q4_1);
    for (; b + 2 <= t->blocks; b += 2) {
        pair_block even, odd;
        if (unpacked) {
            even = unpacked[b], odd = unpacked[b + 1];
        } else {
            prefetch_ahead(next + b * 2 * size, 2); /* two blocks of two rows: 72 or 80 bytes */
            even = unpack_pair(format, row0, row1, b), odd = unpack_pair(format, row0, row1, b + 1);
        }
        for (int i = 0; i < R; i++) {
            pair_block_into(format, &even, x + i * cols + b * QK, ds + b * step + 2 * i, &acc0[i], &offset0[i]);
            pair_block_into(format, &odd, x + i * cols + (b + 1) * QK, ds + (b + 1) * step + 2 * i, &acc1[i],
                            &offset1[i]);
        }
    }
    if (b < t->blocks) {
        pair_block last = unpacked ? unpacked[b] : unpack_pair(format, row0, row1, b);
        for (int i = 0; i < R; i++)
            pair_block_into(format, &last, x + i * cols + b * QK, ds + b * step + 2 * i, &acc0[i], &offset0[i]);
    }
    for (int i = 0; i < R; i++) {
        float a[8], o[4];
        _mm256_storeu_ps(a, _mm256_add_ps(acc0[i], acc1[i]));
        _mm_storeu_ps(o, _mm_add_ps(offset0[i], offset1[i]));
        out0[i] = ((a[0] + a[1]) + (a[2] + a[3])) + o[1];
        out1[i] = ((a[4] + a[5]) + (a[6] + a[7])) + o[3];
    }
}
/* A pair's blocks unpacked once for a prefill's many groups of rows (the avx2 build; the thread's own buffer, grown as
   needed): the same blocks, so the same bits. NULL when no memory was found (the groups then unpack as they go). */
static _Thread_local pair_block *pair_scratch;
static _Thread_local long pair_scratch_blocks;

__attribute__((unused)) static pair_block *unpack_pairs(int format, const qmatvec_task *t, const uint8_t *row0,
                                                         const uint8_t *row1) {
    if (t->blocks > pair_scratch_blocks) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, (size_t)t->blocks * sizeof(pair_block)) != 0) return NULL;
        free(pair_scratch);
        pair_scratch = grown;
        pair_scratch_blocks = t->blocks;
    }
    for (long b = 0; b < t->blocks; b++) pair_scratch[b] = unpack_pair(format, row0, row1, b);
    return pair_scratch;
}

#if HK_VNNI
/* The avx512vnni build takes 4-bit weight rows four at a time in 512-bit vectors (lanes 4r..4r+3: row r): per
   lane the pair kernel's arithmetic above (the same integers, scale products, chains and final sums), so the same
   bits, with half the instructions per block for the loads, unpacking and the scales' conversion. */
typedef struct { __m512i lo, hi; __m256 dm; } quad_block;

static inline __attribute__((always_inline)) quad_block unpack_quad(int format, const uint8_t *const *rows, long b) {
    quad_block u;
    long size = format == HK_Q4_0 ? (long)sizeof(block_q4_0) : (long)sizeof(block_q4_1);
    long codes = format == HK_Q4_0 ? 2 : 4;
    const uint8_t *w0 = rows[0] + b * size, *w1 = rows[1] + b * size, *w2 = rows[2] + b * size;
    const uint8_t *w3 = rows[3] + b * size;
    __m512i all = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu2_m128i((const __m128i *)(w1 + codes), (const __m128i *)(w0 + codes))),
        _mm256_loadu2_m128i((const __m128i *)(w3 + codes), (const __m128i *)(w2 + codes)), 1);
    __m512i low_nibbles = _mm512_set1_epi8(0x0f);
    u.lo = _mm512_and_si512(all, low_nibbles);
    u.hi = _mm512_and_si512(_mm512_srli_epi16(all, 4), low_nibbles);
    if (format == HK_Q4_1) {
        u.dm = _mm256_cvtph_ps(_mm_set_epi64x((long long)(load32(w2) | (uint64_t)load32(w3) << 32),
                                              (long long)(load32(w0) | (uint64_t)load32(w1) << 32)));
    } else {
        uint64_t d = load16(w0) | (uint64_t)load16(w1) << 16 | (uint64_t)load16(w2) << 32 | (uint64_t)load16(w3) << 48;
        __m128i words = _mm_cvtsi64_si128((long long)d);
        u.dm = _mm256_cvtph_ps(_mm_unpacklo_epi16(words, words)); /* [d0, d0, d1, d1, ...] */
    }
    return u;
}

static inline __attribute__((always_inline)) void quad_block_into(const quad_block *u, const int8_t *x,
                                                                  const float *pair, __m512 *acc, __m256 *offset) {
    __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x));
    __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x + QK / 2)));
    __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u->lo, xlo), u->hi, xhi);
    __m256 p = _mm256_mul_ps(u->dm, _mm256_castpd_ps(_mm256_broadcast_sd((const double *)pair)));
    *offset = _mm256_add_ps(*offset, p);
    __m512 scale = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6),
                                         _mm512_castps256_ps512(p));
    *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), *acc);
}

/* Four weight rows of a 4-bit format (rows[], repeated for a tail) times activation rows r0 .. r0 + R - 1 into
   out[r][i]; their blocks unpacked here, or taken from `unpacked` (unpack_quads: a prefill's many groups of rows). */
static inline __attribute__((always_inline)) void qdot_quad(int format, int R, const qmatvec_task *t,
                                                            const uint8_t *const *rows, const quad_block *unpacked,
                                                            long r0, float out[4][ROW_GROUP]) {
    __m512 acc0[ROW_GROUP], acc1[ROW_GROUP];
    __m256 offset0[ROW_GROUP], offset1[ROW_GROUP];
    for (int i = 0; i < R; i++)
        acc0[i] = acc1[i] = _mm512_setzero_ps(), offset0[i] = offset1[i] = _mm256_setzero_ps();
    const int8_t *x = t->q + r0 * t->cols;
    const float *ds = t->ds + 2 * r0;
    long b = 0, cols = t->cols, step = 2 * t->batch;
    const char *next = (const char *)rows[0] + 4 * t->row_bytes; /* the next quad's rows, prefetched as we go */
    long size = format == HK_Q4_0 ? (long)sizeof(block_q4_0) : (long)sizeof(block_q4_1);
    for (; b + 2 <= t->blocks; b += 2) {
        quad_block even, odd;
        if (unpacked) {
            even = unpacked[b], odd = unpacked[b + 1];
        } else {
            prefetch_ahead(next + b * 4 * size, 3); /* two blocks of four rows: 144 or 160 bytes */
            even = unpack_quad(format, rows, b), odd = unpack_quad(format, rows, b + 1);
        }
        for (int i = 0; i < R; i++) {
            quad_block_into(&even, x + i * cols + b * QK, ds + b * step + 2 * i, &acc0[i], &offset0[i]);
            quad_block_into(&odd, x + i * cols + (b + 1) * QK, ds + (b + 1) * step + 2 * i, &acc1[i], &offset1[i]);
        }
    }
    if (b < t->blocks) {
        quad_block last = unpacked ? unpacked[b] : unpack_quad(format, rows, b);
        for (int i = 0; i < R; i++)
            quad_block_into(&last, x + i * cols + b * QK, ds + b * step + 2 * i, &acc0[i], &offset0[i]);
    }
    for (int i = 0; i < R; i++) {
        float a[16], o[8];
        _mm512_storeu_ps(a, _mm512_add_ps(acc0[i], acc1[i]));
        _mm256_storeu_ps(o, _mm256_add_ps(offset0[i], offset1[i]));
        for (int r = 0; r < 4; r++)
            out[r][i] = ((a[4 * r] + a[4 * r + 1]) + (a[4 * r + 2] + a[4 * r + 3])) + o[2 * r + 1];
    }
}
#endif
#else
/* A weight block unpacked once for every batch row: its 32 integer weights (Q4_0's codes minus 8), its scale, and
   Q4_1's min (weights d q + m; 0 for the others). */
typedef struct { int8_t q[QK]; float scale, offset; } unpacked_block;

static inline __attribute__((always_inline)) void unpack(int format, const uint8_t *row, long b, unpacked_block *u) {
    if (format == HK_Q8_0) {
        const block_q8_0 *w = (const block_q8_0 *)row + b;
        memcpy(u->q, w->qs, QK);
        u->scale = half_to_float(w->d);
        u->offset = 0;
        return;
    }
    const uint8_t *qs = format == HK_Q4_0 ? ((const block_q4_0 *)row + b)->qs : ((const block_q4_1 *)row + b)->qs;
    int zero = format == HK_Q4_0 ? 8 : 0;
    for (int j = 0; j < QK / 2; j++) {
        u->q[j] = (int8_t)((qs[j] & 15) - zero);
        u->q[j + QK / 2] = (int8_t)((qs[j] >> 4) - zero);
    }
    if (format == HK_Q4_0) {
        u->scale = half_to_float(((const block_q4_0 *)row + b)->d);
        u->offset = 0;
    } else {
        u->scale = half_to_float(((const block_q4_1 *)row + b)->d);
        u->offset = half_to_float(((const block_q4_1 *)row + b)->m);
    }
}

/* One weight row times activation rows r0 .. r0 + R - 1, each block unpacked once (as the AVX2 path; each row's sum
   in one chain, in block order, whatever R is). */
static inline __attribute__((always_inline)) void qdot_rows(int format, int R, const qmatvec_task *t,
                                                            const uint8_t *row, long r0, float *out) {
    float acc[ROW_GROUP], offset[ROW_GROUP];
    for (int i = 0; i < R; i++) acc[i] = offset[i] = 0;
    unpacked_block u;
    for (long b = 0; b < t->blocks; b++) {
        unpack(format, row, b, &u);
        for (int i = 0; i < R; i++) {
            const int8_t *x = t->q + (r0 + i) * t->cols + b * QK;
            int32_t total = 0;
            for (int j = 0; j < QK; j++) total += (int32_t)u.q[j] * x[j];
            const float *pair = t->ds + 2 * (b * t->batch + r0 + i); /* (d_x, offset unit) */
            acc[i] += u.scale * pair[0] * (float)total;
            if (format == HK_Q4_1) offset[i] += u.offset * pair[1];
        }
    }
    for (int i = 0; i < R; i++) out[i] = acc[i] + offset[i];
}
#endif

/* Output rows [o0, o1) for every batch row, the batch in groups of up to ROW_GROUP rows: the weight rows (a few
   hundred bytes each) stay in L1 for every group. AVX2: the 4-bit formats' rows a pair at a time, Q8_0's one. */
#if HK_VNNI
/* A quad's blocks unpacked once for a prefill's many groups of activation rows (a thread's own buffer, grown as
   needed): unpacking per group of ROW_GROUP rows cost as much as the group's dot products. The same blocks, so the
   same bits. Returns NULL when no memory was found (the groups then unpack as they go). */
static _Thread_local quad_block *quad_scratch;
static _Thread_local long quad_scratch_blocks;

static quad_block *unpack_quads(int format, const qmatvec_task *t, const uint8_t *const *rows) {
    if (t->blocks > quad_scratch_blocks) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, (size_t)t->blocks * sizeof(quad_block)) != 0) return NULL;
        free(quad_scratch);
        quad_scratch = grown;
        quad_scratch_blocks = t->blocks;
    }
    for (long b = 0; b < t->blocks; b++) quad_scratch[b] = unpack_quad(format, rows, b);
    return quad_scratch;
}

/* The 4-bit formats' rows four at a time (a tail repeats the last row). */
static inline __attribute__((always_inline)) void qmatvec_quads(int format, const qmatvec_task *t, long o0, long o1) {
    float s[4][ROW_GROUP];
    for (long o = o0; o < o1; o += 4) {
        const uint8_t *rows[4];
        for (int r = 0; r < 4; r++) rows[r] = t->w + (o + r < o1 ? o + r : o1 - 1) * t->row_bytes;
        const quad_block *unpacked = t->batch > ROW_GROUP ? unpack_quads(format, t, rows) : NULL;
        for (long r0 = 0; r0 < t->batch; r0 += ROW_GROUP) {
            long n = t->batch - r0 < ROW_GROUP ? t->batch - r0 : ROW_GROUP;
            switch (n) { /* a constant R in each: the accumulators stay in registers */
#define HK_ROWS_CASE(R) case R: unpacked ? qdot_quad(format, R, t, rows, unpacked, r0, s) \
                                         : qdot_quad(format, R, t, rows, NULL, r0, s); break;
            HK_ROWS_CASE(1) HK_ROWS_CASE(2) HK_ROWS_CASE(3) HK_ROWS_CASE(4)
#undef HK_ROWS_CASE
            }
            for (long i = 0; i < n; i++)
                for (int r = 0; r < 4 && o + r < o1; r++) put_q(t, r0 + i, o + r, s[r][i]);
        }
    }
}
#endif

#if HK_AVX2
static inline __attribute__((always_inline)) void qmatvec_rows(int format, const qmatvec_task *t, long o0, long o1) {
    if (format == HK_Q8_0) {
        qmatvec_q8_0_rows(t, o0, o1);
        return;
    }
#if HK_VNNI
    qmatvec_quads(format, t, o0, o1);
#else
    float s0[ROW_GROUP], s1[ROW_GROUP];
    for (long o = o0; o < o1; o += 2) {
        const uint8_t *row0 = t->w + o * t->row_bytes, *row1 = o + 1 < o1 ? row0 + t->row_bytes : row0;
        const pair_block *u = t->batch > ROW_GROUP ? unpack_pairs(format, t, row0, row1) : NULL;
        for (long r0 = 0; r0 < t->batch; r0 += ROW_GROUP) {
            long rows = t->batch - r0 < ROW_GROUP ? t->batch - r0 : ROW_GROUP;
            if (rows == 1) /* a constant R: registers */
                u ? qdot_pair(format, 1, t, row0, row1, u, r0, s0, s1)
                  : qdot_pair(format, 1, t, row0, row1, NULL, r0, s0, s1);
            else
                u ? qdot_pair(format, 2, t, row0, row1, u, r0, s0, s1)
                  : qdot_pair(format, 2, t, row0, row1, NULL, r0, s0, s1);
            for (long i = 0; i < rows; i++) {
                put_q(t, r0 + i, o, s0[i]);
                if (o + 1 < o1) put_q(t, r0 + i, o + 1, s1[i]);
            }
        }
    }
#endif
}
#else
static inline __attribute__((always_inline)) void qmatvec_rows(int format, const qmatvec_task *t, long o0, long o1) {
    float s[ROW_GROUP];
    for (long o = o0; o < o1; o++) {
        const uint8_t *row = t->w + o * t->row_bytes;
        for (long r0 = 0; r0 < t->batch; r0 += ROW_GROUP) {
            long rows = t->batch - r0 < ROW_GROUP ? t->batch - r0 : ROW_GROUP;
            qdot_rows(format, (int)rows, t, row, r0, s); /* plain C: one copy (a copy per R only costs build time) */
            for (long i = 0; i < rows; i++) put_q(t, r0 + i, o, s[i]);
        }
    }
}
#endif

#if HK_AVX2
/* A worker's unpacked blocks go with it (the pool restarts when its thread count changes). */
static void free_thread_scratch(void) {
    free(pair_scratch);
    pair_scratch = NULL, pair_scratch_blocks = 0;
#if HK_VNNI
    free(quad_scratch);
    free(q8_0_scratch);
    quad_scratch = NULL, q8_0_scratch = NULL;
    quad_scratch_blocks = q8_0_scratch_blocks = 0;
#endif
}
#else
static void free_thread_scratch(void) {} /* the portable build unpacks into no buffers */
#endif

/* A chunk of output rows. */
static void qmatvec_chunk(void *ctx, long chunk) {
    const qmatvec_task *t = ctx;
    long r0 = chunk * t->rows_per_chunk, r1 = r0 + t->rows_per_chunk < t->outs ? r0 + t->rows_per_chunk : t->outs;
    switch (t->format) {
    case HK_Q8_0: qmatvec_rows(HK_Q8_0, t, r0, r1); break;
    case HK_Q4_0: qmatvec_rows(HK_Q4_0, t, r0, r1); break;
    default: qmatvec_rows(HK_Q4_1, t, r0, r1); break;
    }
}

static int8_t *quantized_x;
static float *x_scales;
static size_t quantized_x_size;

static int reserve_quantized_x(long count) {
    if ((size_t)count <= quantized_x_size) return 0;
    int8_t *q = realloc(quantized_x, (size_t)count);
    if (!q) return -1;
    quantized_x = q;
    float *scales = realloc(x_scales, 2 * (size_t)(count / QK) * sizeof(float));
    if (!scales) return -1;
    x_scales = scales;
    quantized_x_size = (size_t)count;
    return 0;
}

/* y [batch, outs] = x [batch, cols] w^T (+ bias), or y += that when accumulate; w [outs, cols] in block `format`
   (a GGML type id: Q8_0, Q4_0 or Q4_1), rows contiguous; batch <= QUANT_MAX_ROWS; call_lock held. Returns 0; -1 when
   memory ran out; -2 for a format these kernels do not take, cols not a multiple of 32, or batch out of range (y
   unchanged). */
static int qmatvec(int format, const void *w, const float *x, const float *bias, float *y, long outs, long cols,
                   long batch, int accumulate) {
    long block_bytes = hk_quant_block_bytes(format);
    if (block_bytes == 0 || cols <= 0 || cols % QK != 0 || batch < 1 || batch > QUANT_MAX_ROWS || outs < 0) return -2;
    if (reserve_quantized_x(batch * cols) != 0) return -1;
    long blocks = cols / QK, row_bytes = blocks * block_bytes, rows = CHUNK_BYTES / row_bytes / 4 * 4;
    quantize_activations(format, x, batch, cols, quantized_x, x_scales);
    PROFILE(P_QUANTIZE);
    qmatvec_task t = {format, w, row_bytes, blocks, quantized_x, x_scales, bias, y, outs, cols, batch,
                      rows > 0 ? rows : 4, accumulate};
    parallel(qmatvec_chunk, &t, ceil_div(outs, t.rows_per_chunk));
    return 0;
}

/* hk_qgemv: qmatvec's y = x w^T (+ bias) under the call lock; the same results. */
int hk_qgemv(int format, const void *w, const float *x, const float *bias, float *y, long outs, long cols,
             long batch) {
    pthread_mutex_lock(&call_lock);
    PROFILE_START();
    PROFILE_PRODUCT(P_HEAD);
    int status = qmatvec(format, w, x, bias, y, outs, cols, batch, 0);
    PROFILE(P_HEAD);
    pthread_mutex_unlock(&call_lock);
    return status;
}

/* ---- Dequantizing (prefill) ----------------------------------------------------------------------------------
 * Prefill multiplies many rows at once, so it is compute-bound: BLAS's fp32 GEMM is the fastest product there. The
 * weights are dequantized a tile of rows at a time (a tile stays in cache while GEMM reads it), here in C: each
 * weight exactly as gguf's reference computes it in fp32 (d q, d (q - 8), d q + m: one rounding each, no fused
 * multiply-add), so the tile equals blocks.dequantize bit for bit. */
typedef struct {
    int format;
    const uint8_t *w;
    float *y;
    long row_bytes, blocks, rows, rows_per_chunk;
} dequantize_task;

static void dequantize_row(int format, const uint8_t *row, long blocks, float *out) {
    for (long b = 0; b < blocks; b++, out += QK) {
        if (format == HK_Q8_0) {
            const block_q8_0 *w = (const block_q8_0 *)row + b;
            float d = half_to_float(w->d);
            for (int j = 0; j < QK; j++) out[j] = d * (float)w->qs[j];
        } else if (format == HK_Q4_0) {
            const block_q4_0 *w = (const block_q4_0 *)row + b;
            float d = half_to_float(w->d);
            for (int j = 0; j < QK / 2; j++) {
                out[j] = d * (float)((w->qs[j] & 15) - 8);
                out[j + QK / 2] = d * (float)((w->qs[j] >> 4) - 8);
            }
        } else {
            const block_q4_1 *w = (const block_q4_1 *)row + b;
            float d = half_to_float(w->d), m = half_to_float(w->m);
            for (int j = 0; j < QK / 2; j++) {
                float low = d * (float)(w->qs[j] & 15), high = d * (float)(w->qs[j] >> 4);
                out[j] = low + m;
                out[j + QK / 2] = high + m;
            }
        }
    }
}

static void dequantize_chunk(void *ctx, long chunk) {
    const dequantize_task *t = ctx;
    long r0 = chunk * t->rows_per_chunk, r1 = r0 + t->rows_per_chunk < t->rows ? r0 + t->rows_per_chunk : t->rows;
    for (long r = r0; r < r1; r++)
        dequantize_row(t->format, t->w + r * t->row_bytes, t->blocks, t->y + r * t->blocks * QK);
}

/* y [rows, cols] fp32 = the weights that `rows` packed rows of `format` stand for (thread-safe: no pool, no
   shared scratch). Returns 0, or -2 for a format
   these kernels do not take or cols not a multiple of 32 (y unchanged). */
int hk_dequantize(int format, const void *w, float *y, long rows, long cols) {
    long block_bytes = hk_quant_block_bytes(format);
    if (block_bytes == 0 || cols <= 0 || cols % QK != 0 || rows < 0) return -2;
    long blocks = cols / QK, row_bytes = blocks * block_bytes, per_chunk = CHUNK_BYTES / row_bytes;
    dequantize_task t = {format, w, y, row_bytes, blocks, rows, per_chunk > 0 ? per_chunk : 1};
    /* on the calling thread alone: BLAS multiplies the tile next, on every core, and its threads would otherwise
       contend with the pool's for the cores (a tile is ~1/rows of the product's work) */
    for (long c = 0; c < ceil_div(rows, t.rows_per_chunk); c++) dequantize_chunk(&t, c);
    return 0;
}

/* Which build this is: "avx512vnni", "avx2" or "portable". */
const char *hk_variant(void) { return HK_VNNI ? "avx512vnni" : HK_AVX2 ? "avx2" : "portable"; }
