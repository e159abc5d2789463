/* util/timing: a monotonic clock in seconds. */
#ifndef KVLM_UTIL_TIMING_H
#define KVLM_UTIL_TIMING_H
double util_now_s(void);
#endif
