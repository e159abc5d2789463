/* model/safetensors: safetensors files (u64 header length, JSON header,
 * data section) read through mmap with every offset checked, and the shard
 * sets of Hugging Face model directories (model.safetensors.index.json). */
#include "model/safetensors.h"
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include "util/error.h"
#include "util/file.h"

/* The format's own cap on the header (the Rust reader refuses more). */
#define ST_MAX_HEADER (100u << 20)

static const struct { const char *name; size_t size; } k_dtypes[ST_DTYPE_COUNT] = {
    [ST_F64] = {"F64", 8}, [ST_F32] = {"F32", 4}, [ST_F16] = {"F16", 2}, [ST_BF16] = {"BF16", 2},
    [ST_I64] = {"I64", 8}, [ST_I32] = {"I32", 4}, [ST_I16] = {"I16", 2}, [ST_I8] = {"I8", 1},
    [ST_U64] = {"U64", 8}, [ST_U32] = {"U32", 4}, [ST_U16] = {"U16", 2}, [ST_U8] = {"U8", 1},
    [ST_BOOL] = {"BOOL", 1}, [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E5M2] = {"F8_E5M2", 1},
};

const char *st_dtype_name(st_dtype t) { return (unsigned)t < ST_DTYPE_COUNT ? k_dtypes[t].name : "?"; }
size_t st_dtype_size(st_dtype t) { return (unsigned)t < ST_DTYPE_COUNT ? k_dtypes[t].size : 0; }

static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

static int cmp_by_offset(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    const uint8_t *p = x->data, *q = y->data;
    return p < q ? -1 : p > q;
}

static void free_tensors(st_file *f) {
    for (int i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    f->tensors = NULL;
    f->n_tensors = 0;
}

/* One header entry: {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}. */
static int parse_entry(st_file *f, st_tensor *t, const char *name, json_t *e, const uint8_t *data,
                       uint64_t data_size, kvlm_error *err) {
    const char *path = f->path;
    if (!json_is_object(e))
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: header entry is not an object", path, name);
    json_t *jd = json_object_get(e, "dtype"), *js = json_object_get(e, "shape"),
           *jo = json_object_get(e, "data_offsets");
    if (!json_is_string(jd) || !json_is_array(js) || !json_is_array(jo))
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: needs \"dtype\" (string), \"shape\" and "
                            "\"data_offsets\" (arrays)", path, name);
    const char *ds = json_string_value(jd);
    int dt = -1;
    for (int i = 0; i < ST_DTYPE_COUNT; i++)
        if (!strcmp(ds, k_dtypes[i].name)) dt = i;
    if (dt < 0) return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: unknown dtype \"%.32s\"", path, name, ds);
    t->dtype = (st_dtype)dt;
    size_t nd = json_array_size(js);
    if (nd > ST_MAX_DIMS)
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: %zu dimensions (at most %d)", path, name, nd,
                            ST_MAX_DIMS);
    t->n_dims = (int)nd;
    uint64_t n_elem = 1;
    bool overflow = false;
    for (size_t i = 0; i < nd; i++) {
        json_t *d = json_array_get(js, i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape[%zu] is not a non-negative integer", path,
                                name, i);
        uint64_t v = (uint64_t)json_integer_value(d);
        t->shape[i] = (int64_t)v;
        if (v && n_elem > UINT64_MAX / v) overflow = true;
        else n_elem *= v;
    }
    json_t *jb = json_array_get(jo, 0), *je = json_array_get(jo, 1);
    if (json_array_size(jo) != 2 || !json_is_integer(jb) || !json_is_integer(je) || json_integer_value(jb) < 0 ||
        json_integer_value(je) < json_integer_value(jb))
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: data_offsets must be [begin, end] with "
                            "0 <= begin <= end", path, name);
    uint64_t b = (uint64_t)json_integer_value(jb), en = (uint64_t)json_integer_value(je);
    if (en > data_size)
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: data_offsets [%llu, %llu] run past the data "
                            "section (%llu bytes): truncated file?", path, name, (unsigned long long)b,
                            (unsigned long long)en, (unsigned long long)data_size);
    uint64_t es = k_dtypes[dt].size;
    if (overflow || n_elem > UINT64_MAX / es || n_elem * es != en - b) {
        char shape[128];
        size_t o = 0;
        shape[0] = 0;
        for (int i = 0; i < t->n_dims && o < sizeof shape - 24; i++)
            o += (size_t)snprintf(shape + o, sizeof shape - o, "%s%lld", i ? "x" : "", (long long)t->shape[i]);
        return util_err_set(err, KVLM_EFORMAT, "%s: tensor %s: shape [%s] of %s needs %s bytes, but data_offsets "
                            "give %llu", path, name, shape, ds, overflow || n_elem > UINT64_MAX / es ? "too many" :
                            "other", (unsigned long long)(en - b));
    }
    t->data = data + b;
    t->nbytes = (size_t)(en - b);
    return KVLM_OK;
}

static int parse_header(st_file *f, const uint8_t *buf, size_t size, kvlm_error *err) {
    const char *path = f->path;
    if (size < 8)
        return util_err_set(err, KVLM_EFORMAT, "%s: %zu bytes is too short for a safetensors file", path, size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | buf[i];
    if (n > size - 8)
        return util_err_set(err, KVLM_EFORMAT, "%s: header length %llu runs past the end of the file (%zu bytes): "
                            "truncated or not a safetensors file", path, (unsigned long long)n, size);
    if (n > ST_MAX_HEADER || n < 2)
        return util_err_set(err, KVLM_EFORMAT, "%s: header length %llu is not plausible", path,
                            (unsigned long long)n);
    json_error_t je;
    json_t *root = json_loadb((const char *)buf + 8, (size_t)n, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return util_err_set(err, KVLM_EFORMAT, "%s: header is not valid JSON (at byte %d: %s)", path,
                            je.position, je.text);
    int rc = KVLM_OK;
    if (!json_is_object(root)) {
        rc = util_err_set(err, KVLM_EFORMAT, "%s: header is not a JSON object", path);
        goto done;
    }
    const uint8_t *data = buf + 8 + n;
    uint64_t data_size = size - 8 - n;
    size_t cap = json_object_size(root);
    f->tensors = calloc(cap ? cap : 1, sizeof *f->tensors);
    if (!f->tensors) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (!strcmp(key, "__metadata__")) {
            if (!json_is_object(val) && !json_is_null(val)) {
                rc = util_err_set(err, KVLM_EFORMAT, "%s: __metadata__ is not an object", path);
                goto done;
            }
            f->metadata = json_dumps(val, JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
            continue;
        }
        st_tensor *t = &f->tensors[f->n_tensors];
        memset(t, 0, sizeof *t);
        if (!(t->name = strdup(key))) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
        f->n_tensors++;
        if ((rc = parse_entry(f, t, key, val, data, data_size, err))) goto done;
    }
    /* No two tensors may share bytes (empty ones take none). */
    const st_tensor **by_off = malloc((size_t)(f->n_tensors ? f->n_tensors : 1) * sizeof *by_off);
    if (!by_off) { rc = util_err_set(err, KVLM_ENOMEM, "out of memory"); goto done; }
    int m = 0;
    for (int i = 0; i < f->n_tensors; i++)
        if (f->tensors[i].nbytes) by_off[m++] = &f->tensors[i];
    qsort(by_off, (size_t)m, sizeof *by_off, cmp_by_offset);
    for (int i = 1; i < m && !rc; i++) {
        const st_tensor *a = by_off[i - 1], *b = by_off[i];
        if ((const uint8_t *)a->data + a->nbytes > (const uint8_t *)b->data)
            rc = util_err_set(err, KVLM_EFORMAT, "%s: tensors %s and %s overlap (data_offsets [%zu, %zu] and "
                              "[%zu, %zu])", path, a->name, b->name, (size_t)((const uint8_t *)a->data - data),
                              (size_t)((const uint8_t *)a->data - data) + a->nbytes,
                              (size_t)((const uint8_t *)b->data - data),
                              (size_t)((const uint8_t *)b->data - data) + b->nbytes);
    }
    free(by_off);
    if (!rc) qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_tensor);
done:
    json_decref(root);
    return rc;
}

st_file *st_open_buffer(const void *buf, size_t size, const char *name, kvlm_error *err) {
    st_file *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(name ? name : "(buffer)"))) {
        free(f);
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        return NULL;
    }
    if (parse_header(f, buf, size, err)) {
        st_close(f);
        return NULL;
    }
    return f;
}

st_file *st_open(const char *path, int map_flags, kvlm_error *err) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        util_err_set(err, KVLM_EIO, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        util_err_set(err, KVLM_EIO, "%s: not a regular file", path);
        return NULL;
    }
    size_t size = (size_t)st.st_size;
    void *map = size ? util_map_file(fd, size, map_flags, path) : NULL;
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) {
        util_err_set(err, KVLM_EIO, "%s: %s: %s", path, map_flags & UTIL_MAP_READ ? "read" : "mmap", strerror(map_errno));
        return NULL;
    }
    st_file *f = st_open_buffer(map ? map : "", size, path, err);
    if (!f) {
        if (map) munmap(map, size);
        return NULL;
    }
    f->map = map;
    f->size = size;
    return f;
}

void st_close(st_file *f) {
    if (!f) return;
    free_tensors(f);
    free(f->metadata);
    free(f->path);
    if (f->map) munmap((void *)f->map, f->size);
    free(f);
}

const st_tensor *st_find(const st_file *f, const char *name) {
    st_tensor key = {.name = (char *)name};
    return bsearch(&key, f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_tensor);
}

/* ---- sets of shards ------------------------------------------------------ */

static int cmp_index(const void *a, const void *b) {
    return strcmp((*(const st_tensor *const *)a)->name, (*(const st_tensor *const *)b)->name);
}

void st_set_close(st_set *s) {
    if (!s) return;
    for (int i = 0; i < s->n_files; i++) st_close(s->files[i]);
    free(s->files);
    free(s->index);
    free(s);
}

const st_tensor *st_set_find(const st_set *s, const char *name) {
    st_tensor key = {.name = (char *)name};
    const st_tensor *kp = &key;
    const st_tensor **hit = bsearch(&kp, s->index, (size_t)s->n_index, sizeof *s->index, cmp_index);
    return hit ? *hit : NULL;
}

static int add_file(st_set *s, const char *path, int map_flags, kvlm_error *err) {
    st_file **nf = realloc(s->files, (size_t)(s->n_files + 1) * sizeof *nf);
    if (!nf) return util_err_set(err, KVLM_ENOMEM, "out of memory");
    s->files = nf;
    st_file *f = st_open(path, map_flags, err);
    if (!f) return err ? err->code : KVLM_EFORMAT;
    for (int i = 0; i < f->n_tensors; i++) f->tensors[i].file = s->n_files;
    s->files[s->n_files++] = f;
    return KVLM_OK;
}

/* A shard name from the index: a plain file name inside the directory. */
static bool safe_shard_name(const char *n) {
    return *n && !strchr(n, '/') && strcmp(n, ".") && strcmp(n, "..") && strlen(n) < 512;
}

static int open_index(st_set *s, const char *dir, const char *ipath, int map_flags, kvlm_error *err) {
    json_error_t je;
    json_t *root = json_load_file(ipath, JSON_REJECT_DUPLICATES, &je);
    if (!root) return util_err_set(err, KVLM_EFORMAT, "%s: not valid JSON (line %d: %s)", ipath, je.line, je.text);
    int rc = KVLM_OK;
    json_t *wm = json_object_get(root, "weight_map");
    if (!json_is_object(wm)) {
        rc = util_err_set(err, KVLM_EFORMAT, "%s: no \"weight_map\" object", ipath);
        goto done;
    }
    /* Each shard once, in the order the index first names it. */
    const char *key;
    json_t *val;
    char path[4096];
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val) || !safe_shard_name(json_string_value(val))) {
            rc = util_err_set(err, KVLM_EFORMAT, "%s: weight_map[\"%s\"] is not a file name in the directory", ipath,
                              key);
            goto done;
        }
        const char *shard = json_string_value(val);
        bool have = false;
        snprintf(path, sizeof path, "%s/%s", dir, shard);
        for (int i = 0; i < s->n_files && !have; i++) have = !strcmp(s->files[i]->path, path);
        if (have) continue;
        if (access(path, R_OK) != 0) {
            rc = util_err_set(err, KVLM_EIO, "%s: shard %s (holding %s) is missing: %s", ipath, shard, key,
                              strerror(errno));
            goto done;
        }
        if ((rc = add_file(s, path, map_flags, err))) goto done;
    }
    /* Every tensor the index names must be in the shard it names. */
    json_object_foreach(wm, key, val) {
        snprintf(path, sizeof path, "%s/%s", dir, json_string_value(val));
        for (int i = 0; i < s->n_files; i++)
            if (!strcmp(s->files[i]->path, path) && !st_find(s->files[i], key)) {
                rc = util_err_set(err, KVLM_EFORMAT, "%s: the index puts tensor %s in %s, which does not hold it",
                                  ipath, key, json_string_value(val));
                goto done;
            }
    }
done:
    json_decref(root);
    return rc;
}

st_set *st_set_open_dir(const char *dir, int map_flags, kvlm_error *err) {
    st_set *s = calloc(1, sizeof *s);
    if (!s) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    char path[4096];
    int rc;
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (access(path, F_OK) == 0) rc = open_index(s, dir, path, map_flags, err);
    else {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (access(path, F_OK) != 0)
            rc = util_err_set(err, KVLM_EIO, "%s: no model.safetensors or model.safetensors.index.json "
                              "(a Hugging Face model directory holds one of them)", dir);
        else rc = add_file(s, path, map_flags, err);
    }
    if (!rc && s->n_files == 0) rc = util_err_set(err, KVLM_EFORMAT, "%s: the index names no shards", dir);
    for (int i = 0; i < s->n_files && !rc; i++) {
        s->n_index += s->files[i]->n_tensors;
        for (int k = 0; k < s->files[i]->n_tensors; k++) s->total_bytes += s->files[i]->tensors[k].nbytes;
    }
    if (!rc && !(s->index = malloc((size_t)(s->n_index ? s->n_index : 1) * sizeof *s->index)))
        rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
    if (!rc) {
        int n = 0;
        for (int i = 0; i < s->n_files; i++)
            for (int k = 0; k < s->files[i]->n_tensors; k++) s->index[n++] = &s->files[i]->tensors[k];
        qsort(s->index, (size_t)n, sizeof *s->index, cmp_index);
        for (int i = 1; i < n && !rc; i++)
            if (!strcmp(s->index[i - 1]->name, s->index[i]->name))
                rc = util_err_set(err, KVLM_EFORMAT, "%s: tensor %s is in two shards (%s and %s)", dir,
                                  s->index[i]->name, s->files[s->index[i - 1]->file]->path,
                                  s->files[s->index[i]->file]->path);
    }
    if (rc) {
        st_set_close(s);
        return NULL;
    }
    return s;
}
