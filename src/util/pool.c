/* util/pool: persistent worker threads; workers spin briefly on a job counter
 * (decode issues thousands of small jobs a second) and then sleep on a condvar. */
#include "util/pool.h"
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct util_pool {
    int n;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint gen;       /* bumped once per job */
    atomic_int pending;    /* workers still running the current job */
    atomic_int sleepers;   /* workers asleep on cv (or about to be) */
    atomic_int stop;
    util_pool_fn fn;
    void *ctx;
};

typedef struct { util_pool *pool; int ith; } worker_arg;

static void *worker_main(void *p) {
    worker_arg *wa = p;
    util_pool *pool = wa->pool;
    int ith = wa->ith;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool->gen, memory_order_acquire)) == seen &&
               !atomic_load(&pool->stop)) {
            if (++spins < 4000) {
#if defined(__x86_64__)
                __builtin_ia32_pause();
#endif
                continue;
            }
            /* announced before the last look at gen (both seq_cst, as in
             * util_pool_run): either the runner sees a sleeper and
             * broadcasts, or this look sees the new job */
            pthread_mutex_lock(&pool->mu);
            atomic_fetch_add(&pool->sleepers, 1);
            while (atomic_load(&pool->gen) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->cv, &pool->mu);
            atomic_fetch_sub(&pool->sleepers, 1);
            pthread_mutex_unlock(&pool->mu);
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = g;
        pool->fn(pool->ctx, ith, pool->n);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel);
    }
}

int util_n_cores(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

util_pool *util_pool_create(int n_threads) {
    if (n_threads <= 0) n_threads = util_n_cores();
    util_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n = n_threads;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv, NULL);
    pool->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!pool->threads) { free(pool); return NULL; }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) { pool->n = i; util_pool_free(pool); return NULL; }
        wa->pool = pool;
        wa->ith = i;
        if (pthread_create(&pool->threads[i], NULL, worker_main, wa) != 0) {
            free(wa);
            pool->n = i;
            util_pool_free(pool);
            return NULL;
        }
    }
    return pool;
}

void util_pool_free(util_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    atomic_store(&pool->stop, 1);
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 1; i < pool->n; i++) pthread_join(pool->threads[i], NULL);
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv);
    free(pool->threads);
    free(pool);
}

int util_pool_size(const util_pool *pool) { return pool ? pool->n : 1; }

void util_pool_run(util_pool *pool, util_pool_fn fn, void *ctx) {
    if (!pool || pool->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store(&pool->pending, pool->n - 1);
    atomic_fetch_add(&pool->gen, 1);
    if (atomic_load(&pool->sleepers) > 0) { /* spinning workers need no syscall */
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
    }
    fn(ctx, 0, pool->n);
    /* Spin briefly, then yield: when the machine is oversubscribed (tests
     * running side by side) a descheduled worker must get the core back. */
    for (int spins = 0; atomic_load_explicit(&pool->pending, memory_order_acquire) > 0; spins++) {
        if (spins < 2000) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#endif
        } else sched_yield();
    }
}
