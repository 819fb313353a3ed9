/* pkv-info: the pagedkv library's version and what each backend offers on this machine: for a GPU
 * backend the runtime library it opened and the devices it found, or every library it tried and
 * what each answered. --version prints the version alone. */
#include <stdio.h>
#include <string.h>

#include "pagedkv.h"

/* Prints a failure: the detail text is copied before any other pagedkv call can replace it. */
static void print_failure(const char *what, pkv_status st) {
  char detail[512];
  strncpy(detail, pkv_last_error(), sizeof detail - 1);
  detail[sizeof detail - 1] = '\0';
  printf("%s: %s%s%s\n", what, pkv_status_string(st), detail[0] ? ": " : "", detail);
}

static void usage(FILE *to) {
  fprintf(to, "usage: pkv-info [--version | --help]\n"
              "Prints the version of the pagedkv library loaded (and of the header this program was built\n"
              "with), then, for each backend (cpu, cuda, hip), whether it is compiled in, the devices it\n"
              "finds and the runtime library it opened, or the reason it has none, and last the backend a\n"
              "context with PKV_BACKEND_AUTO gets (the environment variable PKV_BACKEND picks one).\n"
              "  --version  print the library's version (MAJOR.MINOR.PATCH) and exit\n"
              "  --help     print this text and exit\n");
}

int main(int argc, char **argv) {
  static const pkv_backend backends[] = {PKV_BACKEND_CPU, PKV_BACKEND_CUDA, PKV_BACKEND_HIP};
  pkv_context_desc desc = PKV_CONTEXT_DESC_INIT;
  pkv_context *ctx = NULL;
  pkv_backend chosen = PKV_BACKEND_AUTO;
  pkv_status st;
  size_t i;
  const uint32_t v = pkv_version();

  if (argc > 1 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
    usage(stdout);
    return 0;
  }
  if (argc > 1 && strcmp(argv[1], "--version") == 0) {
    printf("%s\n", pkv_version_string());
    return 0;
  }
  if (argc > 1) {
    fprintf(stderr, "pkv-info: unknown argument %s\n", argv[1]);
    usage(stderr);
    return 2;
  }

  /* pkv_version() packs MAJOR * 10000 + MINOR * 100 + PATCH. */
  printf("pagedkv %u.%u.%u (header %s)\n", (unsigned)(v / 10000), (unsigned)(v / 100 % 100), (unsigned)(v % 100),
         PKV_VERSION_STRING);

  for (i = 0; i < sizeof backends / sizeof backends[0]; i++) {
    pkv_backend_info info = PKV_BACKEND_INFO_INIT;
    st = pkv_backend_query(backends[i], &info);
    if (st != PKV_OK) {
      printf("%-5s ", pkv_backend_name(backends[i]));
      print_failure("pkv_backend_query failed", st);
      continue;
    }
    info.detail[sizeof info.detail - 1] = '\0';
    printf("%-5s %-12s devices: %d  %s\n", pkv_backend_name(backends[i]),
           info.compiled ? "compiled in" : "not compiled", (int)info.device_count, info.detail);
    /* The detail has room for 255 characters; asking for a context gives the whole story. */
    if (info.compiled && info.device_count == 0 && strlen(info.detail) == sizeof info.detail - 1) {
      desc.backend = backends[i];
      st = pkv_context_create(&desc, &ctx);
      if (st == PKV_OK) pkv_context_destroy(ctx);
      else print_failure("      in full", st);
      ctx = NULL;
      desc.backend = PKV_BACKEND_AUTO;
    }
  }

  /* What a context with PKV_BACKEND_AUTO (honouring PKV_BACKEND) would run on. */
  st = pkv_context_create(&desc, &ctx);
  if (st == PKV_OK) st = pkv_context_backend(ctx, &chosen);
  if (st == PKV_OK)
    printf("default backend (auto): %s\n", pkv_backend_name(chosen));
  else
    print_failure("default backend (auto): none", st);
  if (ctx && (st = pkv_context_destroy(ctx)) != PKV_OK) print_failure("pkv_context_destroy", st);
  return 0;
}
