#!/usr/bin/env bash
# tests/cli_install: `cmake --install` of this build tree into a temporary
# prefix gives bin/kvlm, lib/libkvlm.a, lib/libkvlm.so with its soname chain,
# include/kvlm.h (alone, self-contained) and lib/pkgconfig/kvlm.pc;
# examples/generate.c built through pkg-config with examples/Makefile, and
# through find_package(kvlm) with examples/CMakeLists.txt (kvlm::kvlm and
# kvlm::kvlm_static, from lib/cmake/kvlm with its version file), against
# the shared and the static library, prints what `kvlm run --temp 0` prints;
# the docs are in share/doc/kvlm;
# libkvlm.so exports exactly the functions kvlm.h declares.
# In a sanitizer build kvlm.pc's Libs carry -fsanitize=..., so the example
# links the sanitizers' runtime like the library and both variants run here too.
set -uo pipefail
KVLM="${KVLM_BIN:?KVLM_BIN must point at the kvlm binary}"
MODELS="${KVLM_MODELS:-${KVLM_MODELS_DEFAULT:-../shared/models}}"
MODEL="$MODELS/stories260K.gguf"
SRC="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="$(cd "$(dirname "$KVLM")" && pwd)"
CACHE="$BUILD/CMakeCache.txt"
[ -f "$MODEL" ] || { echo "SKIP: no $MODEL"; exit 77; }
[ -f "$CACHE" ] || { echo "SKIP: $KVLM is not in a CMake build tree"; exit 77; }
for tool in pkg-config make cc nm readelf; do
  command -v "$tool" >/dev/null || { echo "SKIP: $tool not found"; exit 77; }
done
cache_var() { sed -n "s/^$1:[A-Z]*=//p" "$CACHE"; }
CMAKE="$(cache_var CMAKE_COMMAND)"
LIBDIR="$(cache_var CMAKE_INSTALL_LIBDIR)"
VERSION="$(cache_var CMAKE_PROJECT_VERSION)"
if [ "$(cache_var KVLM_SHARED)" = OFF ]; then echo "SKIP: built with -DKVLM_SHARED=OFF"; exit 77; fi

T="$(mktemp -d)"
trap 'rm -rf "$T"' EXIT
P="$T/prefix"
passed=0 failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }
check() { local what="$1"; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }

if ! "$CMAKE" --install "$BUILD" --prefix "$P" >"$T/install.log" 2>&1; then
  cat "$T/install.log"; echo "FAIL cmake --install"; exit 1
fi
ok "cmake --install $BUILD --prefix \$T/prefix"

# the layout
L="$P/$LIBDIR"
check "bin/kvlm" test -x "$P/bin/kvlm"
check "$LIBDIR/libkvlm.a" test -f "$L/libkvlm.a"
check "include/ holds kvlm.h and nothing else" test "$(cd "$P/include" && ls -A)" = kvlm.h
check "$LIBDIR/pkgconfig/kvlm.pc" test -f "$L/pkgconfig/kvlm.pc"
check "$LIBDIR/cmake/kvlm: kvlmConfig.cmake and kvlmConfigVersion.cmake" \
  test -f "$L/cmake/kvlm/kvlmConfig.cmake" -a -f "$L/cmake/kvlm/kvlmConfigVersion.cmake"
check "share/doc/kvlm: README.md, cli.md, library.md" \
  test -f "$P/share/doc/kvlm/README.md" -a -f "$P/share/doc/kvlm/cli.md" -a -f "$P/share/doc/kvlm/library.md"
soname="$(readelf -d "$L/libkvlm.so" 2>/dev/null | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')"
check "soname $soname is libkvlm.so.${VERSION%%.*}" test "$soname" = "libkvlm.so.${VERSION%%.*}"
check "libkvlm.so -> $soname -> libkvlm.so.$VERSION" \
  test "$(readlink "$L/libkvlm.so")" = "$soname" -a "$(readlink "$L/$soname")" = "libkvlm.so.$VERSION" \
       -a -f "$L/libkvlm.so.$VERSION" -a ! -L "$L/libkvlm.so.$VERSION"

# the header stands alone: no private headers, nothing but the C library
echo '#include <kvlm.h>
int main(void) { return kvlm_status_name(KVLM_OK) == 0; }' >"$T/hdr.c"
check "kvlm.h compiles alone (-std=c11 -pedantic -Werror)" \
  cc -std=c11 -pedantic -Wall -Wextra -Werror -I"$P/include" -c "$T/hdr.c" -o "$T/hdr.o"
if command -v c++ >/dev/null; then
  check "kvlm.h compiles as C++" c++ -x c++ -Wall -Wextra -Werror -I"$P/include" -c "$T/hdr.c" -o "$T/hdr_cxx.o"
fi

# pkg-config
export PKG_CONFIG_PATH="$L/pkgconfig"
check "pkg-config --modversion kvlm is $VERSION" test "$(pkg-config --modversion kvlm)" = "$VERSION"
check "pkg-config --cflags kvlm names \$prefix/include" \
  grep -q -- "-I$P/include" <<<"$(pkg-config --cflags kvlm)"
static_libs="$(pkg-config --libs --static kvlm)"
check "pkg-config --libs --static kvlm: $static_libs" \
  bash -c 'for l in -lkvlm -lpthread -lm -lpcre2-8 -lmicrohttpd -ljansson -lxxhash -lhiredis; do
             grep -qw -- "$l" <<<"$1" || exit 1; done' _ "$static_libs"

# what libkvlm.so exports: exactly the functions kvlm.h declares
nm -D --defined-only "$L/libkvlm.so" | awk '{print $NF}' | sort -u >"$T/exported"
grep -oE '\bkvlm_[a-z0-9_]+\(' "$P/include/kvlm.h" | tr -d '(' | sort -u >"$T/declared"
check "libkvlm.so exports the $(wc -l <"$T/declared") functions of kvlm.h and nothing else" \
  diff "$T/declared" "$T/exported"
check "no internal symbol (util_, op_, kv_, tok_, server_, ...) in the dynamic table" \
  bash -c '! nm -D --defined-only "$1" | awk "{print \$NF}" | grep -qvE "^kvlm_"' _ "$L/libkvlm.so"

# the example, built the documented way (examples/Makefile) against the install
mkdir -p "$T/ex"
cp "$SRC/examples/generate.c" "$SRC/examples/Makefile" "$SRC/examples/CMakeLists.txt" "$T/ex/"
progs=""
if ! make -C "$T/ex" CFLAGS="-O2 -Wall -Wextra -Werror" generate >"$T/make.log" 2>&1; then
  cat "$T/make.log"; bad "make -C examples generate"
else
  ok "make -C examples generate (libkvlm.so)"
  progs="generate"
  check "generate needs $soname" grep -q "(NEEDED).*\[$soname\]" <<<"$(readelf -d "$T/ex/generate")"
fi
if ! make -C "$T/ex" CFLAGS="-O2 -Wall -Wextra -Werror" generate-static >"$T/make-static.log" 2>&1; then
  missing="$(sed -n 's/.*cannot find -l\([^:]*\):.*/\1/p' "$T/make-static.log" | sort -u | tr '\n' ' ')"
  # pkg-config --static names the dependencies' own dependencies (gnutls's,
  # through libmicrohttpd), whose -dev packages a distribution may leave out
  if [ -n "$missing" ] && ! grep -qw -e kvlm -e pcre2-8 -e microhttpd -e jansson -e xxhash -e hiredis <<<"$missing"; then
    echo "SKIP generate-static: pkg-config --static names libraries not installed here: $missing(scripts/setup.sh installs them)"
  else
    cat "$T/make-static.log"; bad "make -C examples generate-static"
  fi
else
  ok "make -C examples generate-static (libkvlm.a)"
  progs="$progs generate-static"
  check "generate-static does not need libkvlm.so" \
    bash -c '! readelf -d "$1" | grep -q "NEEDED.*libkvlm"' _ "$T/ex/generate-static"
fi
if [ -n "$progs" ]; then
  for run in "Once upon a time|48" "The little dog|20"; do
    prompt="${run%|*}" n="${run#*|}"
    want="$("$P/bin/kvlm" run -m "$MODEL" -p "$prompt" -n "$n" --temp 0 2>"$T/run.err")" \
      || { cat "$T/run.err"; bad "installed kvlm run -p '$prompt' -n $n"; continue; }
    [ -n "$want" ] || { bad "kvlm run printed nothing"; continue; }
    for prog in $progs; do
      got="$("$T/ex/$prog" "$MODEL" "$prompt" "$n" 2>"$T/$prog.err")" || { cat "$T/$prog.err"; }
      if [ "$got" = "$want" ]; then ok "$prog '$prompt' $n = kvlm run --temp 0: ${want:0:40}..."
      else bad "$prog '$prompt' $n: got '$got', want '$want'"; fi
    done
  done
fi
if [[ " $progs " == *" generate "* ]]; then
  # the shared one through LD_LIBRARY_PATH too (a build without the rpath)
  cc -O2 -o "$T/ex/generate-norpath" "$T/ex/generate.c" $(pkg-config --cflags --libs kvlm) 2>>"$T/make.log"
  got="$(LD_LIBRARY_PATH="$L" "$T/ex/generate-norpath" "$MODEL" "Once upon a time" 8 2>&1)"
  want="$("$P/bin/kvlm" run -m "$MODEL" -p "Once upon a time" -n 8 --temp 0 2>/dev/null)"
  check "generate (no rpath) with LD_LIBRARY_PATH" test "$got" = "$want"
fi
# the CMake package: find_package(kvlm 0.1) in examples/CMakeLists.txt, both targets
# (a build folder of its own; the prefix moved, to show the config finds it from its place)
mv "$P" "$T/moved"
P="$T/moved"
L="$P/$LIBDIR"
cmake_progs=""
if ! "$CMAKE" -S "$T/ex" -B "$T/ex-cmake" -DCMAKE_PREFIX_PATH="$P" -DCMAKE_BUILD_TYPE=Release \
     -DCMAKE_C_FLAGS="-Wall -Wextra -Werror" >"$T/cmake.log" 2>&1 ||
   ! "$CMAKE" --build "$T/ex-cmake" >>"$T/cmake.log" 2>&1; then
  cat "$T/cmake.log"; bad "find_package(kvlm) in examples/CMakeLists.txt (a moved install)"
else
  ok "find_package(kvlm 0.1): $(sed -n 's/^-- \(kvlm .* from .*\)/\1/p' "$T/cmake.log" | head -1)"
  cmake_progs="generate generate-static"
  check "kvlm::kvlm links $soname" grep -q "(NEEDED).*\[$soname\]" <<<"$(readelf -d "$T/ex-cmake/generate")"
  check "kvlm::kvlm_static does not need libkvlm.so" \
    bash -c '! readelf -d "$1" | grep -q "NEEDED.*libkvlm"' _ "$T/ex-cmake/generate-static"
  want="$("$P/bin/kvlm" run -m "$MODEL" -p "Once upon a time" -n 24 --temp 0 2>/dev/null)"
  for prog in $cmake_progs; do
    got="$("$T/ex-cmake/$prog" "$MODEL" "Once upon a time" 24 2>"$T/$prog.err")" || cat "$T/$prog.err"
    check "$prog (find_package) = kvlm run --temp 0" test "$got" = "$want"
  done
fi
# the version file: the same major version, this one or older asked for
mkdir -p "$T/ver"
for v in "${VERSION%%.*}.0|ok" "$((${VERSION%%.*} + 1)).0|fails" "$VERSION|ok"; do
  asked="${v%|*}" expect="${v#*|}"
  printf 'cmake_minimum_required(VERSION 3.18)\nproject(v LANGUAGES C)\nfind_package(kvlm %s REQUIRED)\n' "$asked" \
    >"$T/ver/CMakeLists.txt"
  if "$CMAKE" -S "$T/ver" -B "$T/ver/b-$asked" -DCMAKE_PREFIX_PATH="$P" >"$T/ver.log" 2>&1; then got=ok; else got=fails; fi
  check "find_package(kvlm $asked) $expect (installed $VERSION)" test "$got" = "$expect"
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
