/* util/version: the library's version text, "0.1.0 (git 1a2b3c4d5e)", written
 * at build time by cmake/version.cmake (build/version.c). */
#ifndef KVLM_UTIL_VERSION_H
#define KVLM_UTIL_VERSION_H
extern const char util_version_text[];
#endif
