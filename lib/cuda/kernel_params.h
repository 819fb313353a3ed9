/* The arguments of the CUDA kernels: plain structs, fixed-width fields only, so the host compiler and
 * nvcc lay them out alike. Each kernel takes one of them by value. */
#ifndef PKV_CUDA_KERNEL_PARAMS_H
#define PKV_CUDA_KERNEL_PARAMS_H

#include <stdint.h>

/* Where a row of one format lives inside a page part (lib/format.hpp's PlaneLayout). */
typedef struct PkvPlane {
  uint32_t format; /* pkv_format */
  uint32_t row_data_bytes;
  uint32_t row_scale_bytes;
  uint32_t reserved;
  uint64_t scale_offset;
} PkvPlane;

typedef struct PkvPool {
  uint64_t base;        /* the pages */
  uint64_t table;       /* uint32_t [max_sequences][table_stride] */
  uint64_t block_bytes; /* one (layer, page) block: K part then V part */
  uint64_t k_bytes;     /* the V part starts here */
  uint32_t layers, kv_heads, head_dim, page_size, pages, table_stride, max_sequences;
  uint32_t page_shift; /* log2(page_size): tokens to pages by shifts */
  PkvPlane k, v;
} PkvPool;

typedef struct PkvTableEntry {
  uint32_t seq_slot, index, page;
} PkvTableEntry;

typedef struct PkvTableParams {
  PkvPool pool;
  uint64_t entries; /* PkvTableEntry [count] */
  uint32_t count;
  uint32_t reserved;
} PkvTableParams;

typedef struct PkvRowSlot {
  uint32_t page, slot;
} PkvRowSlot;

/* Scatter (rows into pages) and gather (pages into rows). */
typedef struct PkvRowsParams {
  PkvPool pool;
  uint64_t slots; /* PkvRowSlot [rows] */
  uint64_t k, v;  /* [rows][kv_heads][head_dim] in `format`; gather skips a zero pointer */
  uint32_t rows, layer, format, reserved;
} PkvRowsParams;

typedef struct PkvPageCopy {
  uint32_t src, dst;
} PkvPageCopy;

typedef struct PkvCopyParams {
  PkvPool pool;
  uint64_t copies; /* PkvPageCopy [count] */
  uint32_t count, reserved;
} PkvCopyParams;

typedef struct PkvChunk {
  uint32_t seq, token_begin, token_end;
} PkvChunk;

/* Decode: partial attention per (chunk, KV head, head tile), then a merge per (sequence, query head). */
typedef struct PkvDecodeParams {
  PkvPool pool;
  uint64_t seq_slots;  /* uint32_t [count]: page-table row of each sequence */
  uint64_t lengths;    /* uint32_t [count] */
  uint64_t chunks;     /* PkvChunk [n_chunks] */
  uint64_t seq_chunks; /* uint32_t [count + 1] */
  uint64_t q, out, lse;
  uint64_t part_out;   /* float [n_chunks][q_tokens][q_heads][head_dim] */
  uint64_t part_lse;   /* float [n_chunks][q_tokens][q_heads] */
  uint32_t layer, count, q_heads, n_chunks;
  uint32_t q_tokens;   /* query token t of a sequence of length L sees positions [0, L - q_tokens + t] */
  uint32_t reserved2;
  uint32_t q_format, out_format;
  float scale;
  uint32_t reserved;
} PkvDecodeParams;

/* A read-only pass over `bytes` (a multiple of 16) for the bandwidth measurement. */
typedef struct PkvReadParams {
  uint64_t data;
  uint64_t bytes;
  uint64_t sink; /* uint32_t, written only if the xor of everything read is a value nobody expects */
} PkvReadParams;

/* The generic decode kernel (decode.cu): query heads one block serves (a larger GQA group takes
 * several blocks) and warps per block. */
#define PKV_HEAD_TILE 8
#define PKV_DECODE_WARPS 4

/* The specialised kernels (decode_fast.cu): tokens per z-slice of a tile, shared-memory stages in
 * flight, most threads a block has. */
#define PKV_FAST_TT 4
#define PKV_FAST_STAGES 4
#define PKV_FAST_MAX_THREADS 256

#endif
