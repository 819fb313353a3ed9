/* One engine step on pagedkv, every status checked: a context (the backend PKV_BACKEND names, else the
 * first that works), a pool, three sequences, an append of their new tokens, then per layer a write
 * of the new K/V rows and a decode of the batch. The decode's output is checked against attention
 * computed here in double from the rows the pages hold (pkv_read), so the example fails if the
 * library computes wrong. Build: cc engine_step.c $(pkg-config --cflags --libs pagedkv) -lm */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <pagedkv.h>

/* Every call returns a status; on failure pkv_last_error() says which argument and why. */
#define CHECK(call)                                                                                 \
  do {                                                                                              \
    pkv_status st_ = (call);                                                                        \
    if (st_ != PKV_OK) {                                                                            \
      fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, pkv_last_error());        \
      exit(1);                                                                                      \
    }                                                                                               \
  } while (0)

enum { LAYERS = 2, KV_HEADS = 2, Q_HEADS = 8, HEAD_DIM = 64, BATCH = 3 };

static float random_value(unsigned *state) {
  *state = *state * 1664525u + 1013904223u;
  return (float)((*state >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* softmax(q.k / sqrt(d)) v over n rows of one KV head, in double. */
static void attention(const float *q, const float *k, const float *v, unsigned n, double *out) {
  double m = -INFINITY, sum = 0, *w = malloc(n * sizeof *w);
  unsigned t, d;
  for (t = 0; t < n; t++) {
    double dot = 0;
    for (d = 0; d < HEAD_DIM; d++) dot += (double)q[d] * k[(size_t)t * KV_HEADS * HEAD_DIM + d];
    w[t] = dot / sqrt((double)HEAD_DIM);
    if (w[t] > m) m = w[t];
  }
  for (t = 0; t < n; t++) sum += w[t] = exp(w[t] - m);
  for (d = 0; d < HEAD_DIM; d++) {
    double acc = 0;
    for (t = 0; t < n; t++) acc += w[t] * v[(size_t)t * KV_HEADS * HEAD_DIM + d];
    out[d] = acc / sum;
  }
  free(w);
}

int main(void) {
  pkv_context *ctx;
  pkv_context_desc cd = PKV_CONTEXT_DESC_INIT; /* backend auto: PKV_BACKEND=cpu|cuda|hip overrides */
  pkv_backend backend;
  pkv_pool *pool;
  pkv_pool_desc pd = PKV_POOL_DESC_INIT;
  pkv_seq seqs[BATCH];
  uint32_t n_new[BATCH] = {5, 1, 20}, total = 0, layer, i, h;
  unsigned state = 12345;
  float *k, *v, *q, *out, *kr, *vr;
  double worst = 0;

  CHECK(pkv_context_create(&cd, &ctx));
  CHECK(pkv_context_backend(ctx, &backend));

  pd.layers = LAYERS;
  pd.kv_heads = KV_HEADS;
  pd.head_dim = HEAD_DIM;
  pd.pages = 64;
  pd.max_sequences = 16;
  pd.k_format = PKV_FORMAT_Q8_0;
  pd.v_format = PKV_FORMAT_F16;
  CHECK(pkv_pool_create(ctx, &pd, &pool));

  for (i = 0; i < BATCH; i++) CHECK(pkv_seq_alloc(pool, &seqs[i]));
  for (i = 0; i < BATCH; i++) total += n_new[i];

  /* 1. The scheduler appends the batch's new tokens: every sequence gets its pages, or none changes. */
  CHECK(pkv_append(pool, seqs, n_new, BATCH));

  k = malloc(sizeof *k * total * KV_HEADS * HEAD_DIM);
  v = malloc(sizeof *v * total * KV_HEADS * HEAD_DIM);
  q = malloc(sizeof *q * BATCH * Q_HEADS * HEAD_DIM);
  out = malloc(sizeof *out * BATCH * Q_HEADS * HEAD_DIM);
  kr = malloc(sizeof *kr * 32 * KV_HEADS * HEAD_DIM);
  vr = malloc(sizeof *vr * 32 * KV_HEADS * HEAD_DIM);
  if (!k || !v || !q || !out || !kr || !vr) return 1;

  for (layer = 0; layer < LAYERS; layer++) {
    pkv_write_args w = PKV_WRITE_ARGS_INIT;
    pkv_decode_args a = PKV_DECODE_ARGS_INIT;
    size_t j;
    for (j = 0; j < (size_t)total * KV_HEADS * HEAD_DIM; j++) k[j] = random_value(&state), v[j] = random_value(&state);
    for (j = 0; j < (size_t)BATCH * Q_HEADS * HEAD_DIM; j++) q[j] = random_value(&state);

    /* 2. The new rows, packed [sum n_new][kv_heads][head_dim], into their pages. */
    w.layer = layer;
    w.seqs = seqs;
    w.n_tokens = n_new;
    w.count = BATCH;
    w.src_format = PKV_FORMAT_F32;
    w.k = k;
    w.v = v;
    CHECK(pkv_write(pool, &w));

    /* 3. Attention of each sequence's newest token: q and out are [batch][q_heads][head_dim]. */
    a.layer = layer;
    a.seqs = seqs;
    a.count = BATCH;
    a.q_heads = Q_HEADS;
    a.q = q;
    a.out = out;
    CHECK(pkv_decode(pool, &a));
    CHECK(pkv_context_synchronize(ctx));

    /* The check: the same attention in double over the rows as the pages store them. */
    for (i = 0; i < BATCH; i++) {
      pkv_read_args r = PKV_READ_ARGS_INIT;
      r.layer = layer;
      r.seq = seqs[i];
      r.count = n_new[i];
      r.k = kr;
      r.v = vr;
      CHECK(pkv_read(pool, &r));
      for (h = 0; h < Q_HEADS; h++) {
        const unsigned kv = h / (Q_HEADS / KV_HEADS);
        double ref[HEAD_DIM], err = 0, norm = 0;
        unsigned d;
        attention(q + ((size_t)i * Q_HEADS + h) * HEAD_DIM, kr + kv * HEAD_DIM, vr + kv * HEAD_DIM, n_new[i], ref);
        for (d = 0; d < HEAD_DIM; d++) {
          const double diff = out[((size_t)i * Q_HEADS + h) * HEAD_DIM + d] - ref[d];
          err += diff * diff;
          norm += ref[d] * ref[d];
        }
        if (sqrt(err / norm) > worst) worst = sqrt(err / norm);
      }
    }
  }

  for (i = 0; i < BATCH; i++) CHECK(pkv_seq_free(pool, seqs[i]));
  CHECK(pkv_pool_destroy(pool));
  CHECK(pkv_context_destroy(ctx));
  free(k), free(v), free(q), free(out), free(kr), free(vr);

  printf("pagedkv %s on %s: %u layers x %u sequences decoded; largest relative error %.2e\n", pkv_version_string(),
         pkv_backend_name(backend), (unsigned)LAYERS, (unsigned)BATCH, worst);
  if (!(worst < 1e-4)) {
    fprintf(stderr, "the decode differs from the reference by %.2e (more than 1e-4)\n", worst);
    return 1;
  }
  return 0;
}
