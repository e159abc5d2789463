/* tok/json_schema: JSON schemas as GBNF (the public calls are in kvlm.h:
 * kvlm_json_schema_to_gbnf); here, several schemas in one grammar (a tool
 * call grammar holds each tool's arguments, and each of an XML format's
 * parameters, to its own schema). */
#ifndef KVLM_TOK_JSON_SCHEMA_H
#define KVLM_TOK_JSON_SCHEMA_H
#include <jansson.h>
#include "kvlm.h"

typedef struct tok_schema_item {
    json_t *doc;        /* the document its $refs point into */
    json_t *schema;     /* the schema (doc itself, or a part of it) */
    const char *name;   /* the rule its values get (no "_" in the rules made for it: names with one are the caller's) */
    const char *hint;   /* a hint for its inner rules' names, or NULL */
    const char *path;   /* where it is in doc, for messages ("/properties/x"), or NULL */
    const char *what;   /* a prefix for its errors ("tool 'f'"), or NULL */
} tok_schema_item;
/* The rules of every item's values, and JSON's shared ones (ws, string,
 * value, ...) once; no root rule. NULL with err as kvlm_json_schema_to_gbnf
 * fills it (prefixed by what). */
char *tok_json_schemas_gbnf(const tok_schema_item *items, int n, kvlm_error *err);
#endif
