/* OpenBLAS's parallel work on minigraph's own threads (blas_threads.py installs
 * blas_pool_callback with OpenBLAS's openblas_set_threads_callback_function).
 *
 * OpenBLAS's own worker threads busy-wait for the next product for about 0.1 s
 * after each one (its THREAD_TIMEOUT, 2^28 cycles by default); a native kernel that
 * starts its threads meanwhile finds a core taken by a thread that only spins. With
 * this callback, OpenBLAS hands the jobs of a parallel call to this library's pool
 * instead (native_pool.h: the one every native library shares), whose workers watch
 * for the next job for at most MINIGRAPH_SPIN_US and then sleep, and its own workers
 * are never woken. The jobs of one call wait for each other
 * (a threaded GEMM's threads share packed panels), so they run all at once
 * (pool_run_together): a second call waits for the first to finish. */
#include <stdio.h>
#include <stdlib.h>

#include "native_pool.h"

typedef void (*blas_dojob_t)(int thread, void *job, int data);

typedef struct {
    blas_dojob_t dojob;
    char *job;
    int thread, data;
} blas_job_t;

static int64_t calls;          /* parallel calls run here, for the tests */

static void *blas_job(void *arg)
{
    blas_job_t *j = arg;
    j->dojob(j->thread, j->job, j->data);
    return NULL;
}

/* OpenBLAS's openblas_threads_callback: run dojob(i, jobdata + i * size, data) for
 * each of the `jobs` jobs at once, and return when all have run (sync is always 1
 * in OpenBLAS's calls). */
void blas_pool_callback(int sync, blas_dojob_t dojob, int jobs, size_t size, void *jobdata,
                        int data)
{
    (void)sync;
    blas_job_t each[POOL_MAX_THREADS];
    if (jobs <= 0) return;
    if (jobs > POOL_MAX_THREADS) {
        fprintf(stderr, "minigraph blas_pool: OpenBLAS asked for %d threads, at most %d "
                "are supported\n", jobs, POOL_MAX_THREADS);
        abort();
    }
    for (int i = 0; i < jobs; i++)
        each[i] = (blas_job_t){dojob, (char *)jobdata + (size_t)i * size, i, data};
    __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED);
    if (pool_run_together(blas_job, each, sizeof(blas_job_t), jobs)) {
        /* the jobs of a call wait for each other: run one at a time, they would hang */
        fprintf(stderr, "minigraph blas_pool: could not start %d threads for OpenBLAS\n",
                jobs);
        abort();
    }
}

/* The callback's address, for OpenBLAS's setter. */
void *blas_pool_callback_address(void)
{
    return (void *)blas_pool_callback;
}

/* Parallel calls run through the callback so far. */
int64_t blas_pool_calls(void)
{
    return __atomic_load_n(&calls, __ATOMIC_RELAXED);
}

/* Starts the pool's workers for `threads` threads now (so that a product never finds
 * them missing); 0, or -1 where they could not all be started. */
int blas_pool_reserve(int64_t threads)
{
    if (threads > POOL_MAX_THREADS) return -1;
    pthread_mutex_lock(&pool.busy);
    pthread_mutex_lock(&pool.lock);
    int ok = threads <= 1 || pool_grow(threads) >= threads - 1;
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.busy);
    return ok ? 0 : -1;
}
