/* tok/tool_grammar: the GBNF text that holds tool calls to a family's
 * syntax (tok/chat_grammar) and each tool's arguments to its parameters'
 * JSON schema (tok/json_schema): the whole answer for tool_choice required
 * or a named function, a lazy grammar from a call's first word on for auto
 * (docs/tool-calls.md). engine/grammar compiles it (kvlm_chat_tool_grammar). */
#include "tok/tool_grammar.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <jansson.h>
#include "tok/chat.h"
#include "tok/json_schema.h"
#include "util/error.h"

static const json_t *fn_of(const json_t *t) {
    const json_t *f = json_object_get(t, "function");
    return json_is_object(f) ? f : t;
}

int tok_tool_gbnf_make(const tok_chat_syntax *s, const char *prompt_tail, const json_t *tools, const char *only,
                       bool lazy, bool parallel, tok_tool_gbnf *out, kvlm_error *err) {
    *out = (tok_tool_gbnf){0};
    out->syntax = tok_chat_syntax_name(s);
    if (tok_chat_tools_check(tools, err)) return err && err->code ? err->code : KVLM_EINVAL;
    size_t nt = json_array_size(tools), n_items = 1, n_props = 0;
    for (size_t i = 0; i < nt; i++) {
        const json_t *pr = json_object_get(json_object_get(fn_of(json_array_get(tools, i)), "parameters"), "properties");
        n_props += json_is_object(pr) ? json_object_size(pr) : 0;
    }
    tok_schema_item *items = calloc(nt + n_props + 1, sizeof *items);
    tok_chat_gbnf_tool *gt = calloc(nt ? nt : 1, sizeof *gt);
    char (*names)[32] = calloc(nt + n_props + 1, sizeof *names);
    const char **pnames = calloc(n_props + 1, sizeof *pnames), **prules = calloc(n_props + 1, sizeof *prules);
    const json_t **pschemas = calloc(n_props + 1, sizeof *pschemas);
    bool *preq = calloc(n_props + 1, sizeof *preq);
    char (*whats)[96] = calloc(nt + 1, sizeof *whats);
    char (*paths)[160] = calloc(n_props + 1, sizeof *paths);
    json_t *object = json_pack("{s:s}", "type", "object"), *any = json_true();
    int rc = KVLM_OK;
    char *family = NULL, *json_rules = NULL;
    kvlm_grammar_trigger *trig = NULL;
    int n_trig = 0, n_gt = 0;
    if (!items || !gt || !names || !pnames || !prules || !pschemas || !preq || !whats || !paths || !object) {
        rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto done;
    }
    items[0] = (tok_schema_item){any, any, "tc_any", NULL, NULL, NULL};
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
        items[n_items] = (tok_schema_item){params, params, names[n_items], name, NULL, whats[t]};
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
            items[n_items] = (tok_schema_item){params, ps, names[n_items], key, paths[pk], whats[t]};
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
        rc = util_err_set(err, KVLM_EINVAL, "no tool is named '%.64s'", only ? only : "");
        goto done;
    }
    if (!(family = tok_chat_syntax_gbnf(s, gt, n_gt, parallel, lazy, prompt_tail, &trig, &n_trig, err)) ||
        !(json_rules = tok_json_schemas_gbnf(items, (int)n_items, err))) {
        rc = err && err->code ? err->code : KVLM_EINVAL;
        goto done;
    }
    size_t lf = strlen(family), lj = strlen(json_rules);
    if (!(out->gbnf = malloc(lf + lj + 1))) {
        rc = util_err_set(err, KVLM_ENOMEM, "out of memory");
        goto done;
    }
    memcpy(out->gbnf, family, lf);
    memcpy(out->gbnf + lf, json_rules, lj + 1);
    if (lazy) { /* the words that wake it: the caller's now */
        out->triggers = trig;
        out->n_triggers = n_trig;
        trig = NULL;
        n_trig = 0;
    }
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
    return rc;
}

void tok_tool_gbnf_free(tok_tool_gbnf *t) {
    if (!t) return;
    free(t->gbnf);
    tok_chat_triggers_free(t->triggers, t->n_triggers);
    *t = (tok_tool_gbnf){0};
}

int tok_chat_tool_gbnf(const kvlm_chat *chat, const char *prompt, size_t prompt_len, const char *tools_json,
                       const char *tool_choice_json, bool parallel, tok_tool_gbnf *out, kvlm_error *err) {
    *out = (tok_tool_gbnf){0};
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
            int grc = tok_tool_gbnf_make(tok_chat_syntax_of(chat), tail, tools, mode == TOK_CHOICE_NAMED ? name : NULL,
                                         mode == TOK_CHOICE_AUTO, parallel, out, &ge);
            if (grc && !(ge.code == KVLM_EUNSUPPORTED && mode == TOK_CHOICE_AUTO)) {
                if (err) *err = ge;
                rc = ge.code ? ge.code : KVLM_EINVAL;
            }
        }
    }
    json_decref(tools);
    json_decref(choice);
    return rc;
}
