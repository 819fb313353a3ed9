/*
 * pagedkv_loader.h: opens the pagedkv shared library at run time and hands back its function table,
 * so a program needs neither the library nor an import library when it is linked. Header-only;
 * C99, C11 and C++; dlopen on Linux (and other systems that have it), LoadLibrary on Windows.
 *
 *   pkv_loader lib;
 *   if (pkv_loader_open(&lib, NULL, PKV_API_VERSION) != PKV_OK) {
 *     fprintf(stderr, "%s\n", lib.error);
 *     return 1;
 *   }
 *   pkv_context_desc cd = PKV_CONTEXT_DESC_INIT;
 *   pkv_context *ctx;
 *   if (lib.api->context_create(&cd, &ctx) != PKV_OK) fprintf(stderr, "%s\n", lib.api->last_error());
 *   ...
 *   pkv_loader_close(&lib);
 *
 * Only the table entries up to the version asked for may be used (the table may hold more). With
 * glibc older than 2.34, link the program with -ldl. On Windows this header includes <windows.h>.
 */
#ifndef PAGEDKV_LOADER_H
#define PAGEDKV_LOADER_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "pagedkv.h"

#if defined(_WIN32)
#include <windows.h>
#else
#include <dlfcn.h>
#endif

/* The file pkv_loader_open opens when given no path, found by the platform's own search: on Linux
 * LD_LIBRARY_PATH, the program's RUNPATH and the system's library folders; on Windows the program's
 * folder, the system folders, the current folder and PATH. On Linux the name carries the ABI's major
 * version (the shared library's soname). */
#if defined(_WIN32)
#define PKV_LOADER_DEFAULT_NAME "pagedkv.dll"
#else
#define PKV_LOADER_DEFAULT_NAME "libpagedkv.so." PKV_STRINGIFY(PKV_VERSION_MAJOR)
#endif

typedef struct pkv_loader {
  void *handle;       /* the dlopen / LoadLibrary handle; NULL when not open */
  const pkv_api *api; /* the library's function table; NULL when not open */
  char error[512];    /* why the last pkv_loader_open failed, with the OS's own words; "" after success */
} pkv_loader;

#ifdef __cplusplus
extern "C" {
#endif

/* Formats loader->error, cut at its size: a long path shortens the message. (Through vsnprintf: GCC
 * warned of the possible truncation at every snprintf call, in the programs that include this.) */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static inline void pkv_loader_message_(pkv_loader *loader, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(loader->error, sizeof loader->error, format, args);
  va_end(args);
}

/* Writes "pkv_loader_open: <what>: <the OS's error text>" into loader->error. */
static inline void pkv_loader_fail_(pkv_loader *loader, const char *what, const char *path) {
#if defined(_WIN32)
  char os[256];
  DWORD code = GetLastError();
  DWORD n = FormatMessageA(FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS, NULL, code, 0, os,
                           (DWORD)sizeof os, NULL);
  while (n > 0 && (os[n - 1] == '\n' || os[n - 1] == '\r' || os[n - 1] == ' ' || os[n - 1] == '.')) n--;
  os[n] = '\0';
  pkv_loader_message_(loader, "pkv_loader_open: %s \"%s\": Windows error %lu: %s", what, path, (unsigned long)code,
                      n > 0 ? os : "no description");
#else
  const char *os = dlerror();
  pkv_loader_message_(loader, "pkv_loader_open: %s \"%s\": %s", what, path, os ? os : "no description");
#endif
}

static inline void pkv_loader_close(pkv_loader *loader) {
  if (!loader) return;
  if (loader->handle) {
#if defined(_WIN32)
    FreeLibrary((HMODULE)loader->handle);
#else
    dlclose(loader->handle);
#endif
  }
  loader->handle = NULL;
  loader->api = NULL;
}

/* Opens the library at `path` (NULL: PKV_LOADER_DEFAULT_NAME), resolves pkv_get_api and takes the
 * function table of `version` (normally PKV_API_VERSION). Returns
 *   PKV_OK                    loader->api is set; close with pkv_loader_close;
 *   PKV_ERR_NO_DEVICE         the library could not be opened (not found, wrong architecture, ...);
 *   PKV_ERR_VERSION           it has no pkv_get_api, or does not offer `version`;
 *   PKV_ERR_INVALID_ARGUMENT  loader is NULL.
 * On failure loader->error says what happened (with the OS's text) and nothing stays open. */
static inline pkv_status pkv_loader_open(pkv_loader *loader, const char *path, uint32_t version) {
  pkv_status (*get_api)(uint32_t, const pkv_api **) = NULL;
  const pkv_api *api = NULL;
  pkv_status status;
  if (!loader) return PKV_ERR_INVALID_ARGUMENT;
  loader->handle = NULL;
  loader->api = NULL;
  loader->error[0] = '\0';
  if (!path) path = PKV_LOADER_DEFAULT_NAME;
#if defined(_WIN32)
  loader->handle = (void *)LoadLibraryA(path);
  if (!loader->handle) {
    pkv_loader_fail_(loader, "cannot load", path);
    return PKV_ERR_NO_DEVICE;
  }
  {
    /* Through a generic function pointer: FARPROC converts to any function pointer type. */
    void (*symbol)(void) = (void (*)(void))GetProcAddress((HMODULE)loader->handle, "pkv_get_api");
    if (symbol) get_api = (pkv_status(*)(uint32_t, const pkv_api **))symbol;
  }
#else
  loader->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!loader->handle) {
    pkv_loader_fail_(loader, "cannot load", path);
    return PKV_ERR_NO_DEVICE;
  }
  {
    /* POSIX guarantees a data pointer can hold a function's address; memcpy converts without the
     * cast ISO C forbids. */
    void *symbol = dlsym(loader->handle, "pkv_get_api");
    if (symbol) memcpy(&get_api, &symbol, sizeof get_api);
  }
#endif
  if (!get_api) {
    pkv_loader_fail_(loader, "no symbol pkv_get_api in", path);
    pkv_loader_close(loader);
    return PKV_ERR_VERSION;
  }
  status = get_api(version, &api);
  if (status != PKV_OK) {
    /* Every release of this major version offers version 1: it tells what this library is. */
    const pkv_api *first = NULL;
    if (get_api(1, &first) == PKV_OK)
      pkv_loader_message_(loader,
                          "pkv_loader_open: \"%s\" (pagedkv %s) offers function table versions 1 to %u; this "
                          "program asks for version %u (pagedkv.h %s)",
                          path, first->version_string(), (unsigned)first->api_version, (unsigned)version,
                          PKV_VERSION_STRING);
    else
      pkv_loader_message_(loader, "pkv_loader_open: \"%s\" refused function table version %u", path,
                          (unsigned)version);
    pkv_loader_close(loader);
    return status;
  }
  loader->api = api;
  return PKV_OK;
}

#ifdef __cplusplus
}
#endif

#endif /* PAGEDKV_LOADER_H */
