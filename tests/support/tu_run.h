/* Runs a group of cmocka tests as cmocka_run_group_tests does, with one difference in the exit status:
 * when no test failed and every test that ran skipped, it returns 77, which meson (and automake) count
 * as a skipped test program rather than a pass. A failure returns 1 (cmocka's own count of failures
 * could be 77 too). Every test program's main returns through it. PKV_TEST_FILTER="pattern" (cmocka's
 * * and ? wildcards) runs only the cases it names. */
#ifndef PKV_TU_RUN_H
#define PKV_TU_RUN_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#ifdef __cplusplus
extern "C" {
#endif

int tu_run_group(const char *group_name, const struct CMUnitTest *tests, size_t count, CMFixtureFunction group_setup,
                 CMFixtureFunction group_teardown);

#ifdef __cplusplus
}
#endif

#define tu_run_tests(tests, group_setup, group_teardown)                                                   \
  tu_run_group(#tests, tests, sizeof(tests) / sizeof((tests)[0]), group_setup, group_teardown)

#endif
