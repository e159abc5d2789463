/* model/safetensors: reading Hugging Face's safetensors files through mmap
 * (every header value checked against the file before use) and the sets of
 * shards that model.safetensors.index.json describes. No copies: a tensor is
 * a pointer into its file's map. */
#ifndef KVLM_MODEL_SAFETENSORS_H
#define KVLM_MODEL_SAFETENSORS_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "kvlm.h"

/* safetensors dtypes (the strings of the format). */
typedef enum {
    ST_F64, ST_F32, ST_F16, ST_BF16, ST_I64, ST_I32, ST_I16, ST_I8, ST_U64, ST_U32, ST_U16, ST_U8,
    ST_BOOL, ST_F8_E4M3, ST_F8_E5M2, ST_DTYPE_COUNT
} st_dtype;

#define ST_MAX_DIMS 8
typedef struct {
    char *name;
    st_dtype dtype;
    int n_dims;
    int64_t shape[ST_MAX_DIMS]; /* outermost first, as in the file (PyTorch's order) */
    const void *data;           /* into the map */
    size_t nbytes;
    int file;                   /* index of the file in its st_set (0 for a lone file) */
} st_tensor;

typedef struct {
    char *path;
    const uint8_t *map;         /* NULL for a caller's buffer */
    size_t size;
    st_tensor *tensors;         /* sorted by name */
    int n_tensors;
    char *metadata;             /* "__metadata__" as JSON text, or NULL */
} st_file;

/* "F32", "BF16", ...; and the element size in bytes. */
const char *st_dtype_name(st_dtype t);
size_t st_dtype_size(st_dtype t);

/* Opens and validates: the 8-byte header length, the JSON header (each
 * tensor: a known dtype, a shape, data_offsets inside the data section,
 * shape x dtype size = byte length, no two tensors overlapping). NULL with
 * err (naming the file and what is wrong) on any problem. */
st_file *st_open(const char *path, int map_flags, kvlm_error *err); /* map_flags: util_map_file's */
/* Same over a caller-owned buffer (kept, not copied); name is for messages. */
st_file *st_open_buffer(const void *buf, size_t size, const char *name, kvlm_error *err);
void st_close(st_file *f);
const st_tensor *st_find(const st_file *f, const char *name);

/* The safetensors of a Hugging Face model directory: model.safetensors, or
 * the shards that model.safetensors.index.json's weight_map names (every
 * shard must exist and hold the tensors the index puts in it). */
typedef struct {
    st_file **files;
    int n_files;
    const st_tensor **index;    /* every tensor of every file, sorted by name */
    int n_index;
    size_t total_bytes;         /* tensor bytes of all files */
} st_set;
st_set *st_set_open_dir(const char *dir, int map_flags, kvlm_error *err);
void st_set_close(st_set *s);
const st_tensor *st_set_find(const st_set *s, const char *name);
#endif
