#include "args.h"

pkv_pool_desc pu_desc(uint32_t layers, uint32_t kv_heads, uint32_t head_dim, uint32_t page_size, uint32_t pages,
                      uint32_t max_sequences, pkv_format k_format, pkv_format v_format) {
  pkv_pool_desc d = PKV_POOL_DESC_INIT;
  d.layers = layers;
  d.kv_heads = kv_heads;
  d.head_dim = head_dim;
  d.page_size = page_size;
  d.pages = pages;
  d.max_sequences = max_sequences;
  d.k_format = k_format;
  d.v_format = v_format;
  return d;
}

pkv_write_args pu_write_args(uint32_t layer, const pkv_seq *seqs, const uint32_t *n_tokens, uint32_t count,
                             pkv_format src_format, const void *k, const void *v) {
  pkv_write_args a = PKV_WRITE_ARGS_INIT;
  a.layer = layer;
  a.seqs = seqs;
  a.n_tokens = n_tokens;
  a.count = count;
  a.src_format = src_format;
  a.k = k;
  a.v = v;
  return a;
}

pkv_read_args pu_read_args(uint32_t layer, pkv_seq seq, uint32_t start, uint32_t count, pkv_format dst_format,
                           void *k, void *v) {
  pkv_read_args a = PKV_READ_ARGS_INIT;
  a.layer = layer;
  a.seq = seq;
  a.start = start;
  a.count = count;
  a.dst_format = dst_format;
  a.k = k;
  a.v = v;
  return a;
}

pkv_decode_args pu_decode_args(uint32_t layer, const pkv_seq *seqs, uint32_t count, uint32_t q_heads, const void *q,
                               void *out, float *lse) {
  pkv_decode_args a = PKV_DECODE_ARGS_INIT;
  a.layer = layer;
  a.seqs = seqs;
  a.count = count;
  a.q_heads = q_heads;
  a.q = q;
  a.out = out;
  a.lse = lse;
  return a;
}

pkv_extend_args pu_extend_args(uint32_t layer, const pkv_seq *seqs, uint32_t count, uint32_t q_heads,
                               const uint32_t *q_offsets, const void *q, void *out, float *lse) {
  pkv_extend_args a = PKV_EXTEND_ARGS_INIT;
  a.layer = layer;
  a.seqs = seqs;
  a.count = count;
  a.q_heads = q_heads;
  a.q_offsets = q_offsets;
  a.q = q;
  a.out = out;
  a.lse = lse;
  return a;
}
