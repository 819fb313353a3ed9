/* The public structs' sizes, alignments and field offsets, and the enums' size and values, as
 * released: the ABI that compiled programs and FFI bindings rely on. A struct may only grow at its end
 * and pkv_api only gains entries at its end (docs/abi.md), so every line here stays true for ever
 * within a major version; growing a struct adds lines, it never edits one. C11 (offsetof, _Alignof).
 * The numbers are those of 64-bit targets (LP64 Linux, LLP64 Windows), the ones pagedkv is built for. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "pagedkv.h"

struct fact {
  const char *what;
  size_t got, want;
};

#define SIZE(type, size) {"sizeof(" #type ")", sizeof(type), size}
#define ALIGN(type, align) {"_Alignof(" #type ")", _Alignof(type), align}
#define AT(type, field, offset) {#type "." #field, offsetof(type, field), offset}
#define VALUE(constant, value) {#constant, (size_t)(constant), value}
#define API(field, index) AT(pkv_api, field, 8 + 8 * (index))

static const struct fact facts[] = {
    SIZE(pkv_status, 4), SIZE(pkv_backend, 4), SIZE(pkv_format, 4), SIZE(pkv_memory, 4),
    VALUE(PKV_OK, 0), VALUE(PKV_ERR_INVALID_ARGUMENT, 1), VALUE(PKV_ERR_STRUCT_SIZE, 2),
    VALUE(PKV_ERR_STALE_HANDLE, 3), VALUE(PKV_ERR_OUT_OF_PAGES, 4), VALUE(PKV_ERR_OUT_OF_SEQUENCES, 5),
    VALUE(PKV_ERR_OUT_OF_MEMORY, 6), VALUE(PKV_ERR_UNSUPPORTED, 7), VALUE(PKV_ERR_NO_DEVICE, 8),
    VALUE(PKV_ERR_BACKEND, 9), VALUE(PKV_ERR_VERSION, 10), VALUE(PKV_ERR_INTERNAL, 11),
    VALUE(PKV_BACKEND_AUTO, 0), VALUE(PKV_BACKEND_CPU, 1), VALUE(PKV_BACKEND_CUDA, 2), VALUE(PKV_BACKEND_HIP, 3),
    VALUE(PKV_FORMAT_INVALID, 0), VALUE(PKV_FORMAT_F32, 1), VALUE(PKV_FORMAT_F16, 2), VALUE(PKV_FORMAT_BF16, 3),
    VALUE(PKV_FORMAT_Q8_0, 4), VALUE(PKV_FORMAT_Q4_0, 5), VALUE(PKV_FORMAT_FP8_E4M3, 6), VALUE(PKV_FORMAT_FP8_E5M2, 7),
    VALUE(PKV_MEMORY_HOST, 0), VALUE(PKV_MEMORY_DEVICE, 1),
    VALUE(PKV_MEMORY_HOST_PINNED, 2), VALUE(PKV_SEQ_IMAGE_VERSION, 1), VALUE(PKV_SEQ_IMAGE_HEADER_BYTES, 128),
    VALUE(PKV_MAX_EXTEND_ROWS, 0xffffffffu),

    SIZE(pkv_context_desc, 24), ALIGN(pkv_context_desc, 8),
    AT(pkv_context_desc, struct_size, 0), AT(pkv_context_desc, backend, 4), AT(pkv_context_desc, device, 8),
    AT(pkv_context_desc, threads, 12), AT(pkv_context_desc, stream, 16),

    SIZE(pkv_backend_info, 272), ALIGN(pkv_backend_info, 4),
    AT(pkv_backend_info, struct_size, 0), AT(pkv_backend_info, backend, 4), AT(pkv_backend_info, compiled, 8),
    AT(pkv_backend_info, device_count, 12), AT(pkv_backend_info, detail, 16),

    SIZE(pkv_seq, 8), ALIGN(pkv_seq, 8), AT(pkv_seq, id, 0),

    SIZE(pkv_pool_desc, 44), ALIGN(pkv_pool_desc, 4),
    AT(pkv_pool_desc, struct_size, 0), AT(pkv_pool_desc, layers, 4), AT(pkv_pool_desc, kv_heads, 8),
    AT(pkv_pool_desc, head_dim, 12), AT(pkv_pool_desc, page_size, 16), AT(pkv_pool_desc, pages, 20),
    AT(pkv_pool_desc, max_sequences, 24), AT(pkv_pool_desc, k_format, 28), AT(pkv_pool_desc, v_format, 32),
    AT(pkv_pool_desc, page_order_seed, 36), AT(pkv_pool_desc, max_sequence_length, 40),

    SIZE(pkv_write_args, 56), ALIGN(pkv_write_args, 8),
    AT(pkv_write_args, struct_size, 0), AT(pkv_write_args, layer, 4), AT(pkv_write_args, seqs, 8),
    AT(pkv_write_args, n_tokens, 16), AT(pkv_write_args, count, 24), AT(pkv_write_args, src_format, 28),
    AT(pkv_write_args, memory, 32), AT(pkv_write_args, k, 40), AT(pkv_write_args, v, 48),

    SIZE(pkv_read_args, 48), ALIGN(pkv_read_args, 8),
    AT(pkv_read_args, struct_size, 0), AT(pkv_read_args, layer, 4), AT(pkv_read_args, seq, 8),
    AT(pkv_read_args, start, 16), AT(pkv_read_args, count, 20), AT(pkv_read_args, dst_format, 24),
    AT(pkv_read_args, memory, 28), AT(pkv_read_args, k, 32), AT(pkv_read_args, v, 40),

    SIZE(pkv_decode_args, 104), ALIGN(pkv_decode_args, 8),
    AT(pkv_decode_args, struct_size, 0), AT(pkv_decode_args, layer, 4), AT(pkv_decode_args, seqs, 8),
    AT(pkv_decode_args, count, 16), AT(pkv_decode_args, q_heads, 20), AT(pkv_decode_args, q_tokens, 24),
    AT(pkv_decode_args, scale, 28), AT(pkv_decode_args, q_format, 32), AT(pkv_decode_args, out_format, 36),
    AT(pkv_decode_args, memory, 40), AT(pkv_decode_args, q, 48), AT(pkv_decode_args, out, 56),
    AT(pkv_decode_args, lse, 64), AT(pkv_decode_args, chunk_pages, 72),
    AT(pkv_decode_args, sinks, 80), AT(pkv_decode_args, alibi_slopes, 88), AT(pkv_decode_args, window, 96),
    AT(pkv_decode_args, softcap, 100),

    SIZE(pkv_pool_stats, 56), ALIGN(pkv_pool_stats, 8),
    AT(pkv_pool_stats, struct_size, 0), AT(pkv_pool_stats, pages_total, 4), AT(pkv_pool_stats, pages_free, 8),
    AT(pkv_pool_stats, pages_shared, 12), AT(pkv_pool_stats, sequences_live, 16),
    AT(pkv_pool_stats, max_sequences, 20), AT(pkv_pool_stats, tokens_live, 24), AT(pkv_pool_stats, bytes_total, 32),
    AT(pkv_pool_stats, bytes_per_page, 40), AT(pkv_pool_stats, bytes_per_token, 48),

    SIZE(pkv_export_args, 48), ALIGN(pkv_export_args, 8),
    AT(pkv_export_args, struct_size, 0), AT(pkv_export_args, seq, 8), AT(pkv_export_args, first_layer, 16),
    AT(pkv_export_args, layer_count, 20), AT(pkv_export_args, memory, 24), AT(pkv_export_args, image, 32),
    AT(pkv_export_args, image_bytes, 40),

    SIZE(pkv_import_args, 24), ALIGN(pkv_import_args, 8),
    AT(pkv_import_args, struct_size, 0), AT(pkv_import_args, memory, 4), AT(pkv_import_args, image, 8),
    AT(pkv_import_args, image_bytes, 16),

    SIZE(pkv_memory_region, 16), ALIGN(pkv_memory_region, 8),
    AT(pkv_memory_region, address, 0), AT(pkv_memory_region, bytes, 8),

    SIZE(pkv_page_span, 32), ALIGN(pkv_page_span, 8),
    AT(pkv_page_span, region, 0), AT(pkv_page_span, layer, 4), AT(pkv_page_span, index, 8),
    AT(pkv_page_span, part, 12), AT(pkv_page_span, offset, 16), AT(pkv_page_span, bytes, 24),

    SIZE(pkv_extend_args, 120), ALIGN(pkv_extend_args, 8),
    AT(pkv_extend_args, struct_size, 0), AT(pkv_extend_args, layer, 4), AT(pkv_extend_args, seqs, 8),
    AT(pkv_extend_args, count, 16), AT(pkv_extend_args, q_heads, 20), AT(pkv_extend_args, q_offsets, 24),
    AT(pkv_extend_args, scale, 32), AT(pkv_extend_args, q_format, 36), AT(pkv_extend_args, out_format, 40),
    AT(pkv_extend_args, memory, 44), AT(pkv_extend_args, q, 48), AT(pkv_extend_args, out, 56),
    AT(pkv_extend_args, lse, 64), AT(pkv_extend_args, mask, 72), AT(pkv_extend_args, mask_offsets, 80),
    AT(pkv_extend_args, mask_bytes, 88), AT(pkv_extend_args, sinks, 96), AT(pkv_extend_args, alibi_slopes, 104),
    AT(pkv_extend_args, window, 112), AT(pkv_extend_args, softcap, 116),

    SIZE(pkv_scales_args, 32), ALIGN(pkv_scales_args, 8),
    AT(pkv_scales_args, struct_size, 0), AT(pkv_scales_args, first_layer, 4), AT(pkv_scales_args, layer_count, 8),
    AT(pkv_scales_args, per_head, 12), AT(pkv_scales_args, k_scales, 16), AT(pkv_scales_args, v_scales, 24),

    /* the function table: version 1, then versions 2 to 7 */
    SIZE(pkv_api, 8 + 8 * 38), ALIGN(pkv_api, 8),
    AT(pkv_api, struct_size, 0), AT(pkv_api, api_version, 4),
    API(version, 0), API(version_string, 1), API(status_string, 2), API(last_error, 3), API(backend_name, 4),
    API(format_name, 5), API(context_create, 6), API(context_destroy, 7), API(context_backend, 8),
    API(context_synchronize, 9), API(context_read_bandwidth, 10), API(backend_query, 11), API(pool_create, 12),
    API(pool_destroy, 13), API(seq_alloc, 14), API(seq_free, 15), API(seq_fork, 16), API(seq_truncate, 17),
    API(seq_length, 18), API(append, 19), API(write, 20), API(read, 21), API(decode, 22),
    API(pool_get_stats, 23), API(convert_from_f32, 24), API(convert_to_f32, 25), API(format_row_bytes, 26),
    API(decode_prepare, 27), API(seq_export_size, 28), API(seq_export, 29), API(seq_import, 30),
    API(pool_regions, 31), API(seq_page_spans, 32), API(extend, 33), API(seq_release_before, 34),
    API(pool_set_scales, 35), API(pool_get_scales, 36), API(extend_prepare, 37),
};

int main(void) {
  if (sizeof(void *) != 8) {
    printf("skipped: the layout recorded here is that of 64-bit targets\n");
    return 77;
  }
  const size_t n = sizeof facts / sizeof facts[0];
  size_t wrong = 0;
  for (size_t i = 0; i < n; i++) {
    if (facts[i].got == facts[i].want) continue;
    printf("%s is %zu, the released ABI has %zu\n", facts[i].what, facts[i].got, facts[i].want);
    wrong++;
  }
  printf("%zu of %zu layout facts hold\n", n - wrong, n);
  return wrong ? 1 : 0;
}
