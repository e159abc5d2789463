/* engine/tool_grammar: the grammar that holds tool calls to a family's
 * syntax (tok/chat_grammar) and each tool's arguments to its parameters'
 * JSON schema (engine/json_schema): the whole answer for tool_choice
 * required or a named function, a lazy grammar from a call's first word on
 * for auto (docs/tool-calls.md). */
#include "engine/tool_grammar.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "engine/json_schema.h"
#include "util/error.h"

static const json_t *fn_of(const json_t *t) {
    const json_t *f = json_object_get(t, "function");
    return json_is_object(f) ? f : t;
}

int eng_tools_check(const json_t *tools, kvlm_error *err) {
    if (!json_is_array(tools)) return util_err_set(err, KVLM_EINVAL, "'tools' must be an array");
    size_t i;
    const json_t *t;
    json_array_foreach(tools, i, t) {
        if (!json_is_object(t)) return util_err_set(err, KVLM_EINVAL, "'tools[%zu]' must be an object", i);
        const char *type = json_string_value(json_object_get(t, "type"));
        if (json_object_get(t, "type") && (!type || strcmp(type, "function")))
            return util_err_set(err, KVLM_EINVAL, "'tools[%zu].type' must be \"function\"", i);
        const json_t *f = json_object_get(t, "function");
        if (!json_is_object(f)) return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function' must be an object", i);
        const char *name = json_string_value(json_object_get(f, "name"));
        size_t nl = name ? strlen(name) : 0;
        if (!nl || nl > 64) /* OpenAI's rule: a-z, A-Z, 0-9, underscores and dashes, at most 64 */
            return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function.name' must be a string of 1 to 64 characters", i);
        for (size_t k = 0; k < nl; k++) {
            char c = name[k];
            if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' || c == '.'))
                return util_err_set(err, KVLM_EINVAL,
                                    "'tools[%zu].function.name' '%s' may only have letters, digits, '_', '-' and '.'", i, name);
        }
        for (size_t j = 0; j < i; j++)
            if (!strcmp(json_string_value(json_object_get(fn_of(json_array_get(tools, j)), "name")), name))
                return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function.name' '%s' is the name of tools[%zu] too", i, name, j);
        const json_t *p = json_object_get(f, "parameters");
        if (p && !json_is_object(p))
            return util_err_set(err, KVLM_EINVAL, "'tools[%zu].function.parameters' must be an object (a JSON schema)", i);
    }
    return KVLM_OK;
}

kvlm_grammar *eng_tool_grammar(const kvlm_model *model, const tok_chat_syntax *s, const char *prompt_tail,
                               const json_t *tools, const char *only, bool lazy, bool parallel, kvlm_error *err) {
    if (eng_tools_check(tools, err)) return NULL;
    size_t nt = json_array_size(tools), n_items = 1, n_props = 0;
    for (size_t i = 0; i < nt; i++) {
        const json_t *pr = json_object_get(json_object_get(fn_of(json_array_get(tools, i)), "parameters"), "properties");
        n_props += json_is_object(pr) ? json_object_size(pr) : 0;
    }
    eng_schema_item *items = calloc(nt + n_props + 1, sizeof *items);
    tok_chat_gbnf_tool *gt = calloc(nt ? nt : 1, sizeof *gt);
    char (*names)[32] = calloc(nt + n_props + 1, sizeof *names);
    const char **pnames = calloc(n_props + 1, sizeof *pnames), **prules = calloc(n_props + 1, sizeof *prules);
    const json_t **pschemas = calloc(n_props + 1, sizeof *pschemas);
    bool *preq = calloc(n_props + 1, sizeof *preq);
    char (*whats)[96] = calloc(nt + 1, sizeof *whats);
    char (*paths)[160] = calloc(n_props + 1, sizeof *paths);
    json_t *object = json_pack("{s:s}", "type", "object"), *any = json_true();
    kvlm_grammar *g = NULL;
    char *family = NULL, *json_rules = NULL;
    kvlm_grammar_trigger *trig = NULL;
    int n_trig = 0, n_gt = 0;
    if (!items || !gt || !names || !pnames || !prules || !pschemas || !preq || !whats || !paths || !object) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto done;
    }
    items[0] = (eng_schema_item){any, any, "tc_any", NULL, NULL, NULL};
    size_t pk = 0;
    for (size_t i = 0; i < nt; i++) {
        const json_t *f = fn_of(json_array_get(tools, i));
        const char *name = json_string_value(json_object_get(f, "name"));
        if (only && strcmp(only, name)) continue;
        json_t *params = json_object_get(f, "parameters");
        if (!params) params = object;
        int t = n_gt++;
        snprintf(names[n_items], sizeof names[n_items], "tc_args%d", t);
        snprintf(whats[t], sizeof whats[t], "tools[%zu] ('%.40s') parameters", i, name);
        items[n_items] = (eng_schema_item){params, params, names[n_items], name, NULL, whats[t]};
        gt[t].name = name;
        gt[t].args_rule = names[n_items++];
        gt[t].prop_names = pnames + pk;
        gt[t].prop_schemas = pschemas + pk;
        gt[t].prop_rules = prules + pk;
        gt[t].prop_required = preq + pk;
        const json_t *props = json_object_get(params, "properties"), *req = json_object_get(params, "required");
        const char *key;
        json_t *ps;
        json_object_foreach((json_t *)props, key, ps) {
            snprintf(names[n_items], sizeof names[n_items], "tc_p%d_%d", t, gt[t].n_props);
            snprintf(paths[pk], sizeof paths[pk], "/properties/%.140s", key);
            items[n_items] = (eng_schema_item){params, ps, names[n_items], key, paths[pk], whats[t]};
            pnames[pk] = key;
            pschemas[pk] = ps;
            prules[pk] = names[n_items++];
            size_t r;
            json_t *x;
            json_array_foreach(req, r, x) if (json_is_string(x) && !strcmp(json_string_value(x), key)) preq[pk] = true;
            pk++;
            gt[t].n_props++;
        }
    }
    if (!n_gt) {
        util_err_set(err, KVLM_EINVAL, "no tool is named '%.64s'", only ? only : "");
        goto done;
    }
    if (!(family = tok_chat_syntax_gbnf(s, gt, n_gt, parallel, lazy, prompt_tail, &trig, &n_trig, err))) goto done;
    if (!(json_rules = eng_json_schemas_gbnf(items, (int)n_items, err))) goto done;
    size_t lf = strlen(family), lj = strlen(json_rules);
    char *all = malloc(lf + lj + 1);
    if (!all) {
        util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto done;
    }
    memcpy(all, family, lf);
    memcpy(all + lf, json_rules, lj + 1);
    kvlm_grammar_opts o = {.triggers = trig, .n_triggers = lazy ? n_trig : 0, .special = true};
    g = kvlm_grammar_compile(model, all, &o, err);
    if (!g) util_err_prefix(err, "the %s tool-call grammar", tok_chat_syntax_name(s));
    free(all);
done:
    tok_chat_triggers_free(trig, n_trig);
    free(family);
    free(json_rules);
    free(items);
    free(gt);
    free(names);
    free(pnames);
    free(prules);
    free(pschemas);
    free(preq);
    free(whats);
    free(paths);
    json_decref(object);
    json_decref(any);
    return g;
}
