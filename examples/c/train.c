/* Trains the example model (see support/src/mlp) through the C API on CPU ranks, one thread each,
 * and prints the mean loss of every step:
 *
 *     step <n> loss <value>
 *
 * Build against the static library, e.g.
 *     cc -O2 -Iinclude examples/c/train.c target/release/libfsdp_fusion.a -lpthread -ldl -lm
 * Usage: train [world_size] [steps] [seed] [captured]
 * A seed runs the ranks' streams apart (fsdp_local_group_create_async), as a test of order.
 * "captured" (with a seed) queues the model's math on each rank's compute stream as host
 * functions (fsdp_engine_launch_host_func), as a GPU model's kernels are queued, runs the first
 * step so, captures the second (fsdp_engine_begin_capture; nothing runs) and replays it for that
 * step and every later one (fsdp_engine_replay): the same losses as without it.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* A layer: act = tanh(h W + b), out = h + g * act. */
static void layer(const float *w, const float *b, const float *g, const float *h, float *act, float *out) {
    matmul(h, 0, w, 0, BATCH, WIDTH, WIDTH, act);
    for (int r = 0; r < BATCH; r++)
        for (int j = 0; j < WIDTH; j++) {
            float *a = &act[r * WIDTH + j];
            *a = tanhf(*a + b[j]);
            out[r * WIDTH + j] = h[r * WIDTH + j] + g[j] * *a;
        }
}

/* The output h E^T + c. */
static void head(const float *e, const float *c, const float *h, float *out) {
    matmul(h, 0, e, 1, BATCH, WIDTH, INPUTS, out);
    for (int r = 0; r < BATCH; r++)
        for (int j = 0; j < INPUTS; j++) out[r * INPUTS + j] += c[j];
}

/* The teacher's output for inputs x: the model's forward with the teacher's values. */
static void teacher_forward(float *values[NPARAMS], const float *x, float *y) {
    float hs[LAYERS + 1][BATCH * WIDTH], act[BATCH * WIDTH];
    matmul(x, 0, values[EMBED], 0, BATCH, INPUTS, WIDTH, hs[0]);
    for (int l = 0; l < LAYERS; l++)
        layer(values[weight_id(l)], values[bias_id(l)], values[gain_id(l)], hs[l], act, hs[l + 1]);
    head(values[EMBED], values[HEAD], hs[LAYERS], y);
}

/* One pass's micro-batch, activations and gradients, as its stages leave them. */
typedef struct {
    float x[BATCH * INPUTS], y[BATCH * INPUTS];
    float hs[LAYERS + 1][BATCH * WIDTH], acts[LAYERS][BATCH * WIDTH];
    float out[BATCH * INPUTS], dout[BATCH * INPUTS], dh[BATCH * WIDTH];
    float grads[NPARAMS][WIDTH * WIDTH]; /* each parameter's gradient; a layer's weight is the largest */
    float loss;
} pass_state;
_Static_assert(INPUTS * WIDTH <= WIDTH * WIDTH, "the embedding's gradient fits its place");

/* A pass's stages, each between the hooks that keep the parameters it reads gathered. */
typedef enum { EMBED_INPUT, LAYER, HEAD_AND_LOSS, HEAD_BACKWARD, LAYER_BACKWARD, EMBED_GRAD } stage_kind;
enum { STAGES = 2 * LAYERS + 4 };

typedef struct {
    stage_kind kind;
    int layer;
    pass_state *s;
    const float *p[3];  /* the values of the parameters it reads */
    float *weight_grad; /* LAYER_BACKWARD: where the weight's gradient goes */
} stage;

static void run_stage(void *arg) {
    const stage *st = arg;
    pass_state *s = st->s;
    const int l = st->layer;
    const float count = (float)(BATCH * INPUTS);
    switch (st->kind) {
    case EMBED_INPUT:
        matmul(s->x, 0, st->p[0], 0, BATCH, INPUTS, WIDTH, s->hs[0]);
        break;
    case LAYER:
        layer(st->p[0], st->p[1], st->p[2], s->hs[l], s->acts[l], s->hs[l + 1]);
        break;
    case HEAD_AND_LOSS:
        head(st->p[0], st->p[1], s->hs[LAYERS], s->out);
        s->loss = 0.0f;
        for (int i = 0; i < BATCH * INPUTS; i++) {
            float d = s->out[i] - s->y[i];
            s->loss += d * d;
            s->dout[i] = d / count;
        }
        s->loss = 0.5f * s->loss / count;
        break;
    case HEAD_BACKWARD: {
        float *dhead = s->grads[HEAD];
        memset(dhead, 0, INPUTS * sizeof(float));
        for (int r = 0; r < BATCH; r++)
            for (int j = 0; j < INPUTS; j++) dhead[j] += s->dout[r * INPUTS + j];
        matmul(s->dout, 1, s->hs[LAYERS], 0, INPUTS, BATCH, WIDTH, s->grads[EMBED]);
        matmul(s->dout, 0, st->p[0], 0, BATCH, INPUTS, WIDTH, s->dh);
        break;
    }
    case LAYER_BACKWARD: {
        const float *w = st->p[0], *g = st->p[1];
        float dz[BATCH * WIDTH], back[BATCH * WIDTH], *db = s->grads[bias_id(l)];
        for (int r = 0; r < BATCH; r++)
            for (int j = 0; j < WIDTH; j++) {
                float a = s->acts[l][r * WIDTH + j];
                dz[r * WIDTH + j] = s->dh[r * WIDTH + j] * g[j] * (1.0f - a * a);
            }
        matmul(s->hs[l], 1, dz, 0, WIDTH, BATCH, WIDTH, st->weight_grad);
        memset(db, 0, WIDTH * sizeof(float));
        for (int r = 0; r < BATCH; r++)
            for (int j = 0; j < WIDTH; j++) db[j] += dz[r * WIDTH + j];
        matmul(dz, 0, w, 1, BATCH, WIDTH, WIDTH, back);
        for (int i = 0; i < BATCH * WIDTH; i++) s->dh[i] += back[i];
        break;
    }
    case EMBED_GRAD: {
        float from_input[INPUTS * WIDTH];
        matmul(s->x, 1, s->dh, 0, INPUTS, BATCH, WIDTH, from_input);
        for (int i = 0; i < INPUTS * WIDTH; i++) s->grads[EMBED][i] += from_input[i];
        break;
    }
    }
}

/* How a rank runs its stages: at once on the host, or queued on the engine's compute stream as
 * host functions, as a GPU model's kernels would be (what a capture can hold). */
typedef struct {
    fsdp_engine *engine;
    int on_stream;
} runner;

static const float *value(runner *r, size_t id) {
    const void *data;
    size_t numel;
    uint32_t dtype;
    if (r->on_stream)
        CHECK(fsdp_engine_param_device(r->engine, id, &data, &numel, &dtype));
    else
        CHECK(fsdp_engine_param(r->engine, id, &data, &numel, &dtype));
    if (numel != numel_of(id) || dtype != FSDP_F32) {
        fprintf(stderr, "param %zu: unexpected view\n", id);
        exit(1);
    }
    return data;
}

static void run(runner *r, stage *st) {
    if (r->on_stream)
        CHECK(fsdp_engine_launch_host_func(r->engine, run_stage, st));
    else
        run_stage(st);
}

static void give_grad(runner *r, pass_state *s, size_t id) {
    if (r->on_stream)
        CHECK(fsdp_engine_grad_device(r->engine, id, s->grads[id], numel_of(id), FSDP_F32));
    else
        CHECK(fsdp_engine_grad(r->engine, id, s->grads[id], numel_of(id), FSDP_F32));
}

/* One forward and backward pass with every hook, its stages kept in `st`. At once, a layer's
 * weight gradient goes straight into the engine's fp32 slot; on the stream into the pass's place,
 * read by the engine on the stream. */
static void pass(runner *r, pass_state *s, stage st[STAGES]) {
    fsdp_engine *e = r->engine;
    int n = 0;
    CHECK(fsdp_engine_pre_forward(e, FSDP_ROOT));
    st[n] = (stage){EMBED_INPUT, 0, s, {value(r, EMBED)}, NULL};
    run(r, &st[n++]);
    CHECK(fsdp_engine_post_forward(e, FSDP_ROOT));
    for (int l = 0; l < LAYERS; l++) {
        CHECK(fsdp_engine_pre_forward(e, l));
        st[n] = (stage){LAYER, l, s, {value(r, weight_id(l)), value(r, bias_id(l)), value(r, gain_id(l))}, NULL};
        run(r, &st[n++]);
        CHECK(fsdp_engine_post_forward(e, l));
    }
    CHECK(fsdp_engine_pre_forward(e, FSDP_ROOT));
    st[n] = (stage){HEAD_AND_LOSS, 0, s, {value(r, EMBED), value(r, HEAD)}, NULL};
    run(r, &st[n++]);
    CHECK(fsdp_engine_post_forward(e, FSDP_ROOT));

    CHECK(fsdp_engine_pre_backward(e, FSDP_ROOT));
    st[n] = (stage){HEAD_BACKWARD, 0, s, {value(r, EMBED)}, NULL};
    run(r, &st[n++]);
    give_grad(r, s, HEAD);
    CHECK(fsdp_engine_post_backward(e, FSDP_ROOT));
    for (int l = LAYERS - 1; l >= 0; l--) {
        CHECK(fsdp_engine_pre_backward(e, l));
        float *weight_grad = s->grads[weight_id(l)];
        if (!r->on_stream) CHECK(fsdp_engine_grad_slot(e, weight_id(l), &weight_grad));
        st[n] = (stage){LAYER_BACKWARD, l, s, {value(r, weight_id(l)), value(r, gain_id(l))}, weight_grad};
        run(r, &st[n++]);
        if (r->on_stream)
            give_grad(r, s, weight_id(l));
        else
            CHECK(fsdp_engine_commit_grad(e, weight_id(l)));
        give_grad(r, s, bias_id(l));
        CHECK(fsdp_engine_post_backward(e, l));
    }
    st[n] = (stage){EMBED_GRAD, 0, s, {NULL}, NULL};
    run(r, &st[n++]);
    give_grad(r, s, EMBED);
}

/* Where a wait for the compute stream stands. */
typedef struct {
    pthread_mutex_t mutex;
    pthread_cond_t reached_cond;
    int reached;
} fence;

static void reach(void *arg) {
    fence *f = arg;
    pthread_mutex_lock(&f->mutex);
    f->reached = 1;
    pthread_cond_signal(&f->reached_cond);
    pthread_mutex_unlock(&f->mutex);
}

/* Blocks until the engine's compute stream ran the work queued on it so far, at most 60 s. */
static void wait_for_stream(fsdp_engine *engine) {
    fence f = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    CHECK(fsdp_engine_launch_host_func(engine, reach, &f));
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 60;
    pthread_mutex_lock(&f.mutex);
    int waited = 0;
    while (!f.reached && waited == 0) waited = pthread_cond_timedwait(&f.reached_cond, &f.mutex, &deadline);
    int reached = f.reached;
    pthread_mutex_unlock(&f.mutex);
    if (!reached) {
        fprintf(stderr, "the compute stream did not reach the wait within 60 s\n");
        exit(1);
    }
}

typedef struct {
    fsdp_plan *plan;
    fsdp_local_group *group;
    size_t rank;
    int steps;
    int captured; /* the model's math on the stream, the second step captured and replayed */
    float losses[MAX_STEPS];
    pass_state passes[PASSES];
    stage stages[PASSES][STAGES]; /* kept for the stream's work and the replays */
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

    runner model = {engine, job->captured};
    for (int step = 0; step < job->steps; step++) {
        /* The stream ran the last step's work: nothing reads the micro-batches now. */
        for (uint64_t p = 0; p < PASSES; p++) {
            rng r = {SEED ^ ((uint64_t)step << 32) ^ (p << 16) ^ (uint64_t)job->rank};
            fill(&r, job->passes[p].x, BATCH * INPUTS, 1.0f);
            teacher_forward(teacher, job->passes[p].x, job->passes[p].y);
        }
        int replayed = job->captured && step >= 1;
        if (replayed && step == 1) CHECK(fsdp_engine_begin_capture(engine));
        if (!replayed || step == 1) {
            for (int p = 0; p < PASSES; p++) pass(&model, &job->passes[p], job->stages[p]);
            CHECK(fsdp_engine_finish_grad_sync(engine));
            CHECK(fsdp_engine_optimizer_step(engine));
            CHECK(fsdp_engine_end_step(engine));
        }
        if (replayed && step == 1) CHECK(fsdp_engine_end_capture(engine));
        if (replayed) CHECK(fsdp_engine_replay(engine));
        if (job->captured) wait_for_stream(engine);
        float loss = 0.0f;
        for (int p = 0; p < PASSES; p++) loss += job->passes[p].loss;
        job->losses[step] = loss / PASSES;
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
    int asynchronous = argc > 3;
    uint64_t seed = asynchronous ? strtoull(argv[3], NULL, 10) : 0;
    int captured = argc > 4 && strcmp(argv[4], "captured") == 0;
    if (world < 1 || world > MAX_WORLD || steps < 1 || steps > MAX_STEPS || (argc > 4 && !captured) ||
        argc > 5) {
        fprintf(stderr, "usage: train [world_size 1..%d] [steps 1..%d] [seed [captured]]\n",
                MAX_WORLD, MAX_STEPS);
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
    static rank_job jobs[MAX_WORLD];
    pthread_t threads[MAX_WORLD];
    for (size_t r = 0; r < world; r++) {
        jobs[r].plan = plan, jobs[r].group = group, jobs[r].rank = r, jobs[r].steps = steps;
        jobs[r].captured = captured;
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
