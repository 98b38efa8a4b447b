/* A per-process egress rate limit on TCP sockets, loaded with LD_PRELOAD (no privileges, no `tc`).
 *
 * benchmarks/link.py compiles this file on first use (cc -O2 -shared -fPIC) into a cache folder and sets
 * LD_PRELOAD and the variables below.  Read once, when the library is loaded:
 *
 *   SDP4BIT_LINK_GBPS      egress limit of this process in Gb/s (1e9 bit/s), all its threads together.
 *                          Unset or empty: the library does nothing (every call goes straight to libc).
 *   SDP4BIT_LINK_BURST_KB  token-bucket depth in KiB (default: 1 ms at the rate, at least 64 KiB).
 *   SDP4BIT_LINK_STATS_DIR a folder: at exit the process writes link_<pid>.json there (bytes limited, calls,
 *                          time slept), so a run can show that its traffic went through the limit.
 *
 * A bad value is a fatal error naming the variable (exit status 2), never a silent no-op.
 *
 * What is limited: send, sendto, sendmsg, write, writev on stream sockets of AF_INET / AF_INET6 (NCCL's socket
 * transport calls send() with MSG_DONTWAIT or blocking in misc/socket.cc; gloo and c10d's TCPStore use
 * send/write/writev).  Everything else (files, pipes, AF_UNIX, UDP, sendfile, splice, io_uring) passes
 * untouched.  Receiving is not limited: each process limits what it sends, like one direction of a
 * full-duplex NIC.  No latency is added (see benchmarks/link.py for why).
 *
 * The limit is a token bucket shared by all threads of the process (a mutex around a few arithmetic
 * operations; sleeping happens outside it).  A caller takes min(len, burst) bytes' worth of tokens; when the
 * bucket is short it goes into debt and sleeps until the debt is paid at the rate, so concurrent threads are
 * served in the order they reserved.  Bytes the kernel did not accept (a partial send, EAGAIN) are refunded.
 * A blocking socket (no O_NONBLOCK, no MSG_DONTWAIT) gets its whole buffer sent chunk by chunk, as a blocking
 * send does; a non-blocking one gets at most one chunk per call (a partial send, which stream-socket callers
 * handle: NCCL, gloo and CPython loop on it).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_IOV 1024

typedef ssize_t (*send_fn)(int, const void *, size_t, int);
typedef ssize_t (*sendto_fn)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
typedef ssize_t (*sendmsg_fn)(int, const struct msghdr *, int);
typedef ssize_t (*write_fn)(int, const void *, size_t);
typedef ssize_t (*writev_fn)(int, const struct iovec *, int);

static send_fn real_send;
static sendto_fn real_sendto;
static sendmsg_fn real_sendmsg;
static write_fn real_write;
static writev_fn real_writev;

static int active;              /* 1 when SDP4BIT_LINK_GBPS is set */
static double gbps;             /* as given */
static double rate;             /* bytes per second */
static double burst;            /* bytes */
static int burst_given;         /* SDP4BIT_LINK_BURST_KB set: kept when the rate changes */
static double tokens;           /* may go negative: the debt of reserved, not yet earned bytes */
static int64_t last_ns;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t st_bytes, st_calls, st_sleeps, st_sleep_ns, st_refund;
static int64_t st_first_ns, st_last_ns;
static char stats_dir[PATH_MAX];

/* ------------------------------------------------------------------------------------------ set-up */

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *var, const char *val, const char *what) {
    char msg[768];
    int n = snprintf(msg, sizeof msg, "sdp4bit link shim (benchmarks/link_shim.c): %s=\"%s\" is not valid: %s\n",
                     var, val, what);
    if (n > 0) (void)syscall(SYS_write, 2, msg, (size_t)(n < (int)sizeof msg ? n : (int)sizeof msg - 1));
    _exit(2);
}

/* A finite number > 0 (allow_zero: >= 0), or die naming the variable. */
static double parse_positive(const char *var, const char *val, int allow_zero) {
    char *end = NULL;
    errno = 0;
    double x = strtod(val, &end);
    while (end && (*end == ' ' || *end == '\t')) end++;
    if (end == val || (end && *end) || errno || !isfinite(x) || x < 0 || (!allow_zero && x == 0))
        die(var, val, allow_zero ? "expected a number >= 0" : "expected a number > 0");
    return x;
}

static void child_after_fork(void) {
    pthread_mutex_init(&lock, NULL);
    tokens = burst;
    last_ns = now_ns();
    st_bytes = st_calls = st_sleeps = st_sleep_ns = st_refund = 0;
    st_first_ns = st_last_ns = 0;
}

__attribute__((constructor)) static void shim_init(void) {
    real_send = (send_fn)dlsym(RTLD_NEXT, "send");
    real_sendto = (sendto_fn)dlsym(RTLD_NEXT, "sendto");
    real_sendmsg = (sendmsg_fn)dlsym(RTLD_NEXT, "sendmsg");
    real_write = (write_fn)dlsym(RTLD_NEXT, "write");
    real_writev = (writev_fn)dlsym(RTLD_NEXT, "writev");
    if (!real_send || !real_sendto || !real_sendmsg || !real_write || !real_writev)
        die("LD_PRELOAD", "link_shim.so", "libc's send/sendto/sendmsg/write/writev not found by dlsym");
    const char *g = getenv("SDP4BIT_LINK_GBPS");
    if (!g || !*g) return;
    gbps = parse_positive("SDP4BIT_LINK_GBPS", g, 0);
    rate = gbps * 1e9 / 8.0;
    burst = rate * 1e-3;
    if (burst < 65536.0) burst = 65536.0;
    const char *b = getenv("SDP4BIT_LINK_BURST_KB");
    if (b && *b) {
        double kb = parse_positive("SDP4BIT_LINK_BURST_KB", b, 0);
        /* a burst under 1 KiB would pace 0-byte chunks (no progress); over 1 GiB it is no limit */
        if (kb < 1.0 || kb > 1048576.0) die("SDP4BIT_LINK_BURST_KB", b, "expected 1 .. 1048576 (KiB)");
        burst = kb * 1024.0;
        burst_given = 1;
    }
    const char *d = getenv("SDP4BIT_LINK_STATS_DIR");
    if (d && *d) {
        struct stat sb;
        if (stat(d, &sb) != 0 || !S_ISDIR(sb.st_mode)) die("SDP4BIT_LINK_STATS_DIR", d, "not an existing folder");
        snprintf(stats_dir, sizeof stats_dir, "%s", d);
    }
    tokens = burst;
    last_ns = now_ns();
    pthread_atfork(NULL, NULL, child_after_fork);
    active = 1;
}

__attribute__((destructor)) static void shim_fini(void) {
    if (!active || !stats_dir[0]) return;
    char path[PATH_MAX + 64], buf[1024];
    snprintf(path, sizeof path, "%s/link_%d.json", stats_dir, (int)getpid());
    int n = snprintf(buf, sizeof buf,
                     "{\"pid\": %d, \"gbps\": %.6g, \"burst_bytes\": %.0f, \"bytes\": %llu, \"calls\": %llu, "
                     "\"sleeps\": %llu, \"sleep_s\": %.6f, \"refunded_bytes\": %llu, \"active_s\": %.6f}\n",
                     (int)getpid(), gbps, burst, (unsigned long long)st_bytes, (unsigned long long)st_calls,
                     (unsigned long long)st_sleeps, st_sleep_ns / 1e9, (unsigned long long)st_refund,
                     st_last_ns > st_first_ns ? (st_last_ns - st_first_ns) / 1e9 : 0.0);
    FILE *f = fopen(path, "w");
    if (f) {
        fwrite(buf, 1, (size_t)n, f);
        fclose(f);
    }
}

/* Exported for tests and for benchmarks/link.py: the configured limit in Gb/s, 0 when inactive. */
double sdp4bit_link_gbps(void) { return active ? gbps : 0.0; }
/* Change the limit of an active shim (benchmarks/link_collective.py measures several rates in one process);
 * 0 on success, -1 when the shim is inactive or the rate is not a finite number > 0. */
int sdp4bit_link_set_gbps(double g) {
    if (!active || !isfinite(g) || g <= 0) return -1;
    pthread_mutex_lock(&lock);
    gbps = g;
    rate = g * 1e9 / 8.0;
    if (!burst_given) burst = rate * 1e-3 < 65536.0 ? 65536.0 : rate * 1e-3;
    tokens = burst;
    last_ns = now_ns();
    pthread_mutex_unlock(&lock);
    return 0;
}

/* Bytes limited so far by this process. */
unsigned long long sdp4bit_link_bytes(void) { return __atomic_load_n(&st_bytes, __ATOMIC_RELAXED); }

/* ------------------------------------------------------------------------------------------ the bucket */

/* 1 when fd is a stream socket of AF_INET or AF_INET6. */
static int is_tcp(int fd, int known_socket) {
    if (!known_socket) {
        struct stat sb;
        if (fstat(fd, &sb) != 0 || !S_ISSOCK(sb.st_mode)) return 0;
    }
    int v = 0;
    socklen_t l = sizeof v;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &v, &l) != 0 || v != SOCK_STREAM) return 0;
    l = sizeof v;
    if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &v, &l) != 0) return 0;
    return v == AF_INET || v == AF_INET6;
}

static int nonblocking(int fd, int flags) {
    if (flags & MSG_DONTWAIT) return 1;
    int fl = fcntl(fd, F_GETFL);
    return fl >= 0 && (fl & O_NONBLOCK);
}

/* Reserve n bytes (n <= burst), sleeping until the bucket has paid for them. */
static void take(size_t n) {
    double wait_s;
    pthread_mutex_lock(&lock);
    int64_t t = now_ns();  /* inside the lock: the clock seen by the bucket never goes backwards */
    tokens += (t - last_ns) * 1e-9 * rate;
    if (tokens > burst) tokens = burst;
    last_ns = t;
    tokens -= (double)n;
    wait_s = tokens < 0 ? -tokens / rate : 0.0;
    pthread_mutex_unlock(&lock);
    if (wait_s > 0) {
        int64_t until = t + (int64_t)(wait_s * 1e9);
        struct timespec ts = {(time_t)(until / 1000000000LL), (long)(until % 1000000000LL)};
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
        }
        __atomic_add_fetch(&st_sleeps, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&st_sleep_ns, (uint64_t)(now_ns() - t), __ATOMIC_RELAXED);
    }
}

static void settle(size_t reserved, ssize_t sent) {
    size_t done = sent > 0 ? (size_t)sent : 0;
    if (done < reserved) {
        pthread_mutex_lock(&lock);
        tokens += (double)(reserved - done);
        pthread_mutex_unlock(&lock);
        __atomic_add_fetch(&st_refund, reserved - done, __ATOMIC_RELAXED);
    }
    if (done) {
        int64_t t = now_ns();
        __atomic_add_fetch(&st_bytes, done, __ATOMIC_RELAXED);
        __atomic_add_fetch(&st_calls, 1, __ATOMIC_RELAXED);
        int64_t z = 0;
        __atomic_compare_exchange_n(&st_first_ns, &z, t, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        __atomic_store_n(&st_last_ns, t, __ATOMIC_RELAXED);
    }
}

static size_t chunk_of(size_t left) { return left < (size_t)burst ? left : (size_t)burst; }

/* One call of the real function on bytes [off, off + n) of the caller's buffer. */
typedef ssize_t (*chunk_fn)(const void *ctx, size_t off, size_t n);

/* Pace len bytes chunk by chunk: all of them on a blocking socket, at most one chunk on a non-blocking one. */
static ssize_t paced(size_t len, int nb, chunk_fn fn, const void *ctx) {
    size_t total = 0;
    do {
        size_t n = chunk_of(len - total);
        take(n);
        ssize_t r = fn(ctx, total, n);
        settle(n, r);
        if (r < 0) return total ? (ssize_t)total : r;
        total += (size_t)r;
        if ((size_t)r < n || nb) break;
    } while (total < len);
    return (ssize_t)total;
}

struct flat { int kind, fd, flags; const char *buf; const struct sockaddr *to; socklen_t tolen; };

static ssize_t flat_chunk(const void *ctx, size_t off, size_t n) {
    const struct flat *c = (const struct flat *)ctx;
    return c->kind == 0   ? real_send(c->fd, c->buf + off, n, c->flags)
           : c->kind == 1 ? real_sendto(c->fd, c->buf + off, n, c->flags, c->to, c->tolen)
                          : real_write(c->fd, c->buf + off, n);
}

/* kind 0 send, 1 sendto, 2 write */
static ssize_t paced_flat(int kind, int fd, const char *buf, size_t len, int flags, const struct sockaddr *to,
                          socklen_t tolen) {
    struct flat c = {kind, fd, flags, buf, to, tolen};
    return paced(len, nonblocking(fd, kind == 2 ? 0 : flags), flat_chunk, &c);
}

struct vec { int fd, flags, cnt; const struct iovec *iov; const struct msghdr *msg; };

static ssize_t vec_chunk(const void *ctx, size_t off, size_t n) {
    const struct vec *c = (const struct vec *)ctx;
    struct iovec part[MAX_IOV];
    int k = 0;
    size_t skip = off;
    for (int i = 0; i < c->cnt && n > 0; i++) {  /* bytes [off, off + n) of the iovec list */
        size_t l = c->iov[i].iov_len;
        if (skip >= l) {
            skip -= l;
            continue;
        }
        size_t m = l - skip < n ? l - skip : n;
        part[k].iov_base = (char *)c->iov[i].iov_base + skip;
        part[k++].iov_len = m;
        n -= m;
        skip = 0;
    }
    if (!c->msg) return real_writev(c->fd, part, k);
    struct msghdr mh = *c->msg;
    mh.msg_iov = part;
    mh.msg_iovlen = (size_t)k;
    return real_sendmsg(c->fd, &mh, c->flags);
}

/* writev (msg == NULL) or sendmsg, paced chunk by chunk over the iovec list. */
static ssize_t paced_vec(int fd, const struct iovec *iov, int cnt, const struct msghdr *msg, int flags) {
    size_t len = 0;
    for (int i = 0; i < cnt; i++) len += iov[i].iov_len;
    if (len == 0 || cnt > MAX_IOV || (msg && msg->msg_controllen)) {
        /* nothing to pace, a call the kernel refuses anyway, or ancillary data: one call, paid in full up front
         * (a reservation above the burst is a debt the caller sleeps off) */
        size_t n = len;
        if (n) take(n);
        ssize_t r = msg ? real_sendmsg(fd, msg, flags) : real_writev(fd, iov, cnt);
        if (n) settle(n, r);
        return r;
    }
    struct vec c = {fd, flags, cnt, iov, msg};
    return paced(len, nonblocking(fd, msg ? flags : 0), vec_chunk, &c);
}

/* ------------------------------------------------------------------------------------------ interposed */

ssize_t send(int fd, const void *buf, size_t len, int flags) {
    if (!active || len == 0 || !is_tcp(fd, 1)) return real_send(fd, buf, len, flags);
    return paced_flat(0, fd, (const char *)buf, len, flags, NULL, 0);
}

ssize_t sendto(int fd, const void *buf, size_t len, int flags, const struct sockaddr *to, socklen_t tolen) {
    if (!active || len == 0 || !is_tcp(fd, 1)) return real_sendto(fd, buf, len, flags, to, tolen);
    return paced_flat(1, fd, (const char *)buf, len, flags, to, tolen);
}

ssize_t write(int fd, const void *buf, size_t len) {
    if (!active || len == 0 || !is_tcp(fd, 0)) return real_write(fd, buf, len);
    return paced_flat(2, fd, (const char *)buf, len, 0, NULL, 0);
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    if (!active || !msg || !is_tcp(fd, 1)) return real_sendmsg(fd, msg, flags);
    return paced_vec(fd, msg->msg_iov, (int)msg->msg_iovlen, msg, flags);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    if (!active || cnt <= 0 || !is_tcp(fd, 0)) return real_writev(fd, iov, cnt);
    return paced_vec(fd, iov, cnt, NULL, 0);
}
