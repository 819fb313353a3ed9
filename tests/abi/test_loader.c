/* The runtime loader (include/pagedkv_loader.h) against the built shared library: open by path and
 * by the default name, one engine round trip through the table, and the failures a program meets
 * (no such file, a library that is not pagedkv, a table version the library lacks) with their texts.
 * Usage: test_loader PATH-TO-SHARED-LIBRARY; the default name must be findable (the meson test sets
 * LD_LIBRARY_PATH, or on Windows the working folder). This program links no pagedkv. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>
#include "tu_run.h"

#include <stdio.h>
#include <string.h>

#include "pagedkv_loader.h"
#include "roundtrip.h"

#if defined(_WIN32)
#define NOT_PAGEDKV "kernel32.dll"
#else
#define NOT_PAGEDKV "libm.so.6"
#endif

static const char *g_path;

static void assert_contains(const char *text, const char *part) {
  if (!strstr(text, part)) fail_msg("\"%s\" does not contain \"%s\"", text, part);
}

static void assert_closed_with_error(const pkv_loader *lib) {
  assert_null(lib->api);
  assert_null(lib->handle);
  assert_contains(lib->error, "pkv_loader_open: ");
}

static void open_by_path(void **state) {
  (void)state;
  pkv_loader lib;
  assert_int_equal(pkv_loader_open(&lib, g_path, PKV_API_VERSION), PKV_OK);
  assert_string_equal(lib.error, "");
  assert_non_null(lib.handle);
  assert_true(lib.api->struct_size >= sizeof(pkv_api));
  assert_true(lib.api->api_version >= PKV_API_VERSION);
  /* built from the same tree as this header */
  assert_int_equal(lib.api->version(), PKV_VERSION_NUMBER);
  assert_string_equal(lib.api->version_string(), PKV_VERSION_STRING);
  rt_round_trip(lib.api);
  pkv_loader_close(&lib);
  assert_null(lib.api);
  assert_null(lib.handle);
}

static void open_by_default_name(void **state) {
  (void)state;
  pkv_loader lib;
  if (pkv_loader_open(&lib, NULL, PKV_API_VERSION) != PKV_OK) fail_msg("%s", lib.error);
  rt_round_trip(lib.api);
  pkv_loader_close(&lib);
}

static void missing_file(void **state) {
  (void)state;
  char path[4096];
  snprintf(path, sizeof path, "%s.missing", g_path);
  pkv_loader lib;
  assert_int_equal(pkv_loader_open(&lib, path, PKV_API_VERSION), PKV_ERR_NO_DEVICE);
  assert_closed_with_error(&lib);
  assert_contains(lib.error, path);
  /* the OS's reason follows the path */
  assert_true(strlen(strstr(lib.error, path) + strlen(path)) > strlen("\": "));
  printf("# %s\n", lib.error);
}

static void not_pagedkv(void **state) {
  (void)state;
  pkv_loader lib;
  assert_int_equal(pkv_loader_open(&lib, NOT_PAGEDKV, PKV_API_VERSION), PKV_ERR_VERSION);
  assert_closed_with_error(&lib);
  assert_contains(lib.error, "pkv_get_api");
  assert_contains(lib.error, NOT_PAGEDKV);
  printf("# %s\n", lib.error);
}

static void version_not_offered(void **state) {
  (void)state;
  char asked[64], offered[64];
  const uint32_t versions[] = {0, PKV_API_VERSION + 1, UINT32_MAX};
  for (size_t i = 0; i < sizeof versions / sizeof versions[0]; i++) {
    pkv_loader lib;
    assert_int_equal(pkv_loader_open(&lib, g_path, versions[i]), PKV_ERR_VERSION);
    assert_closed_with_error(&lib);
    snprintf(asked, sizeof asked, "asks for version %u ", (unsigned)versions[i]);
    snprintf(offered, sizeof offered, "offers function table versions 1 to %u;", (unsigned)PKV_API_VERSION);
    assert_contains(lib.error, asked);
    assert_contains(lib.error, offered);
    assert_contains(lib.error, PKV_VERSION_STRING);
  }
}

static void null_loader(void **state) {
  (void)state;
  assert_int_equal(pkv_loader_open(NULL, g_path, PKV_API_VERSION), PKV_ERR_INVALID_ARGUMENT);
  pkv_loader_close(NULL);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s PATH-TO-SHARED-LIBRARY\n", argv[0]);
    return 2;
  }
  g_path = argv[1];
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(open_by_path),   cmocka_unit_test(open_by_default_name),
      cmocka_unit_test(missing_file),   cmocka_unit_test(not_pagedkv),
      cmocka_unit_test(version_not_offered), cmocka_unit_test(null_loader),
  };
  return tu_run_tests(tests, NULL, NULL);
}
