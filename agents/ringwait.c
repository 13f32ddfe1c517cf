/* The test runs' ring ranks wait for their peers without spinning.

   MLX's ring backend gives each socket a thread that calls recv() on a non-blocking socket in a loop for as long
   as a transfer is pending: a rank waiting for its peer burns a core. With more ranks than cores (the suite's
   4-rank meshes on a 2-core machine) the ranks that have work to do wait for the spinning ones' time slices: a
   4-rank demo mesh decodes about 30 times faster with this library preloaded (bench/ringwait.py,
   docs/BENCHMARKS.md).

   Preloaded by scripts/test into every process of a test run: recv() behaves as libc's, except that when it
   would return EAGAIN it first waits up to 1 ms for the socket to become readable, then returns what libc's
   returned (the caller retries as before). No result changes; a waiting rank sleeps in poll() instead. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

typedef ssize_t (*recv_fn)(int, void *, size_t, int);

ssize_t recv(int fd, void *buf, size_t len, int flags) {
    static recv_fn libc_recv;
    if (!libc_recv) libc_recv = (recv_fn)dlsym(RTLD_NEXT, "recv");
    ssize_t got = libc_recv(fd, buf, len, flags);
    if (got < 0 && errno == EAGAIN && !(flags & MSG_DONTWAIT)) {
        struct pollfd readable = {fd, POLLIN, 0};
        poll(&readable, 1, 1);
        errno = EAGAIN;
    }
    return got;
}
