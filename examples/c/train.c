/* Trains the example model (see support/src/mlp.rs) through the C API on CPU ranks, one thread each,
 * and prints the mean loss of every step:
 *
 *     step <n> loss <value>
 *
 * Build against the static library, e.g.
 *     cc -O2 -Iinclude examples/c/train.c target/release/libfsdp_fusion.a -lpthread -ldl -lm
 * Usage: train [world_size] [steps]
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp_fusion.h"

enum { LAYERS = 2, WIDTH = 16, INPUTS = 8, BATCH = 4, PASSES = 2, MAX_WORLD = 8, MAX_STEPS = 100 };
static const uint64_t SEED = 7, INIT_SEED = 1;

#define CHECK(call)                                                                      \
    do {                                                                                 \
        fsdp_status status_ = (call);                                                    \
        if (status_ != FSDP_OK) {                                                        \
            fprintf(stderr, "%s failed (%d): %s\n", #call, (int)status_, fsdp_last_error()); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* splitmix64, as fsdp_fusion_support::rng::Rng */
typedef struct { uint64_t state; } rng;
static uint64_t next_u64(rng *r) {
    r->state += 0x9e3779b97f4a7c15ULL;
    uint64_t z = r->state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static float uniform(rng *r) { return (float)(next_u64(r) >> 40) / (float)(1 << 23) - 1.0f; }
static void fill(rng *r, float *out, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) out[i] = uniform(r) * scale;
}

/* Parameter ids in model order: embed, then weight, bias, gain per layer, then the head bias. */
enum { EMBED = 0 };
static size_t weight_id(int l) { return 1 + 3 * (size_t)l; }
static size_t bias_id(int l) { return 2 + 3 * (size_t)l; }
static size_t gain_id(int l) { return 3 + 3 * (size_t)l; }
static const size_t HEAD = 1 + 3 * LAYERS;
enum { NPARAMS = 2 + 3 * LAYERS };

static size_t numel_of(size_t id) {
    if (id == EMBED) return INPUTS * WIDTH;
    if (id == HEAD) return INPUTS;
    return (id - 1) % 3 == 0 ? WIDTH * WIDTH : WIDTH;
}

static void init_params(uint64_t seed, float *values[NPARAMS]) {
    rng r = {seed};
    for (size_t id = 0; id < NPARAMS; id++) values[id] = malloc(numel_of(id) * sizeof(float));
    fill(&r, values[EMBED], INPUTS * WIDTH, 1.0f / sqrtf((float)INPUTS));
    for (int l = 0; l < LAYERS; l++) {
        fill(&r, values[weight_id(l)], WIDTH * WIDTH, 1.0f / sqrtf((float)WIDTH));
        fill(&r, values[bias_id(l)], WIDTH, 0.1f);
        for (int j = 0; j < WIDTH; j++) values[gain_id(l)][j] = 0.5f + 0.25f * uniform(&r);
    }
    fill(&r, values[HEAD], INPUTS, 0.1f);
}

/* c[m x n] = op(a) op(b), op(a) m x k, op(b) k x n, row-major. */
static void matmul(const float *a, int ta, const float *b, int tb, int m, int k, int n, float *c) {
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float s = 0.0f;
            for (int p = 0; p < k; p++)
                s += (ta ? a[p * m + i] : a[i * k + p]) * (tb ? b[j * k + p] : b[p * n + j]);
            c[i * n + j] = s;
        }
}

/* Where a pass reads parameters and sends gradients: the engine, or the teacher's arrays. */
typedef struct {
    fsdp_engine *engine;  /* NULL for the teacher */
    float **values;
} params;

static void hook(params *p, fsdp_status (*f)(fsdp_engine *, int64_t), int64_t unit) {
    if (p->engine) CHECK(f(p->engine, unit));
}

static const float *value(params *p, size_t id) {
    if (!p->engine) return p->values[id];
    const void *data;
    size_t numel;
    uint32_t dtype;
    CHECK(fsdp_engine_param(p->engine, id, &data, &numel, &dtype));
    if (numel != numel_of(id) || dtype != FSDP_F32) {
        fprintf(stderr, "param %zu: unexpected view\n", id);
        exit(1);
    }
    return data;
}

static void layer(params *p, int l, const float *h, float *act, float *out) {
    const float *w = value(p, weight_id(l)), *b = value(p, bias_id(l)), *g = value(p, gain_id(l));
    matmul(h, 0, w, 0, BATCH, WIDTH, WIDTH, act);
    for (int r = 0; r < BATCH; r++)
        for (int j = 0; j < WIDTH; j++) {
            float *a = &act[r * WIDTH + j];
            *a = tanhf(*a + b[j]);
            out[r * WIDTH + j] = h[r * WIDTH + j] + g[j] * *a;
        }
}

static void head(params *p, const float *h, float *out) {
    const float *e = value(p, EMBED), *c = value(p, HEAD);
    matmul(h, 0, e, 1, BATCH, WIDTH, INPUTS, out);
    for (int r = 0; r < BATCH; r++)
        for (int j = 0; j < INPUTS; j++) out[r * INPUTS + j] += c[j];
}

/* One forward and backward pass with every hook; the teacher (no engine) stops after forward. */
static float pass(params *p, const float *x, const float *y, float *out) {
    float hs[LAYERS + 1][BATCH * WIDTH], acts[LAYERS][BATCH * WIDTH];
    hook(p, fsdp_engine_pre_forward, FSDP_ROOT);
    matmul(x, 0, value(p, EMBED), 0, BATCH, INPUTS, WIDTH, hs[0]);
    hook(p, fsdp_engine_post_forward, FSDP_ROOT);
    for (int l = 0; l < LAYERS; l++) {
        hook(p, fsdp_engine_pre_forward, l);
        layer(p, l, hs[l], acts[l], hs[l + 1]);
        hook(p, fsdp_engine_post_forward, l);
    }
    hook(p, fsdp_engine_pre_forward, FSDP_ROOT);
    head(p, hs[LAYERS], out);
    hook(p, fsdp_engine_post_forward, FSDP_ROOT);
    if (!p->engine) return 0.0f;

    const float count = (float)(BATCH * INPUTS);
    float loss = 0.0f, dout[BATCH * INPUTS];
    for (int i = 0; i < BATCH * INPUTS; i++) {
        float d = out[i] - y[i];
        loss += d * d;
        dout[i] = d / count;
    }
    loss = 0.5f * loss / count;

    float dhead[INPUTS] = {0}, dembed[INPUTS * WIDTH], dh[BATCH * WIDTH];
    CHECK(fsdp_engine_pre_backward(p->engine, FSDP_ROOT));
    for (int r = 0; r < BATCH; r++)
        for (int j = 0; j < INPUTS; j++) dhead[j] += dout[r * INPUTS + j];
    CHECK(fsdp_engine_grad(p->engine, HEAD, dhead, INPUTS, FSDP_F32));
    matmul(dout, 1, hs[LAYERS], 0, INPUTS, BATCH, WIDTH, dembed);
    matmul(dout, 0, value(p, EMBED), 0, BATCH, INPUTS, WIDTH, dh);
    CHECK(fsdp_engine_post_backward(p->engine, FSDP_ROOT));
    for (int l = LAYERS - 1; l >= 0; l--) {
        CHECK(fsdp_engine_pre_backward(p->engine, l));
        const float *w = value(p, weight_id(l)), *g = value(p, gain_id(l));
        float dz[BATCH * WIDTH], db[WIDTH] = {0}, back[BATCH * WIDTH];
        for (int r = 0; r < BATCH; r++)
            for (int j = 0; j < WIDTH; j++) {
                float a = acts[l][r * WIDTH + j];
                dz[r * WIDTH + j] = dh[r * WIDTH + j] * g[j] * (1.0f - a * a);
            }
        /* The weight's gradient goes straight into the engine's fp32 slot. */
        float *slot;
        CHECK(fsdp_engine_grad_slot(p->engine, weight_id(l), &slot));
        matmul(hs[l], 1, dz, 0, WIDTH, BATCH, WIDTH, slot);
        CHECK(fsdp_engine_commit_grad(p->engine, weight_id(l)));
        for (int r = 0; r < BATCH; r++)
            for (int j = 0; j < WIDTH; j++) db[j] += dz[r * WIDTH + j];
        CHECK(fsdp_engine_grad(p->engine, bias_id(l), db, WIDTH, FSDP_F32));
        matmul(dz, 0, w, 1, BATCH, WIDTH, WIDTH, back);
        for (int i = 0; i < BATCH * WIDTH; i++) dh[i] += back[i];
        CHECK(fsdp_engine_post_backward(p->engine, l));
    }
    float from_input[INPUTS * WIDTH];
    matmul(x, 1, dh, 0, INPUTS, BATCH, WIDTH, from_input);
    for (int i = 0; i < INPUTS * WIDTH; i++) dembed[i] += from_input[i];
    CHECK(fsdp_engine_grad(p->engine, EMBED, dembed, INPUTS * WIDTH, FSDP_F32));
    return loss;
}

typedef struct {
    fsdp_plan *plan;
    fsdp_local_group *group;
    size_t rank;
    int steps;
    float losses[MAX_STEPS];
} rank_job;

static void *run_rank(void *arg) {
    rank_job *job = arg;
    fsdp_config config;
    CHECK(fsdp_config_default(&config));
    config.double_buffer_limit = 4;
    config.lr = 1e-2f;
    fsdp_engine *engine;
    CHECK(fsdp_engine_create_cpu(job->plan, &config, job->group, job->rank, &engine));
    float *init[NPARAMS], *teacher[NPARAMS];
    init_params(INIT_SEED, init);
    init_params(SEED + 1, teacher);
    for (size_t id = 0; id < NPARAMS; id++)
        CHECK(fsdp_engine_load_param(engine, id, init[id], numel_of(id), FSDP_F32));

    params model = {engine, NULL}, teacher_params = {NULL, teacher};
    for (int step = 0; step < job->steps; step++) {
        float loss = 0.0f;
        for (uint64_t p = 0; p < PASSES; p++) {
            rng r = {SEED ^ ((uint64_t)step << 32) ^ (p << 16) ^ (uint64_t)job->rank};
            float x[BATCH * INPUTS], y[BATCH * INPUTS], out[BATCH * INPUTS];
            fill(&r, x, BATCH * INPUTS, 1.0f);
            pass(&teacher_params, x, NULL, y);
            loss += pass(&model, x, y, out);
        }
        job->losses[step] = loss / PASSES;
        CHECK(fsdp_engine_finish_grad_sync(engine));
        CHECK(fsdp_engine_optimizer_step(engine));
        CHECK(fsdp_engine_end_step(engine));
    }
    CHECK(fsdp_engine_destroy(engine));
    for (size_t id = 0; id < NPARAMS; id++) {
        free(init[id]);
        free(teacher[id]);
    }
    return NULL;
}

int main(int argc, char **argv) {
    size_t world = argc > 1 ? (size_t)atoi(argv[1]) : 2;
    int steps = argc > 2 ? atoi(argv[2]) : 5;
    /* A seed runs the ranks' streams apart (fsdp_local_group_create_async), as a test of order. */
    int asynchronous = argc > 3;
    uint64_t seed = asynchronous ? strtoull(argv[3], NULL, 10) : 0;
    if (world < 1 || world > MAX_WORLD || steps < 1 || steps > MAX_STEPS) {
        fprintf(stderr, "usage: train [world_size 1..%d] [steps 1..%d] [seed]\n", MAX_WORLD,
                MAX_STEPS);
        return 2;
    }
    char names[NPARAMS][32];
    uint64_t shapes[NPARAMS][2];
    fsdp_param_spec specs[NPARAMS];
    for (size_t id = 0; id < NPARAMS; id++) {
        fsdp_param_spec s = {names[id], shapes[id], 1, FSDP_F32, FSDP_ROOT, true, false, false, 1.0f};
        if (id == EMBED) {
            snprintf(names[id], sizeof names[id], "embed");
            shapes[id][0] = INPUTS, shapes[id][1] = WIDTH, s.ndim = 2, s.tied = true;
        } else if (id == HEAD) {
            snprintf(names[id], sizeof names[id], "head.bias");
            shapes[id][0] = INPUTS, s.no_weight_decay = true;
        } else {
            int l = (int)((id - 1) / 3), kind = (int)((id - 1) % 3);
            const char *what[] = {"weight", "bias", "gain"};
            snprintf(names[id], sizeof names[id], "layers.%d.%s", l, what[kind]);
            s.unit = l;
            shapes[id][0] = WIDTH, shapes[id][1] = WIDTH, s.ndim = kind == 0 ? 2 : 1;
            s.trainable = kind != 2;
            s.no_weight_decay = kind == 1; /* biases, as LLM recipes exempt them */
        }
        specs[id] = s;
    }
    fsdp_plan *plan;
    fsdp_local_group *group;
    CHECK(fsdp_plan_from_specs(specs, NPARAMS, world, &plan));
    if (asynchronous) {
        CHECK(fsdp_local_group_create_async(world, seed, &group));
    } else {
        CHECK(fsdp_local_group_create(world, &group));
    }
    rank_job jobs[MAX_WORLD];
    pthread_t threads[MAX_WORLD];
    for (size_t r = 0; r < world; r++) {
        jobs[r] = (rank_job){plan, group, r, steps, {0}};
        pthread_create(&threads[r], NULL, run_rank, &jobs[r]);
    }
    for (size_t r = 0; r < world; r++) pthread_join(threads[r], NULL);
    for (int step = 0; step < steps; step++) {
        float loss = 0.0f;
        for (size_t r = 0; r < world; r++) loss += jobs[r].losses[step];
        printf("step %d loss %.9g\n", step + 1, loss / (float)world);
    }
    CHECK(fsdp_local_group_destroy(group));
    CHECK(fsdp_plan_destroy(plan));
    return 0;
}
