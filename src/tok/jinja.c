/* tok/jinja: the arena every parse and render allocates from, and the public
 * calls (kvlm_template_*) over the interpreter. */
#include <stdlib.h>
#include <string.h>
#include "tok/jinja_internal.h"
#include "util/error.h"

struct jarena_chunk {
    jarena_chunk *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
};

#define CHUNK (64u << 10)
#define ROUND16(n) (((n) + 15) & ~(size_t)15)

/* A block of its own for a large allocation, kept behind the chunk in use. */
static void *big_alloc(jarena *a, size_t n) {
    if (a->limit && (n > a->limit || a->total + n > a->limit)) { a->over = true; return NULL; }
    jarena_chunk *c = malloc(sizeof *c + n);
    if (!c) return NULL;
    c->used = c->cap = n;
    a->total += sizeof *c + n;
    if (a->head) {
        c->next = a->head->next;
        a->head->next = c;
    } else {
        c->next = NULL;
        a->head = c;
    }
    return c->data;
}

void *ja_alloc(jarena *a, size_t n) {
    if (n > ((size_t)1 << 46)) { a->over = true; return NULL; }
    n = ROUND16(n ? n : 1);
    jarena_chunk *c = a->head;
    if (c && c->cap - c->used >= n) {
        void *p = c->data + c->used;
        c->used += n;
        return p;
    }
    if (n > CHUNK / 4) return big_alloc(a, n);
    size_t cap = CHUNK - sizeof *c;
    if (a->limit && a->total + CHUNK > a->limit) { a->over = true; return NULL; }
    c = malloc(sizeof *c + cap);
    if (!c) return NULL;
    c->cap = cap;
    c->used = n;
    c->next = a->head;
    a->head = c;
    a->total += CHUNK;
    return c->data;
}

void *ja_grow(jarena *a, void *p, size_t old, size_t n) {
    if (!p) return ja_alloc(a, n);
    if (n <= old) return p;
    if (n > ((size_t)1 << 46)) { a->over = true; return NULL; }
    jarena_chunk *c = a->head;
    size_t o16 = ROUND16(old), n16 = ROUND16(n);
    /* the last allocation of the chunk in use grows in place */
    if (c && (unsigned char *)p + o16 == c->data + c->used && c->used - o16 + n16 <= c->cap) {
        c->used = c->used - o16 + n16;
        return p;
    }
    /* a large block behind the head: reallocated */
    jarena_chunk *b = c ? c->next : NULL;
    if (b && b->data == p && b->used == old && n > CHUNK / 4) {
        if (a->limit && a->total + (n - old) > a->limit) { a->over = true; return NULL; }
        jarena_chunk *nb = realloc(b, sizeof *b + n);
        if (!nb) return NULL;
        nb->used = nb->cap = n;
        a->total += n - old;
        c->next = nb;
        return nb->data;
    }
    void *q = ja_alloc(a, n);
    if (q) memcpy(q, p, old);
    return q;
}

void ja_free(jarena *a) {
    for (jarena_chunk *c = a->head, *next; c; c = next) {
        next = c->next;
        free(c);
    }
    a->head = NULL;
    a->total = 0;
}

void jinja_free(jinja_template *t) {
    if (!t) return;
    ja_free(&t->arena);
    free(t);
}

/* ---- public API ---- */

struct kvlm_template {
    jinja_template *t;
};

kvlm_template *kvlm_template_parse(const char *src, size_t len, kvlm_error *err) {
    kvlm_template *k = malloc(sizeof *k);
    if (!k) { util_err_set(err, KVLM_ENOMEM, "out of memory"); return NULL; }
    if (!(k->t = jinja_parse(src, len, err))) { free(k); return NULL; }
    return k;
}

void kvlm_template_free(kvlm_template *t) {
    if (!t) return;
    jinja_free(t->t);
    free(t);
}

int kvlm_template_render_opts(const kvlm_template *t, const char *vars_json, const kvlm_template_opts *o, char **out,
                              size_t *out_len, kvlm_error *err) {
    if (!t || !out) return util_err_set(err, KVLM_EINVAL, "no template or no place for the text");
    *out = NULL;
    json_t *vars = NULL;
    if (vars_json && *vars_json) {
        json_error_t je;
        vars = json_loads(vars_json, JSON_ALLOW_NUL, &je);
        if (!vars) return util_err_set(err, KVLM_EINVAL, "the variables: line %d: %s", je.line, je.text);
        if (!json_is_object(vars)) {
            json_decref(vars);
            return util_err_set(err, KVLM_EINVAL, "the variables must be a JSON object");
        }
    }
    jinja_opts jo = {0};
    if (o) {
        jo.max_output = o->max_output;
        jo.max_steps = o->max_steps;
        jo.max_depth = o->max_depth;
        jo.now = o->now;
    }
    size_t len = 0;
    char *s = jinja_render(t->t, vars, &jo, &len, err);
    json_decref(vars);
    if (!s) return err ? err->code : KVLM_EINVAL;
    *out = s;
    if (out_len) *out_len = len;
    return 0;
}

int kvlm_template_render(const kvlm_template *t, const char *vars_json, char **out, size_t *out_len, kvlm_error *err) {
    return kvlm_template_render_opts(t, vars_json, NULL, out, out_len, err);
}
