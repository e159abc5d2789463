/* util/log: leveled logging through kvlm_log (a callback set by kvlm_log_set,
 * else stderr; the level from kvlm_log_set_level, else KVLM_LOG=debug|info|warn|error|off). */
#ifndef KVLM_UTIL_LOG_H
#define KVLM_UTIL_LOG_H
enum { UTIL_LOG_DEBUG, UTIL_LOG_INFO, UTIL_LOG_WARN, UTIL_LOG_ERROR, UTIL_LOG_OFF };
void util_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define LOG_DEBUG(...) util_log(UTIL_LOG_DEBUG, __VA_ARGS__)
#define LOG_INFO(...) util_log(UTIL_LOG_INFO, __VA_ARGS__)
#define LOG_WARN(...) util_log(UTIL_LOG_WARN, __VA_ARGS__)
#define LOG_ERROR(...) util_log(UTIL_LOG_ERROR, __VA_ARGS__)
#endif
