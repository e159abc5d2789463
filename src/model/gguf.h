/* model/gguf: reading GGUF v2/v3 files through mmap (every value validated
 * against the file size before use) and writing them. */
#ifndef KVLM_MODEL_GGUF_H
#define KVLM_MODEL_GGUF_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"

typedef enum {
    GGUF_UINT8 = 0, GGUF_INT8 = 1, GGUF_UINT16 = 2, GGUF_INT16 = 3,
    GGUF_UINT32 = 4, GGUF_INT32 = 5, GGUF_FLOAT32 = 6, GGUF_BOOL = 7,
    GGUF_STRING = 8, GGUF_ARRAY = 9, GGUF_UINT64 = 10, GGUF_INT64 = 11,
    GGUF_FLOAT64 = 12, GGUF_VTYPE_COUNT
} gguf_vtype;

/* A string inside the mapped file: not NUL-terminated. */
typedef struct { uint64_t len; const char *data; } gguf_str;

typedef struct {
    gguf_str key;
    gguf_vtype type;            /* GGUF_ARRAY for arrays */
    union {
        uint64_t u;             /* unsigned integers */
        int64_t i;              /* signed integers */
        double f;               /* FLOAT32 / FLOAT64 */
        bool b;
        gguf_str s;
    } v;
    /* Arrays only: */
    gguf_vtype arr_type;
    uint64_t arr_n;
    const uint8_t *arr_data;    /* first element in the map (numeric arrays) */
    gguf_str *arr_strs;         /* arr_n entries when arr_type == GGUF_STRING */
} gguf_kv;

#define GGUF_MAX_DIMS 4
typedef struct {
    gguf_str name;
    char cname[128];            /* NUL-terminated copy of name (names are <= 127 bytes) */
    int n_dims;
    int64_t ne[GGUF_MAX_DIMS];  /* ne[0] is the innermost (row length); unused dims are 1 */
    int type;                   /* dt_type: a ggml type (dt_layout != NULL), but possibly one kvlm
                                   cannot compute with: check dt_info(type) != NULL before use */
    uint64_t offset;            /* relative to the data section */
    size_t nbytes;
    const void *data;           /* into the map, aligned */
} gguf_tensor;

typedef struct {
    uint32_t version;
    uint64_t n_kv;
    gguf_kv *kv;
    uint64_t n_tensors;
    gguf_tensor *tensors;
    uint64_t alignment;
    uint64_t data_offset;       /* start of the tensor data section in the file */
    const uint8_t *map;
    size_t size;
} gguf_file;

/* Opens and validates; NULL with err filled on any problem. */
gguf_file *gguf_open(const char *path, kvlm_error *err);
/* Same, the file held as util_map_file's flags say (UTIL_MAP_READ, UTIL_MAP_LOCK). */
gguf_file *gguf_open_flags(const char *path, int map_flags, kvlm_error *err);
/* Same, over a caller-owned buffer (not copied, must outlive the result). */
gguf_file *gguf_open_buffer(const void *buf, size_t size, kvlm_error *err);
void gguf_close(gguf_file *f);

const gguf_kv *gguf_find(const gguf_file *f, const char *key);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);
/* Typed getters: return false if absent or not convertible
 * (any integer type converts to int64 if in range; FLOAT32/64 to double). */
bool gguf_get_int(const gguf_file *f, const char *key, int64_t *out);
bool gguf_get_float(const gguf_file *f, const char *key, double *out);
bool gguf_get_bool(const gguf_file *f, const char *key, bool *out);
/* Copies a string value into buf (NUL-terminated, truncated to cap-1). */
bool gguf_get_str(const gguf_file *f, const char *key, char *buf, size_t cap);
/* Array access (kv->type must be GGUF_ARRAY); element i converted. */
int64_t gguf_arr_int(const gguf_kv *kv, uint64_t i);
double gguf_arr_float(const gguf_kv *kv, uint64_t i);
const char *gguf_vtype_name(gguf_vtype t);
/* Writes a printable form of a value (arrays: type, length and first items). */
void gguf_kv_format(const gguf_kv *kv, char *buf, size_t cap);

/* Writing. Values and tensor data are copied only at write time: the caller
 * keeps tensor data alive until gguf_writer_write returns. */
typedef struct gguf_writer gguf_writer;
gguf_writer *gguf_writer_create(void);
void gguf_writer_free(gguf_writer *w);
void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v);
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n);
void gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n);
void gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
/* More scalar and array setters (additions to the original set). */
void gguf_writer_set_u8(gguf_writer *w, const char *key, uint8_t v);
void gguf_writer_set_i8(gguf_writer *w, const char *key, int8_t v);
void gguf_writer_set_u16(gguf_writer *w, const char *key, uint16_t v);
void gguf_writer_set_i16(gguf_writer *w, const char *key, int16_t v);
void gguf_writer_set_i64(gguf_writer *w, const char *key, int64_t v);
void gguf_writer_set_f64(gguf_writer *w, const char *key, double v);
/* Strings with explicit byte lengths (lens NULL: strlen), for tokens that may
 * hold NUL bytes. */
void gguf_writer_set_arr_strn(gguf_writer *w, const char *key, const char *const *v, const uint32_t *lens,
                              uint64_t n);
/* Array of n numeric or bool elements (host layout: uint8_t for bools). */
void gguf_writer_set_arr(gguf_writer *w, const char *key, gguf_vtype type, const void *v, uint64_t n);
/* A value given in its file encoding (what follows the type in a GGUF
 * key/value; e.g. arrays of arrays). Checked like a file's value. */
int gguf_writer_set_raw(gguf_writer *w, const char *key, gguf_vtype type, const void *val, size_t len,
                        kvlm_error *err);
/* Setters return void: a failure (out of memory, bad argument) is kept and
 * reported by gguf_writer_write. Setting a key again replaces its value in place. */
/* Copies every key/value of f (e.g. a tokenizer) except those already set.
 * prefix: only keys that start with it (NULL or "": all). Values are copied. */
void gguf_writer_copy_kv(gguf_writer *w, const gguf_file *f, const char *prefix);
/* ne as in gguf_tensor; nbytes must equal dt_row_size(type, ne[0]) * rows. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, int type, int n_dims,
                           const int64_t *ne, const void *data, kvlm_error *err);
/* Writes version 3, alignment from "general.alignment" (default 32). */
int gguf_writer_write(gguf_writer *w, const char *path, kvlm_error *err);
/* Same, calling cb (when not NULL) with lo..hi as the tensors' bytes are
 * written; its false removes the file and returns KVLM_ECANCELED. */
int gguf_writer_write_progress(gguf_writer *w, const char *path, kvlm_progress_callback cb, void *user, float lo,
                               float hi, kvlm_error *err);
/* Same, into a malloc'ed buffer (*out, *size; caller frees). */
int gguf_writer_write_mem(gguf_writer *w, void **out, size_t *size, kvlm_error *err);
#endif
