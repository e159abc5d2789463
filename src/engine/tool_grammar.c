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
#include "tok/chat.h"
#include "util/error.h"

static const json_t *fn_of(const json_t *t) {
    const json_t *f = json_object_get(t, "function");
    return json_is_object(f) ? f : t;
}

kvlm_grammar *eng_tool_grammar(const kvlm_model *model, const tok_chat_syntax *s, const char *prompt_tail,
                               const json_t *tools, const char *only, bool lazy, bool parallel, kvlm_error *err) {
    if (tok_chat_tools_check(tools, err)) return NULL;
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

int kvlm_chat_tool_grammar(const kvlm_chat *chat, const char *prompt, size_t prompt_len, const char *tools_json,
                           const char *tool_choice_json, bool parallel, kvlm_grammar **grammar, kvlm_error *err) {
    *grammar = NULL;
    json_t *tools = tools_json ? json_loads(tools_json, 0, NULL) : NULL;
    json_t *choice = tool_choice_json ? json_loads(tool_choice_json, JSON_DECODE_ANY, NULL) : NULL;
    int rc = KVLM_OK;
    const char *name = NULL;
    if ((tools_json && !tools) || (tool_choice_json && !choice)) rc = util_err_set(err, KVLM_EINVAL, "'tools' or 'tool_choice' is not JSON");
    else if (json_is_array(tools) && json_array_size(tools) && tok_chat_tools_check(tools, err)) rc = KVLM_EINVAL;
    if (!rc) {
        int mode = tok_chat_tool_choice(json_is_array(tools) ? tools : NULL, choice, &name, NULL, err);
        if (mode < 0) rc = KVLM_EINVAL;
        else if (mode != TOK_CHOICE_NONE) {
            enum { TAIL = 256 };
            char tail[TAIL + 1];
            size_t k = prompt_len > TAIL ? TAIL : prompt_len;
            if (prompt && k) memcpy(tail, prompt + prompt_len - k, k);
            tail[k] = 0;
            kvlm_error ge = {0};
            *grammar = eng_tool_grammar(tok_chat_model(chat), tok_chat_syntax_of(chat), tail, tools,
                                        mode == TOK_CHOICE_NAMED ? name : NULL, mode == TOK_CHOICE_AUTO, parallel, &ge);
            if (!*grammar && !(ge.code == KVLM_EUNSUPPORTED && mode == TOK_CHOICE_AUTO)) {
                if (err) *err = ge;
                rc = ge.code ? ge.code : KVLM_EINVAL;
            }
        }
    }
    json_decref(tools);
    json_decref(choice);
    return rc;
}
