/* A test-only LD_PRELOAD shim for the fault campaign's slow-fsync fault.
 *
 * Every fsync and fdatasync of the process first checks the file named by
 * REPLICA_HA_FSYNC_DELAY_FILE; while it exists and holds a number of
 * milliseconds, the call sleeps that long before it goes to the kernel. So
 * the harness can stall one node's disk flushes (its Raft log and its data
 * alike) at run time, the way a failing or saturated disk does, without a
 * device-mapper target. Never part of the product. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static void stall(void) {
    const char *path = getenv("REPLICA_HA_FSYNC_DELAY_FILE");
    if (path == NULL) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char text[32] = {0};
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0) return;
    long ms = strtol(text, NULL, 10);
    if (ms <= 0 || ms > 60000) return;
    struct timespec wait = { ms / 1000, (ms % 1000) * 1000000L };
    while (nanosleep(&wait, &wait) != 0) {}
}

int fsync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    stall();
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (real == NULL) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    stall();
    return real(fd);
}
