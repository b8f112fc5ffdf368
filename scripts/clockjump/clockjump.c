/* A clock jump on one host of the cluster harness (trillium/stack/clocks.py): preloaded into a
 * process, it adds to its wall clock (CLOCK_REALTIME and its kin, gettimeofday, time) the seconds
 * written in the file $TRILLIUM_CLOCK_FILE, read again at most once a second. Linux's time
 * namespaces offset only the monotonic clocks, and libfaketime fails Python's monotonic sleeps
 * (clock_nanosleep: EINVAL) once it leaves those clocks alone. The monotonic clocks are never
 * touched: a wall clock jumps (NTP stepping it, a VM restored), a monotonic one does not. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static _Atomic(clock_gettime_fn) real_clock_gettime;
static _Atomic long long offset_ns;
static _Atomic long long read_at = -1; /* the monotonic second of the file's last reading */

static clock_gettime_fn real(void) {
  clock_gettime_fn fn = atomic_load(&real_clock_gettime);
  if (fn == NULL) {
    fn = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
    atomic_store(&real_clock_gettime, fn);
  }
  return fn;
}

/* One caller a second reads the file; the others use the offset it read last. */
static long long offset(void) {
  struct timespec now;
  if (real()(CLOCK_MONOTONIC_COARSE, &now) == 0) {
    long long last = atomic_load(&read_at);
    if (now.tv_sec != last && atomic_compare_exchange_strong(&read_at, &last, now.tv_sec)) {
      const char *path = getenv("TRILLIUM_CLOCK_FILE");
      FILE *f = path != NULL ? fopen(path, "re") : NULL;
      if (f != NULL) {
        double seconds;
        if (fscanf(f, "%lf", &seconds) == 1) atomic_store(&offset_ns, (long long)(seconds * 1e9));
        fclose(f);
      }
    }
  }
  return atomic_load(&offset_ns);
}

static void shift(struct timespec *ts, long long ns) {
  long long total = (long long)ts->tv_nsec + ns % 1000000000LL;
  ts->tv_sec += ns / 1000000000LL + total / 1000000000LL;
  ts->tv_nsec = total % 1000000000LL;
  if (ts->tv_nsec < 0) {
    ts->tv_nsec += 1000000000LL;
    ts->tv_sec -= 1;
  }
}

int clock_gettime(clockid_t clock, struct timespec *ts) {
  int rc = real()(clock, ts);
  if (rc == 0 && (clock == CLOCK_REALTIME || clock == CLOCK_REALTIME_COARSE || clock == CLOCK_TAI)) {
    shift(ts, offset());
  }
  return rc;
}

int gettimeofday(struct timeval *tv, void *tz) {
  struct timespec ts;
  int rc = clock_gettime(CLOCK_REALTIME, &ts);
  if (rc == 0) { /* glibc declares tv nonnull */
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
  }
  (void)tz;
  return rc;
}

time_t time(time_t *out) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (out != NULL) *out = ts.tv_sec;
  return ts.tv_sec;
}
