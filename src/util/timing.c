/* util/timing: a monotonic clock in seconds. */
#include "util/timing.h"
#include <time.h>

double util_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
