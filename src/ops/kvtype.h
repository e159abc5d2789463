/* ops/kvtype: the element types of the KV cache: their byte layouts, sizes,
 * and the scalar reference quantizers/dequantizers (write path and tests).
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

/* Whether type is a cache type (keys: any; values: all but q4_kc). */
bool op_kv_type_valid(int type, bool for_values);
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
