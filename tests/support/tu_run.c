/* tu_run_group: cmocka 1.1.5 returns only the number of failed tests, so a program whose every test
 * skipped would exit 0 and count as passed. Each test runs here behind a wrapper that notes whether
 * its body returned (cmocka leaves a body by longjmp on a skip or a failure): no failure and no body
 * returned means every test skipped.
 *
 * The wrapper learns which test it runs from the state cmocka hands its setup: each test's
 * initial_state is its record here, and the group setup's state is kept aside (cmocka would give it
 * to every test instead of initial_state) and handed on as cmocka would. */
#include "tu_run.h"

#include <stdio.h>
#include <stdlib.h>

#include "testutil.h"

typedef struct tu_record {
  const struct CMUnitTest *test;
} tu_record;

static const tu_record *g_current;
static void *g_group_state;
static CMFixtureFunction g_group_setup, g_group_teardown;
static size_t g_started, g_returned;

static int group_setup(void **state) {
  int rc = g_group_setup(&g_group_state);
  *state = NULL;
  return rc;
}

static int group_teardown(void **state) {
  (void)state;
  return g_group_teardown(&g_group_state);
}

static int test_setup(void **state) {
  g_current = (const tu_record *)*state;
  *state = g_group_state ? g_group_state : g_current->test->initial_state;
  return g_current->test->setup_func ? g_current->test->setup_func(state) : 0;
}

static void test_body(void **state) {
  g_started++;
  if (g_current->test->test_func) g_current->test->test_func(state);
  g_returned++;
}

int tu_run_group(const char *group_name, const struct CMUnitTest *tests, size_t count, CMFixtureFunction group_setup_fn,
                 CMFixtureFunction group_teardown_fn) {
  struct CMUnitTest *wrapped = (struct CMUnitTest *)calloc(count ? count : 1, sizeof *wrapped);
  tu_record *records = (tu_record *)calloc(count ? count : 1, sizeof *records);
  const char *filter = getenv("PKV_TEST_FILTER");
  int failed;
  size_t i;
  if (!wrapped || !records) {
    fprintf(stderr, "tu_run_group: out of memory\n");
    return 1;
  }
  for (i = 0; i < count; i++) {
    records[i].test = &tests[i];
    wrapped[i] = tests[i];
    wrapped[i].initial_state = &records[i];
    wrapped[i].setup_func = test_setup;
    wrapped[i].test_func = test_body;
  }
  g_group_setup = group_setup_fn;
  g_group_teardown = group_teardown_fn;
  g_group_state = NULL;
  g_started = g_returned = 0;
  if (filter && *filter) cmocka_set_test_filter(filter);
  failed = _cmocka_run_group_tests(group_name, wrapped, count, group_setup_fn ? group_setup : NULL,
                                   group_teardown_fn ? group_teardown : NULL);
  free(wrapped);
  free(records);
  if (failed != 0) return 1;
  if (g_started > 0 && g_returned == 0) {
    printf("# every test of %s skipped: exit status %d (skipped)\n", group_name, TU_EXIT_SKIP);
    return TU_EXIT_SKIP;
  }
  return 0;
}
