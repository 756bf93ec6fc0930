/* model.c - the model description of stress and stress --mpi (model.h). */
#include "common/model.h"

cli_model cli_model_default(void)
{
    return (cli_model){.layers = 1, .heads = 32, .kv_heads = 8, .head_dim = 128,
                       .dtype = PKV_F16};
}

void cli_model_opts(cli_model *m, cli_opt *o)
{
    const cli_opt t[CLI_MODEL_NOPTS] = {
        {.name = "model-preset", .kind = OPT_CALL, .dst = &m->preset,
         .call = cli_opt_any_preset,
         .what = "a preset: one of " CLI_PRESET_NAMES ", " CLI_VARIANT_PRESET_NAMES},
        {.name = "layers", .kind = OPT_U32, .dst = &m->layers, .lo = 1, .hi = UINT32_MAX,
         .seen = &m->set_layers},
        {.name = "heads", .kind = OPT_U32, .dst = &m->heads, .lo = 1, .hi = UINT32_MAX,
         .seen = &m->set_heads},
        {.name = "kv-heads", .kind = OPT_U32, .dst = &m->kv_heads, .lo = 1,
         .hi = CLI_MAX_KV_HEADS, .note = "the engine's limit", .seen = &m->set_kv},
        {.name = "head-dim", .kind = OPT_U32, .dst = &m->head_dim, .lo = 1,
         .hi = CLI_MAX_HEAD_DIM, .note = "the engine's limit", .seen = &m->set_dim},
        {.name = "head-dim-v", .kind = OPT_U32, .dst = &m->head_dim_v, .lo = 1,
         .hi = CLI_MAX_HEAD_DIM, .note = "the engine's limit", .seen = &m->set_dv},
        {.name = "dtype", .kind = OPT_DTYPE, .dst = &m->dtype},
        {.name = "block-tokens", .kind = OPT_U32, .dst = &m->block_tokens, .lo = 1,
         .hi = UINT32_MAX},
        {.name = "window", .kind = OPT_U32, .dst = &m->v.window, .lo = 0, .hi = UINT32_MAX,
         .seen = &m->set_w},
        {.name = "sinks", .kind = OPT_U32, .dst = &m->v.sinks, .lo = 0, .hi = UINT32_MAX,
         .seen = &m->set_s},
        {.name = "rollback", .kind = OPT_U32, .dst = &m->v.rollback, .lo = 0,
         .hi = UINT32_MAX, .seen = &m->set_r},
        {.name = "softcap", .kind = OPT_DOUBLE, .dst = &m->v.softcap, .dlo = 0, .dhi = 1e30,
         .seen = &m->set_c},
        {.name = "sink-logits", .kind = OPT_FLAG, .dst = &m->v.sink_logits},
    };
    for (uint32_t i = 0; i < CLI_MODEL_NOPTS; i++)
        o[i] = t[i];
}

int cli_model_resolve(const char *cmd, cli_model *m)
{
    const cli_variant_preset *vp = m->preset ? cli_variant_preset_find(m->preset) : NULL;
    const cli_preset *p = m->preset && !vp ? cli_preset_find(m->preset) : NULL;
    if (m->preset && !vp && !p)
        return cli_usage_error(cmd, "--model-preset: '%s' is not a preset: one of "
                               CLI_PRESET_NAMES ", " CLI_VARIANT_PRESET_NAMES, m->preset);
    if (vp) {
        /* a real model's pattern: its geometry and variant, each flag overriding its part */
        const cli_variant given = m->v;
        m->v = vp->v;
        if (m->set_w) m->v.window = given.window;
        if (m->set_s) m->v.sinks = given.sinks;
        if (m->set_r) m->v.rollback = given.rollback;
        if (m->set_c) m->v.softcap = given.softcap;
        m->v.sink_logits = m->v.sink_logits || given.sink_logits;
        if (!m->set_layers) m->layers = vp->layers;
        if (!m->set_heads) m->heads = vp->heads;
        if (!m->set_kv) m->kv_heads = vp->kv_heads;
        if (!m->set_dim) m->head_dim = vp->head_dim;
        if (!m->set_dv) m->head_dim_v = vp->head_dim_v;
    } else if (p) {
        if (!m->set_layers) m->layers = p->layers;
        if (!m->set_heads) m->heads = p->heads;
        if (!m->set_kv) m->kv_heads = p->kv_heads;
        if (!m->set_dim) m->head_dim = p->head_dim;
    }
    if (cli_variant_check(cmd, &m->v) != CLI_OK)
        return CLI_USAGE;
    if (m->heads % m->kv_heads != 0)
        return cli_usage_error(cmd, "--heads (%u) must be a multiple of --kv-heads (%u)",
                               m->heads, m->kv_heads);
    pkv_config c = cli_config(m->layers, m->heads, m->kv_heads, m->head_dim,
                              m->block_tokens, m->dtype, 1);
    c.head_dim_v = m->head_dim_v;
    return cli_check_limits(cmd, &c, NULL);
}

void cli_model_usage(FILE *f)
{
    fputs("geometry (default: llama3-8b heads with 1 layer):\n"
          "  --model-preset NAME  llama3-8b, llama3-70b, mistral-7b, llama2-7b, mqa, mha,\n"
          "                       d64, d256, or a real model's attention pattern:\n"
          "                       gemma2-9b, gpt-oss-20b, deepseek-v3 (docs/variants.md);\n"
          "                       explicit flags below override it\n"
          "  --layers L --heads H --kv-heads G --head-dim D   (H % G == 0)\n"
          "  --dtype T            K/V storage type: f32, f16 (default), bf16, q8, q4\n"
          "  --block-tokens N     tokens per page (default: the library's, 16)\n"
          "  --head-dim-v N       width of V rows (default: --head-dim; MLA: 512)\n"
          "variants (docs/variants.md; every layer, or the preset's windowed layers):\n"
          "  --window W           sliding window: a decode reads the last W positions\n"
          "                       (0 = full causal); memory and latency stay flat in\n"
          "                       context, pages held are checked against the ceiling\n"
          "                       ceil(S/bt) + ceil((W+R)/bt) + 1 per windowed layer\n"
          "  --sinks S            with --window: the first S positions are kept too\n"
          "  --rollback R         with --window: R more positions kept for truncates\n"
          "  --softcap C          logit soft-cap C*tanh(s/C) on every layer (0 = none)\n"
          "  --sink-logits        a learned sink logit per head on every layer\n",
          f);
}
