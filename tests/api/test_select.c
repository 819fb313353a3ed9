/* Backend selection and what its failures say. The GPU runtimes are opened once per process, so each
 * case is its own run of this program, registered in tests/api/meson.build with the environment it
 * needs (PKV_BACKEND, PKV_CUDA_DRIVER, PKV_HIP_RUNTIME pointing at missing or wrong libraries) and the
 * outcome it must have:
 *
 *   test_select BACKEND gets=NAME [ARG...]     a context asked for BACKEND runs on backend NAME
 *   test_select BACKEND fails=STATUS [ARG...]  asking for BACKEND fails with STATUS (e.g. PKV_ERR_NO_DEVICE)
 *   ARG: says=TEXT        the failure text contains TEXT
 *        detail=NAME:TEXT pkv_backend_query(NAME)'s detail contains TEXT
 *        devices=NAME:N   pkv_backend_query(NAME) reports N usable devices
 *        skips=STATUS     failing with STATUS skips the case (a machine without the device)
 *
 * BACKEND is a pkv_backend name for pkv_context_desc.backend ("auto" leaves it to PKV_BACKEND). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pagedkv.h"

static int argc_;
static char **argv_;

static pkv_backend backend_named(const char *name) {
  static const pkv_backend all[] = {PKV_BACKEND_AUTO, PKV_BACKEND_CPU, PKV_BACKEND_CUDA, PKV_BACKEND_HIP};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (strcmp(pkv_backend_name(all[i]), name) == 0) return all[i];
  fail_msg("unknown backend name %s", name);
  return PKV_BACKEND_AUTO;
}

/* "PKV_ERR_NO_DEVICE" for PKV_ERR_NO_DEVICE: pkv_status_string's text up to the colon. */
static int status_is(pkv_status st, const char *name) {
  const char *text = pkv_status_string(st);
  const size_t n = strlen(name);
  return strncmp(text, name, n) == 0 && (text[n] == ':' || text[n] == '\0');
}

static void outcome(void **state) {
  (void)state;
  pkv_context_desc desc = PKV_CONTEXT_DESC_INIT;
  pkv_context *ctx = NULL;
  char text[1024];
  desc.backend = backend_named(argv_[1]);
  const pkv_status st = pkv_context_create(&desc, &ctx);
  strncpy(text, pkv_last_error(), sizeof text - 1);
  text[sizeof text - 1] = '\0';
  print_message("    %s: %s\n", pkv_status_string(st), text);

  for (int i = 3; i < argc_; i++)
    if (strncmp(argv_[i], "skips=", 6) == 0 && status_is(st, argv_[i] + 6)) skip();

  const char *expected = argv_[2];
  if (strncmp(expected, "gets=", 5) == 0) {
    pkv_backend got;
    if (st != PKV_OK) fail_msg("expected a context on %s, got %s", expected + 5, text);
    assert_int_equal(pkv_context_backend(ctx, &got), PKV_OK);
    assert_string_equal(pkv_backend_name(got), expected + 5);
    assert_int_equal(pkv_context_destroy(ctx), PKV_OK);
  } else if (strncmp(expected, "fails=", 6) == 0) {
    if (st == PKV_OK) pkv_context_destroy(ctx);
    if (!status_is(st, expected + 6)) fail_msg("expected %s, got %s", expected + 6, pkv_status_string(st));
  } else {
    fail_msg("the second argument must be gets=NAME or fails=STATUS, not %s", expected);
  }

  for (int i = 3; i < argc_; i++) {
    if (strncmp(argv_[i], "says=", 5) == 0) {
      if (!strstr(text, argv_[i] + 5)) fail_msg("the failure text does not say \"%s\"", argv_[i] + 5);
    } else if (strncmp(argv_[i], "detail=", 7) == 0) {
      char name[16] = {0};
      const char *colon = strchr(argv_[i] + 7, ':');
      if (!colon || (size_t)(colon - argv_[i] - 7) >= sizeof name) fail_msg("detail=NAME:TEXT, not %s", argv_[i]);
      memcpy(name, argv_[i] + 7, (size_t)(colon - argv_[i] - 7));
      pkv_backend_info info = PKV_BACKEND_INFO_INIT;
      assert_int_equal(pkv_backend_query(backend_named(name), &info), PKV_OK);
      print_message("    %s: %s\n", name, info.detail);
      if (!strstr(info.detail, colon + 1)) fail_msg("%s's detail does not say \"%s\"", name, colon + 1);
    } else if (strncmp(argv_[i], "devices=", 8) == 0) {
      char name[16] = {0};
      const char *colon = strchr(argv_[i] + 8, ':');
      if (!colon || (size_t)(colon - argv_[i] - 8) >= sizeof name) fail_msg("devices=NAME:N, not %s", argv_[i]);
      memcpy(name, argv_[i] + 8, (size_t)(colon - argv_[i] - 8));
      pkv_backend_info info = PKV_BACKEND_INFO_INIT;
      assert_int_equal(pkv_backend_query(backend_named(name), &info), PKV_OK);
      if (info.device_count != atoi(colon + 1))
        fail_msg("%s reports %d devices, want %s (%s)", name, info.device_count, colon + 1, info.detail);
    } else if (strncmp(argv_[i], "skips=", 6) != 0) {
      fail_msg("unknown argument %s", argv_[i]);
    }
  }
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s BACKEND gets=NAME|fails=STATUS [says=TEXT] [detail=NAME:TEXT] [skips=STATUS]...\n",
            argv[0]);
    return 2;
  }
  argc_ = argc;
  argv_ = argv;
  const struct CMUnitTest tests[] = {cmocka_unit_test(outcome)};
  return tu_run_tests(tests, NULL, NULL);
}
