/* ops/kvtype: one table of the KV cache's element types (op_kv_traits: a row
 * per type): names, which side may hold them, byte layouts and sizes, the
 * scalar reference quantizers/dequantizers, kernels per SIMD level, the rules
 * q4_kc brings (rows in order, no rollback across blocks, a draft's type).
 * A new KV type is one row in kvtype.c plus its kernels.
 *
 * Type ids are those of kvlm.h (KVLM_CACHE_*; the per-token ones equal GGUF's).
 * Per-token types store each (token, KV head) row of head_dim elements:
 *   f32, f16, bf16   4 / 2 / 2 bytes per element
 *   q8_0, q4_0       groups of g elements, g = 32 when head_dim % 32 == 0
 *                    (then byte-for-byte GGUF's block_q8_0 / block_q4_0),
 *                    else g = head_dim (one group per row), each group
 *                    q8_0: f16 scale d + g int8 codes      value = q * d
 *                    q4_0: f16 scale d + ceil(g/2) bytes   value = (q - 8) * d,
 *                          low nibbles elements 0..ceil(g/2)-1, high nibbles
 *                          the rest (for g = 32: GGUF's 0..15 / 16..31).
 *                    bytes per row: (head_dim / g) * (2 + g) or (2 + ceil(g/2)).
 * q4_kc (keys only, KIVI-style) is per block, not per row: the keys of one
 * (block of bs tokens, KV head) are quantized per channel over the tokens:
 *   f16 scale[head_dim], f16 min[head_dim], then per channel ceil(bs/2) bytes
 *   of 4-bit codes (byte j: token 2j low nibble, 2j+1 high); value = q*s + m.
 *   bytes per (block, head): head_dim * (4 + ceil(bs/2)).
 * While a block fills, its q4_kc keys live in f16 elsewhere (the cache keeps
 * one staging block per sequence) and the block is quantized when full. */
#ifndef KVLM_OPS_KVTYPE_H
#define KVLM_OPS_KVTYPE_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"
#include "ops/ops_internal.h"

/* A per-token row of hd elements: to the type's bytes, and back. */
typedef void (*op_kv_quant_fn)(const float *x, void *dst, int head_dim);
typedef void (*op_kv_dequant_fn)(const void *src, float *y, int head_dim);
/* The attention kernels of one type at one SIMD level (attention_internal.h). */
typedef struct op_kv_kernels op_kv_kernels;

typedef struct {
    const char *name; /* as kvlm_cache_type_from_name takes it */
    int id;           /* KVLM_CACHE_* */
    bool keys, values; /* which side of the cache may hold it */
    /* per-token layout: codes of `bits` bits; grouped: an f16 scale per
     * group of op_kv_group elements, whose codes meet an int8 query */
    int bits;
    bool grouped;
    /* per-block layout (q4_kc): one region per (block, KV head) of
     * region_bytes, quantized over the block's tokens by quantize_block when
     * its last row is written; until then the rows wait in f16 in the
     * sequence's staging block */
    bool per_block;
    size_t (*region_bytes)(int head_dim, int block_size);
    void (*quantize_block)(const uint16_t *rows, void *region, int head_dim, int block_size, int n_tok);
    void (*dequantize_block)(const void *region, float *y, int head_dim, int block_size, int t0, int n);
    /* rollback rule: rows are written in order (one writer per sequence and
     * KV head), and rows past a block boundary cannot be taken back, so
     * speculation stops short of the filling block's last slot */
    bool in_order;
    int draft;   /* the type a draft model's cache keeps in place of this one */
    bool cuda;   /* the CUDA backend's kernels take it */
    /* per-token rows: [OP_SIMD_SCALAR] is the reference; NULL: the level below's */
    op_kv_quant_fn quantize[OP_SIMD_LEVELS];
    op_kv_dequant_fn dequantize;
    const op_kv_kernels *kernels[OP_SIMD_LEVELS]; /* NULL: the level below's */
} op_kv_traits;

/* The row of a type id, NULL if it is none; the rows in order (n of them). */
const op_kv_traits *op_kv_traits_of(int type);
const op_kv_traits *op_kv_traits_all(int *n);
/* A name's type id, -1 if none; a type's name, NULL if none. */
int op_kv_type_by_name(const char *name);
const char *op_kv_type_name(int type);
/* Whether type is a cache type for keys (any row) or values (values). */
bool op_kv_type_valid(int type, bool for_values);
/* Whether keys of this type are quantized per block (staged meanwhile), and
 * whether rows must be written in order and not taken back across blocks. */
bool op_kv_per_block(int type);
bool op_kv_in_order(int type);
/* The key type of a draft model's cache beside keys of this type. */
int op_kv_draft_type(int type);
/* Keys meeting the query as int8 codes (grouped types). */
bool op_kv_int_query(int type);
/* The kernels of a type at a SIMD level or the nearest level below that has
 * them; NULL if none. */
const op_kv_kernels *op_kv_kernels_at(int type, int level);

/* Elements per quantization group of a per-token row (1 for float types). */
int op_kv_group(int type, int head_dim);
/* Bytes of one token's row for one head (per-token types; 0 for q4_kc). */
size_t op_kv_row_bytes(int type, int head_dim);
/* Bytes of one (block, head) region of keys or values of this type. */
size_t op_kv_region_bytes(int type, int head_dim, int block_size);

/* Row conversions for per-token types (n = head_dim elements). The write
 * path's op_kv_quantize_row gives the bits of the scalar reference
 * op_kv_quantize_row_ref (f16 rows: with F16C where the CPU has it). */
void op_kv_quantize_row(int type, const float *x, void *dst, int head_dim);
void op_kv_quantize_row_ref(int type, const float *x, void *dst, int head_dim);
void op_kv_dequantize_row(int type, const void *src, float *y, int head_dim);

/* q4_kc: quantizes n_tok (<= block_size) f16 key rows (head_dim apart) into a
 * region; tokens beyond n_tok keep code 0. */
void op_kv_quantize_kc(const uint16_t *rows, void *region, int head_dim, int block_size, int n_tok);
/* q4_kc: keys of tokens t0..t0+n-1 of a region, as rows of head_dim floats. */
void op_kv_dequantize_kc(const void *region, float *y, int head_dim, int block_size, int t0, int n);
#endif
