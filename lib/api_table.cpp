// pkv_get_api: the versioned function table through which a runtime loader reaches every function
// after resolving this one symbol.
#include "guard.hpp"

namespace {

// Filled field by field rather than positionally: many entries share a type, so a positional
// initializer would compile with two functions swapped.
constexpr pkv_api make_table() {
  pkv_api t{};
  t.struct_size = sizeof(pkv_api);
  t.api_version = PKV_API_VERSION;
  t.version = pkv_version;
  t.version_string = pkv_version_string;
  t.status_string = pkv_status_string;
  t.last_error = pkv_last_error;
  t.backend_name = pkv_backend_name;
  t.format_name = pkv_format_name;
  t.context_create = pkv_context_create;
  t.context_destroy = pkv_context_destroy;
  t.context_backend = pkv_context_backend;
  t.context_synchronize = pkv_context_synchronize;
  t.context_read_bandwidth = pkv_context_read_bandwidth;
  t.backend_query = pkv_backend_query;
  t.pool_create = pkv_pool_create;
  t.pool_destroy = pkv_pool_destroy;
  t.seq_alloc = pkv_seq_alloc;
  t.seq_free = pkv_seq_free;
  t.seq_fork = pkv_seq_fork;
  t.seq_truncate = pkv_seq_truncate;
  t.seq_length = pkv_seq_length;
  t.append = pkv_append;
  t.write = pkv_write;
  t.read = pkv_read;
  t.decode = pkv_decode;
  t.pool_get_stats = pkv_pool_get_stats;
  t.convert_from_f32 = pkv_convert_from_f32;
  t.convert_to_f32 = pkv_convert_to_f32;
  t.format_row_bytes = pkv_format_row_bytes;
  t.decode_prepare = pkv_decode_prepare;
  t.seq_export_size = pkv_seq_export_size;
  t.seq_export = pkv_seq_export;
  t.seq_import = pkv_seq_import;
  t.pool_regions = pkv_pool_regions;
  t.seq_page_spans = pkv_seq_page_spans;
  t.extend = pkv_extend;
  t.seq_release_before = pkv_seq_release_before;
  t.pool_set_scales = pkv_pool_set_scales;
  t.pool_get_scales = pkv_pool_get_scales;
  t.extend_prepare = pkv_extend_prepare;
  return t;
}

// Constant-initialised: no start-up code, and the same object for every caller and thread.
constexpr pkv_api kTable = make_table();

} // namespace

extern "C" PKV_API pkv_status pkv_get_api(uint32_t version, const pkv_api **out) {
  return pkv::guarded(__func__, [&] {
    if (version == 0 || version > PKV_API_VERSION)
      pkv::fail(PKV_ERR_VERSION, "function table version %u was asked for; this library offers versions 1 to %u",
                unsigned(version), unsigned(PKV_API_VERSION));
    if (!out) pkv::fail(PKV_ERR_INVALID_ARGUMENT, "out is NULL");
    *out = &kTable;
  });
}
