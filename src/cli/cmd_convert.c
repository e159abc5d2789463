/* cli/cmd_convert: `kvlm convert` (any model -> GGUF, optionally quantized)
 * and `kvlm synth` (a random-weight GGUF model of any shape). */
#include <stdio.h>
#include <string.h>
#include "cli/cli.h"
#include "cli/progress.h"

int cmd_convert(int argc, char **argv) {
    const char *in = NULL, *out = NULL, *type_name = NULL, *tok_path = NULL;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm convert IN OUT.gguf [--type T] [--tokenizer FILE]\n\n"
                   "Writes IN (GGUF, llama2.c .bin with its tokenizer.bin, or a Hugging Face model\n"
                   "directory: docs/hf-checkpoints.md) as a GGUF v3 file with\n"
                   "its hyper-parameters and tokenizer. --type converts the 2-D weights (norms stay\n"
                   "f32; a tensor whose rows do not fit the type's block falls back to a smaller block\n"
                   "type, as llama.cpp's quantizer does). Default: keep each tensor's type.\n"
                   "T: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q4_k q5_k q6_k q2_k q3_k iq4_nl iq4_xs\n"
                   "   iq3_s iq3_xxs iq2_s iq2_xs iq2_xxs iq1_m iq1_s (the codebook types: least squares\n"
                   "   without an importance matrix, microseconds per weight, on every core)\n"
                   "   mxfp4 (gpt-oss's 4-bit floats) tq2_0 tq1_0 (ternary: for models trained so)\n"
                   "On a terminal, stderr shows the progress of loading, converting and writing.\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, NULL, "--type", &type_name, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--tokenizer", &tok_path, &bad)) {}
        else if (argv[i][0] == '-') return cli_fail("convert", "unknown option '%s'", argv[i]);
        else if (!in) in = argv[i];
        else if (!out) out = argv[i];
        else return cli_fail("convert", "too many arguments");
        if (bad) return 1;
    }
    if (!in || !out) return cli_fail("convert", "usage: kvlm convert IN OUT.gguf [--type T]");
    int type = -1;
    if (type_name && (type = kvlm_type_from_name(type_name)) < 0)
        return cli_fail("convert", "unknown type '%s' (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, q2_k, q3_k, iq4_nl, iq4_xs, iq3_s, iq3_xxs, iq2_s, iq2_xs, iq2_xxs, iq1_m, iq1_s, mxfp4, tq2_0, tq1_0)", type_name);
    kvlm_error err = {0};
    kvlm_model_params mp = {0};
    mp.tokenizer_path = tok_path;
    kvlm_model *m = cli_model_load(in, &mp, &err);
    if (!m) return cli_fail("convert", "%s", err.msg);
    cli_progress pr;
    cli_progress_begin(&pr, "writing %s%s%s", out, type >= 0 ? " as " : "", type >= 0 ? kvlm_type_name(type) : "");
    int rc = kvlm_model_save_gguf_progress(m, out, type, pr.on ? cli_progress_callback : NULL, &pr, &err);
    cli_progress_end(&pr);
    kvlm_model_free(m);
    if (rc) return cli_fail("convert", "%s", err.msg);
    fprintf(stderr, "kvlm convert: wrote %s\n", out);
    return 0;
}

int cmd_synth(int argc, char **argv) {
    kvlm_synth_params p = {0};
    p.arch = KVLM_ARCH_LLAMA;
    p.dim = 64; p.hidden_dim = 160; p.n_layers = 2; p.n_heads = 8; p.n_kv_heads = 0;
    p.vocab_size = 512; p.n_ctx = 2048; p.type = 0; p.seed = 1;
    const char *out = NULL, *arch = NULL, *type_name = NULL, *gating = NULL, *pooling = NULL;
    for (int i = 1; i < argc; i++) {
        bool bad = false;
        if (cli_is(argv[i], "-h", "--help")) {
            printf("usage: kvlm synth OUT.gguf [--arch llama|smollm3|granite|granitemoe|olmo2|qwen2|qwen2moe|qwen3|qwen3moe|phi3|gpt-oss|deepseek2|gemma2|gemma3|bert|nomic-bert] [--dim D]\n"
                   "       [--hidden F] [--layers L] [--heads H] [--kv-heads K] [--head-dim HD] [--vocab V]\n"
                   "       [--ctx C] [--rope-base B] [--type T] [--tied] [--seed S] [--pooling none|mean|cls|last]\n"
                   "  embeddings (docs/embeddings.md): --pooling writes {arch}.pooling_type; bert and nomic-bert\n"
                   "       (encoders, a WordPiece vocabulary of at least 128 tokens) write mean unless told\n"
                   "  deepseek2 (docs/mla.md): [--q-lora N] [--kv-lora N] [--rope-dim N] [--v-head-dim N]\n"
                   "       [--experts N] [--experts-used K] [--experts-shared S] [--dense-layers D] [--expert-ff F]\n"
                   "       [--gating softmax|sigmoid] [--yarn FACTOR]  (-1 for a count means none; --head-dim is the\n"
                   "       key length; --yarn: YaRN RoPE scaling from a context of ctx / FACTOR)\n"
                   "  Llama 3.1's RoPE scaling: [--rope-llama3 FACTOR] (rope_freqs.weight: the slow pairs' angles\n"
                   "       divided by FACTOR, the fast ones' kept, from an original context of ctx / FACTOR);\n"
                   "       linear: [--rope-linear FACTOR] (every angle divided; gemma3: the global layers');\n"
                   "       YaRN for llama, qwen2, qwen3 too: [--yarn FACTOR]; phi3's LongRoPE: [--longrope FACTOR]\n"
                   "       (rope_factors_long/short.weight, from an original context of ctx / FACTOR); phi3's partial\n"
                   "       rotation (Phi-4-mini): [--rope-dim N]\n"
                   "  experts: Mixtral's (llama): [--experts N] [--experts-used K] (each expert the FFN's width);\n"
                   "       qwen3moe: the same and [--expert-ff F] (default 4 of 2, hidden / 2 wide); granitemoe:\n"
                   "       Mixtral's, and [--experts-shared S] for a shared expert S experts wide (MoE Shared)\n"
                   "  sliding window, gemma2/3 (docs/sliding-window.md): [--sliding-window W]\n"
                   "       [--attn-softcap X] [--final-softcap X]\n\n"
                   "Writes a model with random weights (and a small SentencePiece-style vocabulary):\n"
                   "the same cost to run as a real model of that shape. Defaults: llama, dim 64,\n"
                   "hidden 160, 2 layers, 8 heads, kv heads = heads, vocab 512, ctx 2048, f32.\n"
                   "--sliding-window W: llama with every layer local (Mistral-style), or gemma's local\n"
                   "layers' window (default 16 for synthetic gemma); gemma2's soft-caps default to 50 and\n"
                   "30 (a negative value: none). See docs/sliding-window.md.\n"
                   "On a terminal, stderr shows the progress.\n");
            return 0;
        } else if (cli_opt_str(argc, argv, &i, NULL, "--arch", &arch, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--dim", &p.dim, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--hidden", &p.hidden_dim, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--layers", &p.n_layers, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--heads", &p.n_heads, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--kv-heads", &p.n_kv_heads, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--head-dim", &p.head_dim, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--vocab", &p.vocab_size, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--ctx", &p.n_ctx, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--rope-base", &p.rope_base, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--type", &type_name, &bad)) {}
        else if (cli_opt_u64(argc, argv, &i, NULL, "--seed", &p.seed, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--q-lora", &p.q_lora_rank, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--kv-lora", &p.kv_lora_rank, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--rope-dim", &p.rope_dim, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--v-head-dim", &p.v_head_dim, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--experts", &p.n_expert, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--experts-used", &p.n_expert_used, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--experts-shared", &p.n_expert_shared, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--dense-layers", &p.n_dense_lead, &bad)) {}
        else if (cli_opt_int(argc, argv, &i, NULL, "--expert-ff", &p.expert_ff, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--gating", &gating, &bad)) {}
        else if (cli_opt_str(argc, argv, &i, NULL, "--pooling", &pooling, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--yarn", &p.yarn_factor, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--rope-llama3", &p.rope_llama3, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--rope-linear", &p.rope_linear, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--longrope", &p.longrope, &bad)) {}
        else if (cli_is(argv[i], NULL, "--tied")) p.tied_output = true;
        else if (cli_opt_int(argc, argv, &i, NULL, "--sliding-window", &p.sliding_window, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--attn-softcap", &p.attn_softcap, &bad)) {}
        else if (cli_opt_float(argc, argv, &i, NULL, "--final-softcap", &p.final_softcap, &bad)) {}
        else if (argv[i][0] == '-') return cli_fail("synth", "unknown option '%s'", argv[i]);
        else if (!out) out = argv[i];
        else return cli_fail("synth", "too many arguments");
        if (bad) return 1;
    }
    if (!out) return cli_fail("synth", "no output file given");
    if (arch) {
        if (!strcmp(arch, "llama")) p.arch = KVLM_ARCH_LLAMA;
        else if (!strcmp(arch, "smollm3")) p.arch = KVLM_ARCH_SMOLLM3;
        else if (!strcmp(arch, "granite")) p.arch = KVLM_ARCH_GRANITE;
        else if (!strcmp(arch, "granitemoe")) p.arch = KVLM_ARCH_GRANITEMOE;
        else if (!strcmp(arch, "olmo2")) p.arch = KVLM_ARCH_OLMO2;
        else if (!strcmp(arch, "qwen2")) p.arch = KVLM_ARCH_QWEN2;
        else if (!strcmp(arch, "qwen3")) p.arch = KVLM_ARCH_QWEN3;
        else if (!strcmp(arch, "qwen3moe")) p.arch = KVLM_ARCH_QWEN3MOE;
        else if (!strcmp(arch, "qwen2moe")) p.arch = KVLM_ARCH_QWEN2MOE;
        else if (!strcmp(arch, "phi3")) p.arch = KVLM_ARCH_PHI3;
        else if (!strcmp(arch, "deepseek2")) p.arch = KVLM_ARCH_DEEPSEEK2;
        else if (!strcmp(arch, "gemma2")) p.arch = KVLM_ARCH_GEMMA2;
        else if (!strcmp(arch, "gemma3")) p.arch = KVLM_ARCH_GEMMA3;
        else if (!strcmp(arch, "gpt-oss")) p.arch = KVLM_ARCH_GPTOSS;
        else if (!strcmp(arch, "bert")) p.arch = KVLM_ARCH_BERT;
        else if (!strcmp(arch, "nomic-bert")) p.arch = KVLM_ARCH_NOMIC_BERT;
        else return cli_fail("synth", "unknown architecture '%s' (llama, smollm3, granite, granitemoe, olmo2, qwen2, qwen2moe, qwen3, qwen3moe, phi3, deepseek2, gemma2, gemma3, gpt-oss, bert, nomic-bert)", arch);
    }
    if (pooling) {
        int pt = kvlm_pooling_from_name(pooling);
        if (pt < 0) return cli_fail("synth", "unknown pooling '%s' (none, mean, cls, last, rank)", pooling);
        p.pooling_plus1 = pt + 1;
    }
    if (gating) {
        if (!strcmp(gating, "softmax")) p.expert_gating = 1;
        else if (!strcmp(gating, "sigmoid")) p.expert_gating = 2;
        else return cli_fail("synth", "unknown gating '%s' (softmax, sigmoid)", gating);
    }
    if (type_name && (p.type = kvlm_type_from_name(type_name)) < 0)
        return cli_fail("synth", "unknown type '%s'", type_name);
    kvlm_error err = {0};
    cli_progress pr;
    cli_progress_begin(&pr, "writing %s", out);
    if (pr.on) {
        p.progress_callback = cli_progress_callback;
        p.progress_callback_user_data = &pr;
    }
    int rc = kvlm_model_synth(&p, out, &err);
    cli_progress_end(&pr);
    if (rc) return cli_fail("synth", "%s", err.msg);
    return 0;
}
