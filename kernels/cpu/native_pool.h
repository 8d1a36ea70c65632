/* The worker threads of the native kernels that split a pass over threads (each
 * kernel's .c includes this; native.py puts it in the source, so each library has a
 * pool of its own, and then points every library at the first one's with
 * native_pool_use: one pool, whose workers every kernel and OpenBLAS share).
 *
 * pool_run(fn, jobs, size, threads) calls fn on each of `threads` jobs, an array of
 * structs of `size` bytes: this thread runs job 0, workers kept between calls run
 * the others (starting threads per call cost about as much as a small pass). A
 * worker waits for the next generation of jobs, runs its job if it has one, and
 * reports. A wait (a worker's for jobs, the caller's for the workers) first watches
 * for up to MINIGRAPH_SPIN_US microseconds (POOL_SPIN_US by default), yielding the
 * core between looks, then sleeps on a condition variable: a wake-up from that sleep
 * costs 15-30 us, more than a small pass, and passes follow each other within tens
 * of microseconds in a step, or a few hundred where a one-thread op runs between
 * (threads per op, a small conv), while an idle pool takes no core from anyone. A look
 * that comes back from its yield POOL_YIELD_TAKEN_US or more later found the core
 * wanted by another thread, and that watch ends. Where that happens POOL_CONTENDED_YIELDS
 * times within POOL_CONTENDED_WITHIN_MS, another process wants the cores for long (a busy
 * loop's yields take its whole turn, milliseconds; the machine's own chores, a few
 * times a second): a watching thread would hold its core until the scheduler takes it
 * away, and a job handed to it meanwhile would wait for its next turn there (the digits
 * net's training step took 16 ms instead of 1 beside one busy loop on 2 cores), while a
 * sleeping one is woken ahead of the busy thread. So for the next POOL_CONTENDED_MS no
 * wait watches: each sleeps at once (and a training step runs on one thread,
 * minigraph/op_threads.py); then the watches look again. One call
 * uses the pool at a time; a call that finds it busy (another thread's pass) starts
 * threads of its own, and a job no thread could be started for runs on the caller.
 * A forked child starts with an empty pool. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#define POOL_MAX_THREADS 64
#define POOL_SPIN_US 1000       /* how long a wait spins before it sleeps, by default */
#define POOL_YIELD_TAKEN_US 1000   /* a yield this long ran another thread on the core */
#define POOL_CONTENDED_YIELDS 6    /* so many such yields within POOL_CONTENDED_WITHIN_MS: */
#define POOL_CONTENDED_WITHIN_MS 100
#define POOL_CONTENDED_MS 200      /* the cores then count as contended this long */

typedef void *(*pool_fn)(void *);

/* How many jobs `threads` threads make of `items` items: at least 1, at most the
 * items and POOL_MAX_THREADS. */
static inline int64_t pool_parts(int64_t threads, int64_t items)
{
    int64_t parts = threads < 1 ? 1 : threads > POOL_MAX_THREADS ? POOL_MAX_THREADS : threads;
    return parts > items ? (items > 0 ? items : 1) : parts;
}

/* Job t's items [*begin, *end) of `items` split in `parts` contiguous ranges. */
static inline void pool_share(int64_t items, int64_t parts, int64_t t, int64_t *begin,
                              int64_t *end)
{
    int64_t chunk = (items + parts - 1) / parts;
    *begin = t * chunk < items ? t * chunk : items;
    *end = (t + 1) * chunk < items ? (t + 1) * chunk : items;
}

typedef struct {
    pthread_mutex_t busy, lock;
    pthread_cond_t wake, done;
    int64_t size, count, pending;          /* workers; jobs this generation; unfinished */
    int64_t generation, seen[POOL_MAX_THREADS];    /* the last generation each worker saw */
    pool_fn fn;
    char *jobs;
    size_t job_size;
    int fork_handler;
    int64_t spin_ns;                       /* how long a wait watches; -1: not read yet */
    int64_t contended_until, contentions;  /* no watch before this time (ns); times seen */
    int64_t taken_since, taken;            /* long yields since this time (ns): how many */
} pool_t;

static pool_t pool_own = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER,
                          PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0,
                          {0}, NULL, NULL, 0, 0, -1, 0, 0, 0, 0};
static pool_t *pool_at = &pool_own;
#define pool (*pool_at)

/* The pool this library runs its passes on (native.py gives the first library's to
 * the others: native_pool_use, before any of their passes). */
void *native_pool_get(void) { return pool_at; }
void native_pool_use(void *other) { pool_at = other; }

/* Sets how long the pool's waits watch before they sleep (microseconds; < 0: read
 * MINIGRAPH_SPIN_US again at the next wait), and forgets a contention. */
void native_pool_spin(int64_t us)
{
    __atomic_store_n(&pool.spin_ns, us < 0 ? -1 : us * 1000, __ATOMIC_RELAXED);
    __atomic_store_n(&pool.contended_until, 0, __ATOMIC_RELAXED);
}

static void pool_after_fork(void)
{
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t empty = PTHREAD_COND_INITIALIZER;
    pool.busy = pool.lock = fresh;
    pool.wake = pool.done = empty;
    pool.size = pool.count = pool.pending = 0;
}

static inline int64_t pool_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* How many times the watches found the cores contended (for the tests). */
int64_t native_pool_contentions(void)
{
    return __atomic_load_n(&pool.contentions, __ATOMIC_RELAXED);
}

/* 1 while the cores count as contended (see the top of this file), else 0. */
int64_t native_pool_contended(void)
{
    return pool_now_ns() < __atomic_load_n(&pool.contended_until, __ATOMIC_RELAXED);
}

/* A yield that ended at `now` gave the core away (see the top of this file). The
 * counts are shared by the threads without a lock: a lost count only delays the call. */
static void pool_yield_taken(int64_t now)
{
    if (now - __atomic_load_n(&pool.taken_since, __ATOMIC_RELAXED) >
        POOL_CONTENDED_WITHIN_MS * 1000000) {
        __atomic_store_n(&pool.taken_since, now, __ATOMIC_RELAXED);
        __atomic_store_n(&pool.taken, 1, __ATOMIC_RELAXED);
        return;
    }
    if (__atomic_add_fetch(&pool.taken, 1, __ATOMIC_RELAXED) >= POOL_CONTENDED_YIELDS) {
        __atomic_store_n(&pool.contended_until, now + POOL_CONTENDED_MS * 1000000,
                         __ATOMIC_RELAXED);
        __atomic_store_n(&pool.taken_since, now, __ATOMIC_RELAXED);
        __atomic_store_n(&pool.taken, 0, __ATOMIC_RELAXED);
        __atomic_fetch_add(&pool.contentions, 1, __ATOMIC_RELAXED);
    }
}

/* Watch *at (without the lock) for up to the spin time while it equals `value`
 * (equal) or while it does not (!equal), yielding the core between looks; not at all
 * while the cores are contended (see the top of this file), and a yield that shows
 * they are ends the watch. The caller then takes the lock and checks again: the watch
 * only saves a sleep, never decides. */
static inline void pool_watch(const int64_t *at, int64_t value, int equal)
{
    int64_t spin = __atomic_load_n(&pool.spin_ns, __ATOMIC_RELAXED);
    if (spin < 0) {                                      /* the first wait reads it */
        const char *set = getenv("MINIGRAPH_SPIN_US");
        spin = (set != NULL && *set != 0 ? atoll(set) : POOL_SPIN_US) * 1000;
        __atomic_store_n(&pool.spin_ns, spin > 0 ? spin : 0, __ATOMIC_RELAXED);
    }
    if (spin <= 0) return;
    int64_t now = pool_now_ns();
    if (now < __atomic_load_n(&pool.contended_until, __ATOMIC_RELAXED)) return;
    const int64_t end = now + spin;
    for (;;) {
        for (int i = 0; i < 64; i++)
            if ((__atomic_load_n(at, __ATOMIC_ACQUIRE) == value) != equal) return;
        const int64_t before = pool_now_ns();
        if (before >= end) return;
        sched_yield();
        now = pool_now_ns();
        if (now - before >= POOL_YIELD_TAKEN_US * 1000) {      /* another thread ran here */
            pool_yield_taken(now);
            return;
        }
    }
}

static void *pool_worker(void *arg)
{
    int64_t index = (int64_t)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        if (pool.generation == pool.seen[index]) {
            const int64_t seen = pool.seen[index];
            pthread_mutex_unlock(&pool.lock);
            pool_watch(&pool.generation, seen, 1);
            pthread_mutex_lock(&pool.lock);
        }
        while (pool.generation == pool.seen[index]) pthread_cond_wait(&pool.wake, &pool.lock);
        pool.seen[index] = pool.generation;
        if (index >= pool.count) continue;
        pool_fn fn = pool.fn;
        void *job = pool.jobs + (size_t)index * pool.job_size;
        pthread_mutex_unlock(&pool.lock);
        fn(job);
        pthread_mutex_lock(&pool.lock);
        if (__atomic_sub_fetch(&pool.pending, 1, __ATOMIC_ACQ_REL) == 0)
            pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static void pool_run_on_new_threads(pool_fn fn, char *jobs, size_t size, int64_t threads)
{
    pthread_t tid[POOL_MAX_THREADS];
    int64_t started = 1;
    for (; started < threads; started++)
        if (pthread_create(&tid[started], NULL, fn, jobs + (size_t)started * size)) break;
    for (int64_t t = started; t < threads; t++) fn(jobs + (size_t)t * size);  /* run here */
    fn(jobs);
    for (int64_t t = 1; t < started; t++) pthread_join(tid[t], NULL);
}

/* Workers 1 .. threads - 1 started (pool.lock held); how many the pool has. */
static int64_t pool_grow(int64_t threads)
{
    if (!pool.fork_handler) pool.fork_handler = !pthread_atfork(NULL, NULL, pool_after_fork);
    while (pool.size < threads - 1 && pool.fork_handler) {      /* workers 1, 2, ... */
        pthread_t tid;
        pool.seen[pool.size + 1] = pool.generation;      /* its first jobs: the next ones */
        if (pthread_create(&tid, NULL, pool_worker, (void *)(intptr_t)(pool.size + 1))) break;
        pthread_detach(tid);
        pool.size++;
    }
    return pool.size;
}

/* Jobs 1 .. pooled - 1 handed to the workers, job 0 run here, then the wait for them
 * (pool.busy held, pool.lock held on entry and released). */
static void pool_hand_out(pool_fn fn, char *jobs, size_t size, int64_t pooled,
                          int64_t threads)
{
    pool.fn = fn;
    pool.jobs = jobs;
    pool.job_size = size;
    pool.count = pooled;
    pool.pending = pooled - 1;
    __atomic_store_n(&pool.generation, pool.generation + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int64_t t = pooled; t < threads; t++) fn(jobs + (size_t)t * size);  /* no worker */
    fn(jobs);
    pool_watch(&pool.pending, 0, 0);
    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
}

/* Like pool_run, for jobs that wait for each other (all must run at once): waits for
 * the pool when another call has it, and returns -1 without running a job when the
 * pool cannot have threads - 1 workers; else 0 once every job has run. */
static int pool_run_together(pool_fn fn, void *jobs_, size_t size, int64_t threads)
{
    char *jobs = jobs_;
    if (threads > POOL_MAX_THREADS) return -1;
    if (threads <= 1) {
        fn(jobs);
        return 0;
    }
    pthread_mutex_lock(&pool.busy);
    pthread_mutex_lock(&pool.lock);
    if (pool_grow(threads) < threads - 1) {
        pthread_mutex_unlock(&pool.lock);
        pthread_mutex_unlock(&pool.busy);
        return -1;
    }
    pool_hand_out(fn, jobs, size, threads, threads);
    pthread_mutex_unlock(&pool.busy);
    return 0;
}

static void pool_run(pool_fn fn, void *jobs_, size_t size, int64_t threads)
{
    char *jobs = jobs_;
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    if (threads <= 1) {
        fn(jobs);
        return;
    }
    if (pthread_mutex_trylock(&pool.busy)) {
        pool_run_on_new_threads(fn, jobs, size, threads);
        return;
    }
    pthread_mutex_lock(&pool.lock);
    int64_t workers = pool_grow(threads);
    pool_hand_out(fn, jobs, size, threads - 1 < workers ? threads : workers + 1, threads);
    pthread_mutex_unlock(&pool.busy);
}
