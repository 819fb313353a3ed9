#!/usr/bin/env python3
"""Checks of what pagedkv exposes to the programs that link or load it (docs/abi.md).

  abi_check.py symbols NM LIB SYMBOLS        LIB's exported symbols (name@@version) are SYMBOLS' list
  abi_check.py write-symbols NM LIB SYMBOLS  writes LIB's exported symbols to SYMBOLS
  abi_check.py dump ABIDW LIB INCLUDE OUT    writes LIB's ABI (public types only) to OUT
  abi_check.py abidiff ABIDW ABIDIFF LIB INCLUDE BASELINE
                                             LIB's ABI has no change against BASELINE
  abi_check.py static NM READELF ARCHIVE SYMBOLS EXE
                                             ARCHIVE defines no global symbol an engine could clash with
                                             but SYMBOLS' functions; EXE, linked with it, needs no .so
  abi_check.py table HEADER                  pkv_api has one entry per public function, same signature
  abi_check.py header INCLUDE CC CXX         the public headers compile alone, warning-free, as C99
                                             -pedantic, C11 and C++17 (CC, CXX: ';'-joined commands)
  abi_check.py dll OBJDUMP DLL SYMBOLS       pagedkv.dll exports SYMBOLS' names, imports system DLLs only
  abi_check.py static-win OBJDUMP ARCHIVE    the Windows static library carries no dllexport
  abi_check.py no-vendor READELF NM LIB      LIB links no GPU runtime: no libcuda/libcudart/libamdhip
                                             among its NEEDED libraries, no cu*/cuda*/hip* symbol

Exit status: 0 pass, 1 fail, 77 skip (meson's convention), with the reason on stdout.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77


def run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def fail(message):
    print("FAIL: " + message)
    sys.exit(1)


def read_list(path):
    with open(path) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def exported_symbols(nm, lib):
    """Defined dynamic symbols as name@@version; the version nodes themselves (type A) left out."""
    out = run([nm, "-D", "--defined-only", lib], check=True).stdout
    return sorted(fields[2] for fields in (line.split() for line in out.splitlines()) if len(fields) == 3
                  and fields[1] != "A")


def write_symbols(nm, lib, symbols_file):
    with open(symbols_file, "w") as f:
        f.write("# Exported symbols of libpagedkv.so, as name@@version-node, one a line. Written by tools/abi-update;\n"
                "# tests/abi/abi_check.py compares the built libraries with it.\n")
        f.writelines(name + "\n" for name in exported_symbols(nm, lib))


def check_symbols(nm, lib, symbols_file):
    got, want = exported_symbols(nm, lib), read_list(symbols_file)
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    if extra or missing:
        fail(f"{lib} exports differ from {symbols_file}:\n" +
             "".join(f"  + {s} (new: if deliberate, compatible and in a new version node, run "
                     f"tools/abi-update)\n" for s in extra) +
             "".join(f"  - {s} (removed: breaks every program that uses it)\n" for s in missing))
    print(f"{len(got)} exported symbols, as in {symbols_file}")


def has_debug_info(lib):
    with open(lib, "rb") as f:
        return b".debug_info" in f.read()


def dump(abidw, lib, include, out):
    """The baseline and what is compared with it, both written here: public types only (those declared
    under INCLUDE), and no paths or line numbers, which differ between checkouts."""
    if not has_debug_info(lib):
        fail(f"{lib} has no debug info: abidw would see no types (build with -g, e.g. debugoptimized)")
    result = run([abidw, "--headers-dir", include, "--exported-interfaces-only", "--drop-private-types",
                  "--no-corpus-path", "--no-comp-dir-path", "--no-show-locs", "--no-elf-needed",
                  "--type-id-style", "hash", "--out-file", out, lib])
    if result.returncode != 0:
        fail(f"abidw failed ({result.returncode}):\n{result.stdout}{result.stderr}")


def check_abidiff(abidw, abidiff, lib, include, baseline):
    if not shutil.which(abidiff) or not shutil.which(abidw):
        print("skipped: abidw/abidiff not found (tools/install-deps installs abigail-tools)")
        sys.exit(SKIP)
    if not has_debug_info(lib):
        print(f"skipped: {lib} was built without debug info, which abidiff needs to see types")
        sys.exit(SKIP)
    with tempfile.TemporaryDirectory() as tmp:
        current = os.path.join(tmp, "current.abi")
        dump(abidw, lib, include, current)
        # The baseline is recorded on x86-64; another 64-bit Linux target (aarch64) must have the same
        # types and symbols, so the architecture itself is left out of the comparison.
        result = run([abidiff, "--no-default-suppression", "--no-architecture", baseline, current])
        # What abidiff calls harmless (a new enumerator, say) exits 0 unless asked for: asked, so the
        # baseline always records the whole ABI and a later removal of the addition is caught too.
        harmless = run([abidiff, "--no-default-suppression", "--no-architecture", "--harmless", baseline, current])
    # Any non-zero status is a change: bit 2 (4) an ABI change, bit 3 (8) an incompatible one (a removed
    # symbol); a type change such as a struct's layout or an enum value sets only bit 2.
    if result.returncode != 0:
        kind = "incompatible change" if result.returncode & 8 else "ABI change"
        fail(f"abidiff {baseline} {lib} exited {result.returncode} ({kind}):\n{result.stdout}{result.stderr}\n"
             "A compatible addition (a new function, a field at the end of a struct with the version rules of "
             "docs/abi.md) is recorded with tools/abi-update; anything else needs a new major version.")
    if harmless.returncode != 0:
        fail(f"abidiff --harmless {baseline} {lib} exited {harmless.returncode}: compatible changes the baseline "
             f"does not record yet; record them with tools/abi-update:\n{harmless.stdout}{harmless.stderr}")
    print(f"no ABI change against {baseline}")


# C++ vague-linkage entities of the standard library (template instantiations, their local statics,
# vtables, typeinfo, guard variables), by mangled name: std:: ('St', or the abbreviations Sa Sb Ss Si
# So Sd) or __gnu_cxx::, possibly nested (N), const-qualified (K), or a local entity (Z) of one; and
# the placement forms of operator new and delete, inline in <new>, which a build without inlining keeps.
STD_VAGUE = re.compile(r"^_Z(?:(?:T[VIS]|GV|Z)?N?[KVr]*(?:St|S[absiod]|9__gnu_cxx)|n[wa]mPv$|d[la]PvS_$)")
# ... but not one over our own types (pkv::..., pkv_...): an engine has no identical copy of that.
OUR_TYPES = re.compile(r"3pkv\d|\dpkv_")
# The words exception tables reach the personality routine and standard typeinfo through: shared
# with the program's own copies on purpose (tools/static-archive says why).
EH_REFS = re.compile(r"^DW\.ref\.(__gxx_personality_v0|_ZTISt)")


def check_static(nm, readelf, archive, symbols_file, exe):
    """Every defined global symbol of the archive is one of ours, pkv_*, or a weak/unique (COMDAT)
    instantiation of the C++ standard library over standard types: those are identical in every program
    built with the same library headers and merge with an engine's own copies instead of clashing.
    Anything else (our C++ internals, a helper without static, a strong symbol of any name) fails."""
    out = run([nm, "--defined-only", "-g", archive], check=True).stdout
    ours, vague, bad = [], [], []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) != 3:
            continue
        kind, name = fields[1], fields[2]
        if name.startswith("pkv_") and kind == "T":
            ours.append(name)
        elif kind in "WVu" and (STD_VAGUE.match(name) or EH_REFS.match(name)) and not OUR_TYPES.search(name):
            vague.append(name)
        else:
            bad.append(f"{kind} {name}")
    if bad:
        fail(f"{archive} defines global symbols that may clash with an engine's:\n  " + "\n  ".join(bad))
    want = sorted(s.split("@")[0] for s in read_list(symbols_file))
    if sorted(ours) != want:
        fail(f"{archive}'s pkv_* functions differ from {symbols_file}: extra {sorted(set(ours) - set(want))}, "
             f"missing {sorted(set(want) - set(ours))}")
    needed = run([readelf, "-d", exe], check=True).stdout
    if "pagedkv" in needed:
        fail(f"{exe} was to link libpagedkv.a alone, yet needs a shared pagedkv:\n{needed}")
    print(f"{archive}: {len(ours)} pkv_* functions global, {len(vague)} weak C++ standard library "
          f"instantiations, nothing else; {os.path.basename(exe)} needs no shared pagedkv")


def normalise(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r"\s*([*(),])\s*", r"\1", text)


def check_table(header):
    with open(header) as f:
        source = f.read()
    functions = {name: (normalise(ret), normalise(params)) for ret, name, params in
                 re.findall(r"PKV_API\s+([^;{}#]+?)\b(pkv_\w+)\s*\(([^;]*?)\);", source)}
    functions.pop("pkv_get_api")
    body = re.search(r"typedef struct pkv_api \{(.*?)\} pkv_api;", source, re.S).group(1)
    entries = re.findall(r"([^;{}]+?)\(\s*\*\s*(\w+)\s*\)\s*\(([^;]*?)\);", re.sub(r"/\*.*?\*/", "", body))
    problems, seen = [], set()
    for ret, name, params in entries:
        ret = normalise(ret)
        function = "pkv_" + name
        if function in seen:
            problems.append(f"{name} appears twice")
        seen.add(function)
        if function not in functions:
            problems.append(f"entry {name}: no public function {function}")
        elif functions[function] != (ret, normalise(params)):
            problems.append(f"entry {name} is {ret}({normalise(params)}), {function} is "
                            f"{functions[function][0]}({functions[function][1]})")
    problems += [f"{f} has no entry in pkv_api: append one under a new PKV_API_VERSION"
                 for f in functions if f not in seen]
    if problems:
        fail("pkv_api and the public functions disagree:\n  " + "\n  ".join(problems))
    print(f"pkv_api: {len(entries)} entries, one per public function but pkv_get_api, signatures equal")


# A translation unit that includes one header first and alone, and uses every initialiser macro, so
# a warning a user's program would get from them shows here too.
HEADER_USE = """#include "{header}"
int pkv_header_check(void);
int pkv_header_check(void) {{
  pkv_context_desc a = PKV_CONTEXT_DESC_INIT;
  pkv_backend_info b = PKV_BACKEND_INFO_INIT;
  pkv_pool_desc c = PKV_POOL_DESC_INIT;
  pkv_write_args d = PKV_WRITE_ARGS_INIT;
  pkv_read_args e = PKV_READ_ARGS_INIT;
  pkv_decode_args f = PKV_DECODE_ARGS_INIT;
  pkv_pool_stats g = PKV_POOL_STATS_INIT;
  return (int)(a.struct_size + b.struct_size + c.struct_size + d.struct_size + e.struct_size +
               f.struct_size + g.struct_size);
}}
"""
WARNINGS = ["-Wall", "-Wextra", "-Wpedantic", "-Werror", "-Wshadow", "-Wcast-qual", "-Wundef"]
MODES = [("c", ["-std=c99", "-pedantic", "-Wstrict-prototypes", "-Wmissing-prototypes"]),
         ("c", ["-std=c11", "-Wstrict-prototypes", "-Wmissing-prototypes"]),
         ("c++", ["-std=c++17", "-Wzero-as-null-pointer-constant"])]


def check_header(include, cc, cxx):
    headers = sorted(h for h in os.listdir(include) if h.endswith(".h"))
    problems, count = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for header in headers:
            for language, flags in MODES:
                source = os.path.join(tmp, header.replace(".", "_") + (".c" if language == "c" else ".cpp"))
                with open(source, "w") as f:
                    f.write(HEADER_USE.format(header=header))
                compiler = (cc if language == "c" else cxx).split(";")
                cmd = compiler + flags + WARNINGS + ["-I", include, "-fsyntax-only", source]
                result = run(cmd)
                count += 1
                if result.returncode != 0 or result.stderr.strip():
                    problems.append(f"{header} as {' '.join(flags[:1])}:\n{result.stderr}")
    if problems:
        fail("\n".join(problems))
    print(f"{', '.join(headers)}: {count} compilations without a warning")


def check_dll(objdump, dll, symbols_file):
    out = run([objdump, "-p", dll], check=True).stdout
    table = re.search(r"\[Ordinal/Name Pointer\] Table\n(.*?)\n\n", out, re.S)
    exports = sorted(re.findall(r"\]\s+(\S+)$", table.group(1), re.M)) if table else []
    want = sorted(s.split("@")[0] for s in read_list(symbols_file))
    if exports != want:
        fail(f"{dll} exports differ from {symbols_file}:\n  extra {sorted(set(exports) - set(want))}\n"
             f"  missing {sorted(set(want) - set(exports))}")
    imports = sorted(set(re.findall(r"DLL Name: (\S+)", out)))
    # What every Windows has: a DLL built with MinGW's -static needs no runtime of its own beside it.
    system = re.compile(r"^(kernel32|msvcrt|ucrtbase|advapi32|user32|ntdll|api-ms-win-.*)\.dll$", re.I)
    foreign = [name for name in imports if not system.match(name)]
    if foreign:
        fail(f"{dll} imports DLLs that are not part of Windows: {foreign}")
    print(f"{dll}: exports the {len(exports)} functions of {symbols_file}; imports only {', '.join(imports)}")


def check_static_windows(objdump, archive):
    # objdump exits 1 when a member has no .drectve section: that is the normal case here.
    out = run([objdump, "-s", "-j", ".drectve", archive]).stdout
    if "file format" not in out:
        fail(f"{objdump} could not read {archive}")
    text = "".join(re.findall(r"^ [0-9a-f]{4} [0-9a-f ]{35} (.*)$", out, re.M))  # the dump's text column
    if "-export:" in text:
        fail(f"{archive} carries dllexport directives: a program linking it would export our functions\n{out}")
    print(f"{archive}: no dllexport directives")


def check_no_vendor(readelf, nm, lib):
    """GPU runtimes are opened at run time (docs/cuda.md), never linked: a stray -lcuda would link
    the toolkit's stub silently."""
    needed = re.findall(r"\(NEEDED\).*\[(.*)\]", run([readelf, "-d", lib], check=True).stdout)
    vendor = [n for n in needed if re.match(r"lib(cuda|cudart|nvrtc|amdhip|hiprtc)", n)]
    undefined = run([nm, "-D", "--undefined-only", lib], check=True).stdout.split()
    symbols = [n for n in undefined if re.match(r"(cu[A-Z]|cuda|hip[A-Z])", n)]
    if vendor or symbols:
        fail(f"{lib} links a GPU runtime: NEEDED {vendor}, undefined {symbols}")
    print(f"{lib}: NEEDED {needed}; no GPU runtime linked")


def main(argv):
    command, args = argv[1], argv[2:]
    commands = {"symbols": check_symbols, "write-symbols": write_symbols, "dump": dump, "abidiff": check_abidiff, "static": check_static,
                "table": check_table, "header": check_header, "dll": check_dll,
                "static-win": check_static_windows, "no-vendor": check_no_vendor}
    commands[command](*args)


if __name__ == "__main__":
    main(sys.argv)
