/* A C program linked against libpagedkv.a alone (no shared library: tests/abi/abi_check.py static
 * checks the executable needs none): the function table holds exactly the linked functions,
 * pkv_get_api refuses versions it lacks with a text naming both, and one engine round trip runs. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <stdio.h>
#include <string.h>

#include "pagedkv.h"
#include "roundtrip.h"

static void table_holds_the_functions(void **state) {
  (void)state;
  const pkv_api *t = NULL;
  assert_int_equal(pkv_get_api(PKV_API_VERSION, &t), PKV_OK);
  assert_string_equal(pkv_last_error(), "");
  assert_int_equal(t->struct_size, sizeof(pkv_api));
  assert_int_equal(t->api_version, PKV_API_VERSION);
  /* every entry is the function of its name: a swapped pair of the same type shows here */
  assert_ptr_equal(t->version, pkv_version);
  assert_ptr_equal(t->version_string, pkv_version_string);
  assert_ptr_equal(t->status_string, pkv_status_string);
  assert_ptr_equal(t->last_error, pkv_last_error);
  assert_ptr_equal(t->backend_name, pkv_backend_name);
  assert_ptr_equal(t->format_name, pkv_format_name);
  assert_ptr_equal(t->context_create, pkv_context_create);
  assert_ptr_equal(t->context_destroy, pkv_context_destroy);
  assert_ptr_equal(t->context_backend, pkv_context_backend);
  assert_ptr_equal(t->context_synchronize, pkv_context_synchronize);
  assert_ptr_equal(t->context_read_bandwidth, pkv_context_read_bandwidth);
  assert_ptr_equal(t->backend_query, pkv_backend_query);
  assert_ptr_equal(t->pool_create, pkv_pool_create);
  assert_ptr_equal(t->pool_destroy, pkv_pool_destroy);
  assert_ptr_equal(t->seq_alloc, pkv_seq_alloc);
  assert_ptr_equal(t->seq_free, pkv_seq_free);
  assert_ptr_equal(t->seq_fork, pkv_seq_fork);
  assert_ptr_equal(t->seq_truncate, pkv_seq_truncate);
  assert_ptr_equal(t->seq_length, pkv_seq_length);
  assert_ptr_equal(t->append, pkv_append);
  assert_ptr_equal(t->write, pkv_write);
  assert_ptr_equal(t->read, pkv_read);
  assert_ptr_equal(t->decode, pkv_decode);
  assert_ptr_equal(t->pool_get_stats, pkv_pool_get_stats);
  assert_ptr_equal(t->convert_from_f32, pkv_convert_from_f32);
  assert_ptr_equal(t->convert_to_f32, pkv_convert_to_f32);
  assert_ptr_equal(t->format_row_bytes, pkv_format_row_bytes);
  assert_ptr_equal(t->decode_prepare, pkv_decode_prepare);
  assert_ptr_equal(t->seq_export_size, pkv_seq_export_size);
  assert_ptr_equal(t->seq_export, pkv_seq_export);
  assert_ptr_equal(t->seq_import, pkv_seq_import);
  assert_ptr_equal(t->pool_regions, pkv_pool_regions);
  assert_ptr_equal(t->seq_page_spans, pkv_seq_page_spans);
  assert_ptr_equal(t->extend, pkv_extend);
  assert_ptr_equal(t->seq_release_before, pkv_seq_release_before);
  assert_ptr_equal(t->pool_set_scales, pkv_pool_set_scales);
  assert_ptr_equal(t->pool_get_scales, pkv_pool_get_scales);
  assert_ptr_equal(t->extend_prepare, pkv_extend_prepare);
  /* the same table for every version asked for */
  const pkv_api *again = NULL;
  assert_int_equal(pkv_get_api(1, &again), PKV_OK);
  assert_ptr_equal(again, t);
}

static void versions_not_offered(void **state) {
  (void)state;
  const uint32_t versions[] = {0, PKV_API_VERSION + 1, UINT32_MAX};
  char asked[64], offered[64];
  snprintf(offered, sizeof offered, "offers versions 1 to %u", (unsigned)PKV_API_VERSION);
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    static const pkv_api untouched;
    const pkv_api *t = &untouched;
    assert_int_equal(pkv_get_api(versions[i], &t), PKV_ERR_VERSION);
    assert_ptr_equal(t, &untouched);
    snprintf(asked, sizeof asked, "version %u was asked for", (unsigned)versions[i]);
    const char *text = pkv_last_error();
    if (!strstr(text, "PKV_ERR_VERSION: pkv_get_api: ") || !strstr(text, asked) || !strstr(text, offered))
      fail_msg("last error: \"%s\"", text);
  }
  assert_int_equal(pkv_get_api(PKV_API_VERSION, NULL), PKV_ERR_INVALID_ARGUMENT);
  if (!strstr(pkv_last_error(), "out is NULL")) fail_msg("last error: \"%s\"", pkv_last_error());
}

static void round_trip(void **state) {
  (void)state;
  const pkv_api *t = NULL;
  assert_int_equal(pkv_get_api(PKV_API_VERSION, &t), PKV_OK);
  rt_round_trip(t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(table_holds_the_functions),
      cmocka_unit_test(versions_not_offered),
      cmocka_unit_test(round_trip),
  };
  return tu_run_tests(tests, NULL, NULL);
}
