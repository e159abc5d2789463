/* ops/ops: the compute kernels of the forward pass. Each has a scalar
 * reference (suffix _ref) that the fast path (AVX2/FMA, chosen at run time)
 * is tested against. Kernels never allocate: callers pass scratch memory.
 * The forward pass calls them through a backend table (ops/backend.h); the
 * per-weight-type facts live in one table (ops/type_traits.h). */
#ifndef KVLM_OPS_OPS_H
#define KVLM_OPS_OPS_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "util/pool.h"

/* ---- matrix multiplication ----------------------------------------------
 * Y[t][o] = sum_i X[t][i] * W[o][i]  for t < T, o < n_out.
 * W: n_out rows of n_in elements in GGUF type wtype (rows are
 * dt_row_size(wtype, n_in) bytes apart). X, Y: f32, row-major, dense.
 * wtype: F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K.
 * Quantized types quantize X once per call into `work` (Q8_0 blocks for
 * Q8_0/Q4_0, Q8_K for the K types) and use integer dot products. */
size_t op_matmul_work_size(int wtype, int T, int n_in);
void op_matmul(util_pool *pool, float *Y, const float *X, const void *W, int wtype,
               int T, int n_in, int n_out, void *work);
/* Several matrices of one input at once (Q, K, V; gate, up): X is quantized
 * once for all of them when their types share an activation format, and
 * their row chunks are handed to the threads in one pass. Each output is
 * exactly what op_matmul gives. work: the largest op_matmul_work_size. */
#define OP_MM_MAX_OUTS 4
typedef struct {
    float *Y;
    const void *W;
    int wtype, n_out;
} op_mm_out;
void op_matmul_n(util_pool *pool, const float *X, int T, int n_in, const op_mm_out *outs, int n, void *work);
/* op_matmul_n whose input rows are first written by prep(user, t), once per
 * row t, from the threads in the pass that quantizes X (float weights: in a
 * pass of its own): per-token work before a product (a residual add and
 * rmsnorm, SwiGLU) then costs no pass of the threads, nor a serial loop.
 * prep(user, t) may write row t of X and read only row t. prep runs even
 * when no matrix is usable (n = 0, unsupported types). */
typedef void (*op_mm_prep_fn)(void *user, int t);
#define OP_MM_PREP_MIN_T 4 /* fewer rows: prep and quantization run on the calling thread */
void op_matmul_prep(util_pool *pool, const float *X, int T, int n_in, const op_mm_out *outs, int n, void *work,
                    op_mm_prep_fn prep, void *user);
/* Reference: dequantizes each row of W with dt_dequantize_row and accumulates
 * in double. Single-threaded, allocates. For tests. */
void op_matmul_ref(float *Y, const float *X, const void *W, int wtype, int T, int n_in, int n_out);
/* Notes: n_in must be a multiple of the type's block size (32 for Q8_0/Q4_0,
 * 256 for Q4_K/Q6_K; any for the float types); unsupported types leave Y
 * untouched. work must be op_matmul_work_size bytes (may be NULL when that is
 * 0) and must not overlap X or Y. Results do not depend on the thread count. */
/* ---- packed weights ----------------------------------------------------------
 * Weights that only matmul reads can be repacked once, at load, into the
 * layout of this CPU's fastest kernel (CPUs with AVX512-VNNI): Q8_0 and Q4_0
 * rows in groups of 16; per group and block of 32 columns the 16 f16 scales,
 * then 64-byte chunks where chunk k holds bytes 4k..4k+3 of each of the 16
 * rows' block: 8 chunks of w + 128 (unsigned) for OP_Q8_0_R16, 4 chunks of
 * nibble bytes for OP_Q4_0_R16. One vpdpbusd per chunk (per nibble half) then
 * gives the 16 rows' partial dots in its 16 lanes, against one broadcast dword
 * of the activations. The last group is padded with zero rows; the packed
 * tensor has the unpacked one's size rounded up to whole groups, and op_matmul
 * takes the packed type as its wtype (rows still dt_row_size(base type) apart;
 * Q4_K, below, is the exception).
 * Results equal the scalar kernel of the base type bit for bit (integer block
 * dots, then one FMA per block in column order). */
#define OP_Q8_0_R16 0x108
#define OP_Q4_0_R16 0x102
/* OP_Q5_0_R16: OP_Q4_0_R16's layout per group and block (scales, 4 chunks of
 * nibble bytes) followed by 64 bytes of 5th bits: byte 4j + i of row j holds
 * bit k for element 4k + i and bit 4 + k for element 16 + 4k + i (k = 0..3),
 * so each chunk's bits come out with one shift; Q5_0's own size (22 bytes a
 * row and block). */
#define OP_Q5_0_R16 0x106
/* OP_Q4_1_R16, OP_Q5_1_R16: as OP_Q4_0_R16 / OP_Q5_0_R16 with the 16 rows'
 * f16 mins between the scales and the chunks (the files' sizes). */
#define OP_Q4_1_R16 0x103
#define OP_Q5_1_R16 0x107
/* OP_Q4_K_R16: Q4_K rows in groups of 16, per group and 256-column
 * super-block (2,368 bytes, 148 per row where Q4_K takes 144): the 16 rows'
 * f16 d, their f16 dmin, their 8 sub-block scales [8][16] and 8 mins [8][16]
 * unpacked to bytes, then per pair p of 32-column sub-blocks (2p in the low
 * nibbles, 2p+1 in the high ones, as in Q4_K) 8 chunks of 64 bytes, chunk k
 * holding bytes 32p + 4k..4k+3 of each row's quants. The rows of a packed
 * Q4_K tensor are op_pack_row_size apart. Results equal the scalar Q4_K
 * kernel bit for bit (integer sub-block dots times the scales, the mins
 * against the activations' sums, then per super-block
 * fma(xd, fma(d, sumi, -dmin * summ), s)). */
#define OP_Q4_K_R16 0x10c
/* OP_Q5_K_R16: OP_Q4_K_R16's layout (2,880 bytes per group and super-block,
 * 180 per row where Q5_K takes 176) followed by the 5th bits: 8 chunks of 64
 * bytes, bit s of byte 4j + i of chunk k the 5th bit of row j's column
 * 32s + 4k + i. Results equal the scalar Q5_K kernel bit for bit. */
#define OP_Q5_K_R16 0x10d
/* OP_Q6_K_R16: Q6_K rows in groups of 16, per group and super-block (3,360
 * bytes, Q6_K's 210 per row): the 16 rows' f16 d, their 16 scales [16][16]
 * (int8), then the quants as u = q + 32 (0..63) in 64-byte chunks of 4
 * columns x 16 rows per 32-column unit j (chunk k: columns 32j + 4k..4k+3):
 * the low nibbles of units 2p and 2p + 1 share a byte (low, high nibble; 4 x 8
 * chunks), the top 2 bits of units 4q..4q+3 share a byte (2 bits each, from
 * the bottom; 2 x 8 chunks). Results equal the scalar Q6_K kernel bit for
 * bit (integer group dots times the scales, then fma(d xd, sumi, s)). */
#define OP_Q6_K_R16 0x10e
/* OP_IQ4_NL_R16: OP_Q4_0_R16's layout (IQ4_NL's block is Q4_0's: an f16 scale,
 * nibbles in the same order); the kernel looks the nibbles up as level + 128
 * (unsigned) and starts each block's dot from -128 x the token's sum of
 * quants. Results equal the scalar IQ4_NL kernel bit for bit. */
#define OP_IQ4_NL_R16 0x114
/* OP_MXFP4_R16: OP_IQ4_NL_R16's layout with MXFP4's E8M0 byte per row for
 * the f16 scales (16 bytes, then the nibble chunks: 272 bytes a group and
 * block, the rows' own 17 each); the kernel looks the nibbles up as MXFP4's
 * doubled level + 128 and scales by 2^(e - 128) (vscalefps, exact).
 * Results equal the scalar MXFP4 kernel bit for bit. */
#define OP_MXFP4_R16 0x127
/* OP_IQ4_XS_R16: IQ4_XS rows in groups of 16, per group and super-block
 * (2,208 bytes, 138 per row where IQ4_XS takes 136): the 16 rows' f16 d,
 * their 8 sub-block scales [8][16] unpacked to signed bytes (ls - 32), then
 * per 32-column sub-block 4 chunks of 64 bytes, chunk k holding bytes
 * 4k..4k+3 of each row's 16 quant bytes of that sub-block (low nibbles:
 * columns 4k.., high: 16 + 4k..). Results equal the scalar IQ4_XS kernel bit
 * for bit (integer sub-block dots times the scales, then fma(d xd, sumi, s)). */
#define OP_IQ4_XS_R16 0x117
/* OP_Q2_K_R16 (1,344 bytes per group and super-block, Q2_K's 84 per row):
 * the 16 rows' f16 d, their f16 dmin, their 16 scale bytes [16][16] as
 * stored (scale low nibble, min high), then per 128-column half h 8 chunks of
 * 64 bytes, chunk k holding bytes 32h + 4k..4k+3 of each row's qs (bits 2j of
 * a byte: column 128h + 32j + 4k + i). OP_Q3_K_R16 (1,824 bytes, 114 per row
 * where Q3_K takes 110): d, the 16 scales [16][16] unpacked to signed bytes
 * (s - 32), Q2_K's 16 chunks of low bits, then the hmask bits as 64 masks
 * of 64 bits, mask 8(4h + j) + k (little-endian) holding in bit 4r + i the
 * hmask bit of row r's column 128h + 32j + 4k + i (one bit per byte of the
 * matching chunk of low bits, for AVX-512's byte masks). Results equal the
 * scalar Q2_K / Q3_K kernels bit for bit. */
#define OP_Q2_K_R16 0x10a
#define OP_Q3_K_R16 0x10b
/* Bytes between the rows of weights of type wtype (packed or not), 0 if
 * n_in is not whole blocks; a packed group is 16 such rows. */
size_t op_pack_row_size(int wtype, int n_in);
/* Packed type for weights of type wtype on this CPU, or -1 (none worth it). */
int op_pack_type(int wtype);
/* Bytes of the packed form (n_out rounded up to whole groups; 0 if wtype has
 * none). The layout is the same on every CPU (the scalar kernels read it
 * too), op_pack_type says whether this CPU gains from it. */
size_t op_pack_size(int wtype, int n_in, int n_out);
/* Packs n_out x n_in weights of type wtype into dst (op_pack_size bytes) in
 * the layout of op_pack_type(wtype); padding rows are zero. */
void op_pack(int wtype, const void *src, void *dst, int n_in, int n_out);

/* Sustained read bandwidth of the machine in bytes/s: every pool thread sums
 * its slice of a `bytes` buffer with the widest loads, with and without
 * software prefetch; best of 10 passes.
 * Allocates the buffer (a measurement, not a kernel); 0 on failure. */
double op_measure_read_bandwidth(util_pool *pool, size_t bytes);
/* Whether the running CPU has the fast paths (AVX2 + FMA + F16C). */
bool op_cpu_has_avx2(void);
/* The level the kernels use now, by name: "scalar", "AVX2", "AVX-512 VNNI". */
const char *op_simd_name(void);
/* Tests set this to force the scalar paths (0) or auto (1). */
void op_set_simd(bool enabled);

/* ---- elementwise ---------------------------------------------------------- */
/* out[i] = x[i] / rms(x) * w[i]; out may equal x. */
void op_rmsnorm(float *out, const float *x, const float *w, int n, float eps);
void op_rmsnorm_ref(float *out, const float *x, const float *w, int n, float eps);
/* Rotates rope_dim dims of each of n_heads heads (head_dim apart) of one
 * token at position pos. neox: pairs (i, i + rope_dim/2); else (2i, 2i+1).
 * theta_i = pos * base^(-2i/rope_dim) / ff[i] (ff: the rope_dim/2 frequency
 * factors of Llama 3.1's scaling, GGUF's rope_freqs.weight; NULL: none). */
void op_rope(float *x, int n_heads, int head_dim, int rope_dim, int pos, float base, const float *ff, bool neox);
void op_rope_ref(float *x, int n_heads, int head_dim, int rope_dim, int pos, float base, const float *ff, bool neox);
/* op_rope in two steps, for rows that share a position (every layer's q and k
 * of a token): the rope_dim/2 cos and sin of position pos, then the rotation
 * with them. Together they give op_rope's result bit for bit. */
void op_rope_cossin(float *cs, float *sn, int rope_dim, int pos, float base, const float *ff);
void op_rope_apply(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, const float *sn, bool neox);
/* In place, numerically stable. */
void op_softmax(float *x, int n);
void op_softmax_ref(float *x, int n);
/* Index of the first largest element (NaNs never win; a NaN x[0] gives 0);
 * -1 if n <= 0. */
int op_argmax(const float *x, int n);
int op_argmax_ref(const float *x, int n);
/* gate[i] = silu(gate[i]) * up[i] */
void op_swiglu(float *gate, const float *up, int n);
void op_swiglu_ref(float *gate, const float *up, int n);
/* y[i] += x[i] */
void op_add(float *y, const float *x, int n);

/* ---- attention -------------------------------------------------------------
 * Causal attention of T query tokens of one sequence over its cached keys and
 * values. Query token t sits at position q_pos0 + t and sees cache positions
 * 0..q_pos0+t. q: [T][n_heads][head_dim]; out: same shape.
 * Cache (f32): key of KV head h at position p is at
 *   k + h * kv_head_stride + p * head_dim   (likewise v).
 * Query head i uses KV head i / (n_heads / n_kv_heads).
 * scale multiplies q.k (normally 1/sqrt(head_dim)).
 * The fast version tiles queries and streams keys with an online softmax,
 * never materialising the T x n_kv score matrix, parallel over heads and
 * query tiles; scratch: op_attention_work_size bytes. */
typedef struct {
    int T, q_pos0;
    int n_heads, n_kv_heads, head_dim;
    const float *k, *v;
    size_t kv_head_stride;  /* floats between KV heads */
    float scale;
    /* Paged cache, used instead of k, v, kv_head_stride when blocks != NULL:
     * position p lives in blocks[p / block_size]; its key for KV head h is at
     *   blocks[p / block_size] + h * head_stride + (p % block_size) * head_dim
     * and its value v_offset floats after that key. Results are bit-identical
     * to the contiguous layout whatever the block size. */
    const float *const *blocks;
    int block_size;
    size_t head_stride;     /* floats between KV heads within a block */
    size_t v_offset;        /* floats from a key to its value */
    /* Typed paged cache (ops/kvtype.h): keys of type k_type, values of type
     * v_type (KVLM_CACHE_*; 0 = f32). When head_bytes != 0 it replaces the two
     * float strides above: KV head h's K region in a block starts at
     *   (const uint8_t *)blocks[b] + h * head_bytes,
     * its V region v_bytes after that; a per-token type's row of slot i is
     * i * op_kv_row_bytes(type, head_dim) into its region. Decode reads
     * each key/value row straight from its block, converting it in registers
     * (q8_0 / q4_0 keys: integer dot products with the query rounded to int8
     * per group, on every path); prefill runs the same AVX-512 tile where
     * the types allow it, elsewhere dequantizes a tile at a time into
     * per-thread scratch; never a copy of the cache. f32 is read directly. */
    int k_type, v_type;
    size_t head_bytes, v_bytes;
    /* q4_kc keys: the block still filling (index stage_block into blocks, -1:
     * none) has its keys in f16 at k_stage + h * block_size * head_dim +
     * slot * head_dim, not in its K region. */
    const uint16_t *k_stage;
    int stage_block;
    /* H2O: when non-NULL, key_weights[p] += the softmax probability of key p
     * summed over the T queries and the query heads (every KV head), for
     * p < q_pos0 + T; out is unchanged. op_attention computes them in its
     * kernels: the scores go to score_work (score_work_floats floats; at least
     * op_attention_score_floats(1, ...), and the query tokens are taken that
     * many at a time when it holds fewer than T), then become probabilities
     * with each row's final max and sum. Without score_work it falls back to
     * the reference's scalar pass. Same bits on any thread count. */
    float *key_weights;
    float *score_work;
    size_t score_work_floats;
    /* Values narrower than keys (0: head_dim): a value row is read as its
     * first v_dim elements and out is [T][n_heads][v_dim]. With a latent
     * (MLA) cache the value rows are the key rows themselves (v_bytes 0,
     * v_type = k_type). Only op_attention_ref and op_attention_mla take it. */
    int v_dim;
    /* Sliding window (0: none): the query at position p sees only keys
     * p - window < k <= p (llama.cpp / Hugging Face: masked when p - k >=
     * window). Keys before the window of the first query are never read, so
     * blocks[] entries wholly before it may point anywhere readable; the work
     * is O(window), not O(position). Soft-capping (0: none): each score s =
     * scale * q.k becomes softcap * tanh(s / softcap) before the softmax
     * (gemma2). Soft-capping, and windows in prefill (T > 1), run the tiled
     * kernel of each level (not the fused decode or VNNI tile kernels); a
     * window in decode runs them all. Neither is for H2O's key_weights. */
    int window;
    float softcap;
    /* Attention sinks (gpt-oss; NULL: none): one learned logit per query
     * head, sinks[hq], taken into the softmax's max and denominator as a key
     * with no value (not scaled, not capped), so each row's weights sum to
     * less than 1. Every kernel and the key-split merge apply it where they
     * divide by the sum. Not for H2O's key_weights. */
    const float *sinks;
} op_attn_args;
/* n_threads: the pool's size (util_pool_size); work must not be shared by
 * concurrent calls. */
size_t op_attention_work_size(int n_threads, int head_dim);
/* floats of score_work for T query tokens over n_keys cache positions */
size_t op_attention_score_floats(int T, int n_heads, int n_keys);
void op_attention(util_pool *pool, float *out, const float *q, const op_attn_args *a, void *work);
/* n independent calls (the sequences of a batched decode step) in one pass of
 * the threads instead of one each; each output is exactly op_attention's.
 * Calls with key_weights, or long enough to be split across threads, still
 * run on their own. */
void op_attention_n(util_pool *pool, int n, float *const *out, const float *const *q, const op_attn_args *a,
                    void *work);
/* Reference: materialises each query's full score row, softmax, weighted sum;
 * with a typed cache it first dequantizes all visible K/V (allocates). */
void op_attention_ref(float *out, const float *q, const op_attn_args *a);
/* Attention over a latent (MLA) cache (docs/mla.md): one KV head, paged
 * (blocks, block_size, k_type a per-token type, head_bytes), values the
 * first v_dim elements of each key row; every query head reads each key row
 * once per tile. No key_weights. Matches op_attention_ref to float rounding
 * and gives the same bits on any thread count. work: op_attention_mla_work_size
 * bytes for queries up to position n_ctx - 1. */
size_t op_attention_mla_work_size(int n_threads, int n_heads, int head_dim, int n_ctx);
void op_attention_mla(util_pool *pool, float *out, const float *q, const op_attn_args *a, void *work);
/* gpt-oss's FFN: gate[i] = g sigmoid(alpha g) (u + 1) with g = min(gate[i],
 * limit), u = up[i] clamped to [-limit, limit] (ops/swiglu_oai.c; gpt-oss:
 * alpha 1.702, limit 7). up is overwritten. */
void op_swiglu_oai(float *gate, float *up, int n, float alpha, float limit);
/* Gemma's FFN: gate[i] = gelu_tanh(gate[i]) * up[i] (ops/geglu.c). */
void op_geglu(float *gate, const float *up, int n);
/* x[i] = cap * tanh(x[i] / cap): gemma2's final-logit soft-capping. */
void op_softcap(float *x, int n, float cap);
#endif
