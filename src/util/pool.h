/* util/pool: a fixed set of worker threads that run one parallel job at a time.
 * Kernels split their work by (ith, nth); the caller's thread is worker 0. */
#ifndef KVLM_UTIL_POOL_H
#define KVLM_UTIL_POOL_H

typedef struct util_pool util_pool;
typedef void (*util_pool_fn)(void *ctx, int ith, int nth);

/* n_threads <= 0: one per online core. Returns NULL on failure. */
util_pool *util_pool_create(int n_threads);
void util_pool_free(util_pool *pool);
int util_pool_size(const util_pool *pool);
/* Runs fn(ctx, i, n) for i in [0, n) on n threads and waits for all.
 * pool may be NULL: then fn(ctx, 0, 1) runs on the caller. */
void util_pool_run(util_pool *pool, util_pool_fn fn, void *ctx);
/* The number of online cores. */
int util_n_cores(void);

/* Splits [0, n) into nth near-equal ranges; sets [*lo, *hi) for ith. */
static inline void util_split(long n, int ith, int nth, long *lo, long *hi) {
    long per = n / nth, rem = n % nth;
    *lo = ith * per + (ith < rem ? ith : rem);
    *hi = *lo + per + (ith < rem ? 1 : 0);
}
#endif
