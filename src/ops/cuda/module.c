/* ops/cuda/module: libkvlm-cuda.so's side of its loading (ops/cuda_load.c):
 * the two host functions of libkvlm its weight upload uses (a row's size and
 * its dequantization, dtype/dtype), handed over by cu_module_init when the
 * module is loaded, so the module links nothing of libkvlm. */
#include <stddef.h>
#include <stdint.h>

static size_t (*g_row_size)(int, int64_t);
static void (*g_dequantize_row)(int, const void *, float *, int64_t);

void cu_module_init(size_t (*row_size)(int, int64_t), void (*dequantize_row)(int, const void *, float *, int64_t));
void cu_module_init(size_t (*row_size)(int, int64_t), void (*dequantize_row)(int, const void *, float *, int64_t)) {
    g_row_size = row_size;
    g_dequantize_row = dequantize_row;
}

size_t dt_row_size(int type, int64_t n);
size_t dt_row_size(int type, int64_t n) { return g_row_size(type, n); }
void dt_dequantize_row(int type, const void *src, float *dst, int64_t n);
void dt_dequantize_row(int type, const void *src, float *dst, int64_t n) { g_dequantize_row(type, src, dst, n); }
