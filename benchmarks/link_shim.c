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
 *   SDP4BIT_LINK_DELAY_US  one-way delay in microseconds added to every byte this process sends (a delay line,
 *                          see below); with or without SDP4BIT_LINK_GBPS.  Unset, empty or 0: none.
 *
 * A bad value is a fatal error naming the variable (exit status 2), never a silent no-op.
 *
 * What is limited: send, sendto, sendmsg, write, writev on stream sockets of AF_INET / AF_INET6 (NCCL's socket
 * transport calls send() with MSG_DONTWAIT or blocking in misc/socket.cc; gloo and c10d's TCPStore use
 * send/write/writev).  Everything else (files, pipes, AF_UNIX, UDP, sendfile, splice, io_uring) passes
 * untouched.  Receiving is not limited: each process limits what it sends, like one direction of a
 * full-duplex NIC.
 *
 * The delay line (SDP4BIT_LINK_DELAY_US): a send on a TCP socket copies the bytes into that socket's queue,
 * stamped "due at now + delay", and returns at once (a sleep in the caller would serialize a transport's
 * pipelined chunks: the delay must not cost throughput, only latency).  One writer thread per process hands
 * each queue's bytes to the kernel in order once they are due (through the token bucket when a rate is set
 * too).  A queue holds at most 64 MiB: beyond it a blocking send waits and a non-blocking one sends part or
 * fails with EAGAIN, as a full kernel buffer does.  close() and shutdown() of a socket wait until its queue
 * is sent; at exit the process waits for every queue (at most 10 s).  An error of a delayed send (the peer
 * gone) is returned by the socket's next send.  Sockets the process gets through dup/dup2 of a queued socket
 * are not tracked (none of NCCL, gloo or CPython's socket module does that to a socket with data in flight).
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
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
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

/* the delay line */
#define MAX_FD 65536
#define QUEUE_CAP ((size_t)64 << 20)
struct chunk {
    struct chunk *next;
    int64_t due_ns;
    size_t len, off;  /* bytes [off, len) of data are still to be sent */
    char data[];
};
struct fdq {
    struct chunk *head, *tail;
    size_t bytes;  /* accepted from the caller (reserved or queued), not yet handed to the kernel */
    int err;       /* errno of a failed delayed send, returned by the next send */
    int listed;    /* in pending[] */
    int closing;   /* the caller closed the fd: the writer closes it once the queue is sent */
};
typedef int (*close_fn)(int);
typedef int (*shutdown_fn)(int, int);
static close_fn real_close;
static shutdown_fn real_shutdown;
static int delay_on;
static int64_t delay_ns;
static struct fdq *queues[MAX_FD];  /* a queue and its chunks are freed by the writer thread only */
static int pending[MAX_FD];         /* fds with a queue the writer looks at */
static int n_pending;
static pthread_mutex_t qlock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qroom = PTHREAD_COND_INITIALIZER;   /* senders, shutdown(), exit: bytes left a queue */
static int writer_started;
static int wake_fd[2] = {-1, -1};  /* senders write a byte to wake the writer out of ppoll */
static uint64_t st_delayed_bytes, st_max_queued, st_dropped_bytes;

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

/* The process these counters and queues belong to. A vfork child (Python's subprocess, whose exec failed, ends in
 * _exit) shares the parent's memory without running the fork handlers: it must leave without touching them. */
static pid_t owner_pid;

static void child_after_fork(void) {
    owner_pid = getpid();
    /* the parent's queued bytes are the parent's to send (its writer thread did not fork) */
    pthread_mutex_init(&qlock, NULL);
    pthread_cond_init(&qroom, NULL);
    memset(queues, 0, sizeof queues);
    n_pending = 0;
    writer_started = 0;
    wake_fd[0] = wake_fd[1] = -1;
    st_delayed_bytes = st_max_queued = st_dropped_bytes = 0;
    pthread_mutex_init(&lock, NULL);
    tokens = burst;
    last_ns = now_ns();
    st_bytes = st_calls = st_sleeps = st_sleep_ns = st_refund = 0;
    st_first_ns = st_last_ns = 0;
}

__attribute__((constructor)) static void shim_init(void) {
    owner_pid = getpid();
    real_send = (send_fn)dlsym(RTLD_NEXT, "send");
    real_sendto = (sendto_fn)dlsym(RTLD_NEXT, "sendto");
    real_sendmsg = (sendmsg_fn)dlsym(RTLD_NEXT, "sendmsg");
    real_write = (write_fn)dlsym(RTLD_NEXT, "write");
    real_writev = (writev_fn)dlsym(RTLD_NEXT, "writev");
    real_close = (close_fn)dlsym(RTLD_NEXT, "close");
    real_shutdown = (shutdown_fn)dlsym(RTLD_NEXT, "shutdown");
    if (!real_send || !real_sendto || !real_sendmsg || !real_write || !real_writev || !real_close || !real_shutdown)
        die("LD_PRELOAD", "link_shim.so", "libc's send/sendto/sendmsg/write/writev/close/shutdown not found by dlsym");
    const char *dl = getenv("SDP4BIT_LINK_DELAY_US");
    if (dl && *dl) {
        double us = parse_positive("SDP4BIT_LINK_DELAY_US", dl, 1);
        if (us > 10e6) die("SDP4BIT_LINK_DELAY_US", dl, "expected 0 .. 10000000 (microseconds)");
        delay_ns = (int64_t)(us * 1e3);
        delay_on = delay_ns > 0;
    }
    const char *g = getenv("SDP4BIT_LINK_GBPS");
    if (g && *g) {
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
        active = 1;
    }
    if (!active && !delay_on) return;
    const char *d = getenv("SDP4BIT_LINK_STATS_DIR");
    if (d && *d) {
        struct stat sb;
        if (stat(d, &sb) != 0 || !S_ISDIR(sb.st_mode)) die("SDP4BIT_LINK_STATS_DIR", d, "not an existing folder");
        snprintf(stats_dir, sizeof stats_dir, "%s", d);
    }
    tokens = burst;
    last_ns = now_ns();
    pthread_atfork(NULL, NULL, child_after_fork);
}

static void drain_all(int64_t timeout_ns);

/* The process's count, once, from whichever end comes first: the destructors (a normal exit) or _exit below
 * (os._exit, as the training scripts leave through examples/shutdown.py; multiprocessing's children). */
static void write_stats(void) {
    static int written;
    if ((!active && !delay_on) || !stats_dir[0] || __atomic_exchange_n(&written, 1, __ATOMIC_RELAXED)) return;
    char path[PATH_MAX + 64], buf[1024];
    snprintf(path, sizeof path, "%s/link_%d.json", stats_dir, (int)getpid());
    int n = snprintf(buf, sizeof buf,
                     "{\"pid\": %d, \"gbps\": %.6g, \"burst_bytes\": %.0f, \"bytes\": %llu, \"calls\": %llu, "
                     "\"sleeps\": %llu, \"sleep_s\": %.6f, \"refunded_bytes\": %llu, \"active_s\": %.6f, "
                     "\"delay_us\": %.3f, \"delayed_bytes\": %llu, \"max_queued_bytes\": %llu, \"dropped_bytes\": %llu}\n",
                     (int)getpid(), gbps, burst, (unsigned long long)st_bytes, (unsigned long long)st_calls,
                     (unsigned long long)st_sleeps, st_sleep_ns / 1e9, (unsigned long long)st_refund,
                     st_last_ns > st_first_ns ? (st_last_ns - st_first_ns) / 1e9 : 0.0, delay_ns / 1e3,
                     (unsigned long long)st_delayed_bytes, (unsigned long long)st_max_queued,
                     (unsigned long long)st_dropped_bytes);
    FILE *f = fopen(path, "w");
    if (f) {
        fwrite(buf, 1, (size_t)n, f);
        fclose(f);
    }
}

__attribute__((destructor)) static void shim_fini(void) {
    if (delay_on) drain_all(10000000000LL);
    write_stats();
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

/* Exported for tests: the configured one-way delay in microseconds, 0 when none. */
double sdp4bit_link_delay_us(void) { return delay_on ? delay_ns / 1e3 : 0.0; }

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

static void count_sent(size_t done) {
    int64_t t = now_ns();
    __atomic_add_fetch(&st_bytes, done, __ATOMIC_RELAXED);
    __atomic_add_fetch(&st_calls, 1, __ATOMIC_RELAXED);
    int64_t z = 0;
    __atomic_compare_exchange_n(&st_first_ns, &z, t, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    __atomic_store_n(&st_last_ns, t, __ATOMIC_RELAXED);
}

static void settle(size_t reserved, ssize_t sent) {
    size_t done = sent > 0 ? (size_t)sent : 0;
    if (done < reserved) {
        pthread_mutex_lock(&lock);
        tokens += (double)(reserved - done);
        pthread_mutex_unlock(&lock);
        __atomic_add_fetch(&st_refund, reserved - done, __ATOMIC_RELAXED);
    }
    if (done) count_sent(done);
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

/* ------------------------------------------------------------------------------------------ the delay line */

#define PIECE ((size_t)1 << 20)  /* the most the writer hands the kernel for one fd per pass (without a rate) */

static void unlist(int fd) {  /* under qlock */
    for (int i = 0; i < n_pending; i++)
        if (pending[i] == fd) {
            pending[i] = pending[--n_pending];
            break;
        }
    queues[fd]->listed = 0;
}

static void list(int fd) {  /* under qlock */
    if (!queues[fd]->listed) {
        pending[n_pending++] = fd;
        queues[fd]->listed = 1;
    }
}

static void drop_chunks(struct fdq *q) {  /* writer, under qlock: what the peer will never get */
    while (q->head) {
        struct chunk *c = q->head;
        q->head = c->next;
        q->bytes -= c->len - c->off;
        st_dropped_bytes += c->len - c->off;
        free(c);
    }
    q->tail = NULL;
}

/* Writer, under qlock: a queue with nothing left (no chunk, no reservation) leaves the list; a closed one is
 * closed for real now and freed. */
static void settle_queue(int fd) {
    struct fdq *q = queues[fd];
    if (q->head || q->bytes) return;
    if (q->listed) unlist(fd);
    if (q->closing) {
        real_close(fd);
        free(q);
        queues[fd] = NULL;
    }
}

/* Writer: one piece of fd's head chunk to the kernel, if it is due (non-blocking, through the bucket when a
 * rate is set).  Returns 0 when bytes went out (more may be due), 1 when the kernel would block (the socket's
 * buffer is full), 2 when nothing of fd is due. */
static int send_piece(int fd) {
    pthread_mutex_lock(&qlock);
    struct fdq *q = queues[fd];
    struct chunk *c = q ? q->head : NULL;
    if (!c || c->due_ns > now_ns()) {
        if (q && q->err && q->closing) drop_chunks(q);
        if (q) settle_queue(fd);
        pthread_mutex_unlock(&qlock);
        return 2;
    }
    size_t n = c->len - c->off;
    pthread_mutex_unlock(&qlock);
    /* only this thread frees chunks and queues: c and q stay valid */
    size_t piece = active ? (size_t)burst : PIECE;
    if (n > piece) n = piece;
    if (active) take(n);
    ssize_t r = real_send(fd, c->data + c->off, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    int e = errno;
    if (active) settle(n, r);
    else if (r > 0) count_sent((size_t)r);
    pthread_mutex_lock(&qlock);
    int ret = 0;
    if (r > 0) {
        c->off += (size_t)r;
        q->bytes -= (size_t)r;
        st_delayed_bytes += (uint64_t)r;
        if (c->off == c->len) {
            q->head = c->next;
            if (!q->head) q->tail = NULL;
            free(c);
        }
        ret = (size_t)r < n;
    } else if (r < 0 && (e == EAGAIN || e == EWOULDBLOCK)) {
        ret = 1;
    } else if (!(r < 0 && e == EINTR)) {  /* the connection is broken: the next send on fd reports it */
        q->err = r < 0 ? e : EPIPE;
        drop_chunks(q);
    }
    pthread_cond_broadcast(&qroom);
    settle_queue(fd);
    pthread_mutex_unlock(&qlock);
    return ret;
}

static void *writer_main(void *arg) {
    (void)arg;
    prctl(PR_SET_TIMERSLACK, 1000UL);  /* wake within ~1 us of a chunk's due time, not the default 50 us */
    struct pollfd pfd[1 + 1024];
    int fds[1024];
    for (;;) {
        int n = 0;
        int64_t next = -1, t = now_ns();
        pthread_mutex_lock(&qlock);
        for (int i = 0; i < n_pending && n < 1024; i++) {
            struct chunk *c = queues[pending[i]]->head;
            if (c && c->due_ns > t) {
                if (next < 0 || c->due_ns < next) next = c->due_ns;
            } else {
                fds[n++] = pending[i];  /* due, or to be settled (emptied, errored, closed) */
            }
        }
        pthread_mutex_unlock(&qlock);
        /* one piece per fd per pass, in turn: a busy socket does not starve the others */
        int np = 1, progress = 0;
        pfd[0].fd = wake_fd[0];
        pfd[0].events = POLLIN;
        for (int i = 0; i < n; i++) {
            int r = send_piece(fds[i]);
            if (r == 1) {
                pfd[np].fd = fds[i];
                pfd[np++].events = POLLOUT;
            } else if (r == 0) {
                progress = 1;
            }
        }
        if (progress) continue;
        struct timespec ts, *tp = NULL;
        if (next >= 0) {
            int64_t w = next - now_ns();
            if (w < 0) w = 0;
            ts.tv_sec = (time_t)(w / 1000000000LL);
            ts.tv_nsec = (long)(w % 1000000000LL);
            tp = &ts;
        }
        if (ppoll(pfd, (nfds_t)np, tp, NULL) > 0 && (pfd[0].revents & POLLIN)) {
            char buf[256];
            while (read(wake_fd[0], buf, sizeof buf) > 0) {
            }
        }
    }
    return NULL;
}

static void wake_writer(void) {
    char b = 1;
    if (wake_fd[1] >= 0) (void)real_write(wake_fd[1], &b, 1);
}

static void start_writer(void) {  /* under qlock */
    if (writer_started) return;
    if (pipe2(wake_fd, O_NONBLOCK | O_CLOEXEC) != 0) die("SDP4BIT_LINK_DELAY_US", "", "pipe2 for the writer failed");
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, writer_main, NULL) != 0) die("SDP4BIT_LINK_DELAY_US", "", "the writer thread failed to start");
    pthread_attr_destroy(&at);
    writer_started = 1;
}

/* Under qlock: wait until bytes leave a queue, at most ns (< 1 s) nanoseconds. */
static void wait_room(long ns) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);  /* (the condition variable's clock) */
    until.tv_nsec += ns;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&qroom, &qlock, &until);
}

/* Copy bytes [off, off + n) of the iovec list into dst. */
static void gather(char *dst, const struct iovec *iov, int cnt, size_t off, size_t n) {
    for (int i = 0; i < cnt && n > 0; i++) {
        size_t l = iov[i].iov_len;
        if (off >= l) {
            off -= l;
            continue;
        }
        size_t m = l - off < n ? l - off : n;
        memcpy(dst, (const char *)iov[i].iov_base + off, m);
        dst += m;
        n -= m;
        off = 0;
    }
}

/* The delayed send of len bytes of (iov, cnt) on TCP socket fd: queued, due now + delay.  Returns the bytes
 * accepted (all of them on a blocking socket), or -1 with errno: EAGAIN when a non-blocking socket's queue
 * stayed full for 10 ms (the wait keeps callers that poll for writability, which the kernel socket still
 * reports, from spinning), EBADF after close(), or the error of an earlier delayed send. */
static ssize_t delayed(int fd, const struct iovec *iov, int cnt, size_t len, int nb) {
    pthread_mutex_lock(&qlock);
    start_writer();
    struct fdq *q = queues[fd];
    if (!q) {
        q = queues[fd] = calloc(1, sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&qlock);
            errno = ENOMEM;
            return -1;
        }
    }
    if (q->closing) {
        pthread_mutex_unlock(&qlock);
        errno = EBADF;
        return -1;
    }
    size_t total = 0;
    while (total < len) {
        if (q->err) {
            if (total) break;  /* the error stays for the next call */
            int e = q->err;
            q->err = 0;
            pthread_mutex_unlock(&qlock);
            errno = e;
            return -1;
        }
        size_t room = q->bytes < QUEUE_CAP ? QUEUE_CAP - q->bytes : 0;
        if (room == 0) {
            if (!nb) {
                pthread_cond_wait(&qroom, &qlock);
                continue;
            }
            wait_room(10000000L);
            if (q->bytes >= QUEUE_CAP) break;
            continue;
        }
        size_t n = len - total < room ? len - total : room;
        q->bytes += n;  /* reserved: the copy is made outside the lock */
        pthread_mutex_unlock(&qlock);
        struct chunk *c = malloc(sizeof *c + n);
        if (c) {
            gather(c->data, iov, cnt, total, n);
            c->next = NULL;
            c->len = n;
            c->off = 0;
            c->due_ns = now_ns() + delay_ns;
        }
        pthread_mutex_lock(&qlock);
        if (!c) {
            q->bytes -= n;
            if (total) break;
            pthread_mutex_unlock(&qlock);
            errno = ENOMEM;
            return -1;
        }
        if (q->tail) q->tail->next = c;
        else q->head = c;
        q->tail = c;
        total += n;
        if (q->bytes > st_max_queued) st_max_queued = q->bytes;
        list(fd);
        wake_writer();
    }
    pthread_mutex_unlock(&qlock);
    if (total == 0) {
        errno = EAGAIN;
        return -1;
    }
    return (ssize_t)total;
}

/* Wait until fd's queue is sent, at most timeout_ns (shutdown, ancillary data, exit).  Frees nothing. */
static void drain_fd(int fd, int64_t timeout_ns) {
    if (fd < 0 || fd >= MAX_FD) return;
    int64_t until = now_ns() + timeout_ns;
    pthread_mutex_lock(&qlock);
    while (queues[fd] && queues[fd]->bytes && !queues[fd]->err && now_ns() < until) {
        wait_room(1000000L);
    }
    pthread_mutex_unlock(&qlock);
}

/* At exit: wait for every queue (the closed ones too) at most timeout_ns; what is left is counted as dropped
 * and said on stderr. */
static void drain_all(int64_t timeout_ns) {
    int64_t until = now_ns() + timeout_ns;
    uint64_t left = 0;
    for (;;) {
        pthread_mutex_lock(&qlock);
        left = 0;
        for (int i = 0; i < n_pending; i++)
            if (!queues[pending[i]]->err) left += queues[pending[i]]->bytes;
        pthread_mutex_unlock(&qlock);
        if (!left || now_ns() >= until) break;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
    }
    if (left) {
        st_dropped_bytes += left;
        char msg[256];
        int n = snprintf(msg, sizeof msg, "sdp4bit link shim (benchmarks/link_shim.c): %llu delayed bytes were still "
                         "queued at exit and are lost\n", (unsigned long long)left);
        if (n > 0) (void)syscall(SYS_write, 2, msg, (size_t)n);
    }
}

/* The delay line's entry for the interposed calls: 1 when fd's send must go through it. */
static int delays(int fd) { return delay_on && fd >= 0 && fd < MAX_FD; }

static ssize_t delayed_flat(int fd, const void *buf, size_t len, int flags, int kind) {
    struct iovec v = {(void *)buf, len};
    return delayed(fd, &v, 1, len, nonblocking(fd, kind == 2 ? 0 : flags));
}

/* ------------------------------------------------------------------------------------------ interposed */

ssize_t send(int fd, const void *buf, size_t len, int flags) {
    if ((!active && !delay_on) || len == 0 || !is_tcp(fd, 1)) return real_send(fd, buf, len, flags);
    if (delays(fd)) return delayed_flat(fd, buf, len, flags, 0);
    return paced_flat(0, fd, (const char *)buf, len, flags, NULL, 0);
}

ssize_t sendto(int fd, const void *buf, size_t len, int flags, const struct sockaddr *to, socklen_t tolen) {
    if ((!active && !delay_on) || len == 0 || !is_tcp(fd, 1)) return real_sendto(fd, buf, len, flags, to, tolen);
    if (delays(fd)) return delayed_flat(fd, buf, len, flags, 1);  /* (a connected stream socket ignores to) */
    return paced_flat(1, fd, (const char *)buf, len, flags, to, tolen);
}

ssize_t write(int fd, const void *buf, size_t len) {
    if ((!active && !delay_on) || len == 0 || !is_tcp(fd, 0)) return real_write(fd, buf, len);
    if (delays(fd)) return delayed_flat(fd, buf, len, 0, 2);
    return paced_flat(2, fd, (const char *)buf, len, 0, NULL, 0);
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    if ((!active && !delay_on) || !msg || !is_tcp(fd, 1)) return real_sendmsg(fd, msg, flags);
    if (delays(fd)) {
        size_t len = 0;
        for (size_t i = 0; i < msg->msg_iovlen; i++) len += msg->msg_iov[i].iov_len;
        if (!msg->msg_controllen && len)
            return delayed(fd, msg->msg_iov, (int)msg->msg_iovlen, len, nonblocking(fd, flags));
        drain_fd(fd, 30000000000LL);  /* ancillary data goes straight out, after what is queued before it */
        if (!active) return real_sendmsg(fd, msg, flags);
    }
    return paced_vec(fd, msg->msg_iov, (int)msg->msg_iovlen, msg, flags);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    if ((!active && !delay_on) || cnt <= 0 || !is_tcp(fd, 0)) return real_writev(fd, iov, cnt);
    if (delays(fd)) {
        size_t len = 0;
        for (int i = 0; i < cnt; i++) len += iov[i].iov_len;
        return len ? delayed(fd, iov, cnt, len, nonblocking(fd, 0)) : real_writev(fd, iov, cnt);
    }
    return paced_vec(fd, iov, cnt, NULL, 0);
}

int close(int fd) {
    if (getpid() != owner_pid) return real_close(fd);  /* a vfork child closing inherited fds: not our queues */
    if (delays(fd)) {
        pthread_mutex_lock(&qlock);
        struct fdq *q = queues[fd];
        if (q && (q->bytes || q->head)) {
            /* like the kernel's close of a socket with unsent data: return now, the data still goes out; the
             * writer closes the fd once it is sent, so its number is not reused while bytes are queued */
            q->closing = 1;
            list(fd);
            wake_writer();
            pthread_mutex_unlock(&qlock);
            return 0;
        }
        if (q && !q->listed) {  /* an empty queue the writer no longer looks at */
            free(q);
            queues[fd] = NULL;
        } else if (q) {
            q->closing = 1;  /* listed: the writer settles it (and closes the fd) */
            wake_writer();
            pthread_mutex_unlock(&qlock);
            return 0;
        }
        pthread_mutex_unlock(&qlock);
    }
    return real_close(fd);
}

int shutdown(int fd, int how) {
    if (getpid() != owner_pid) return real_shutdown(fd, how);
    if (delays(fd) && how != SHUT_RD) drain_fd(fd, 30000000000LL);  /* the queue before the FIN */
    return real_shutdown(fd, how);
}

/* os._exit and multiprocessing's forked children end here, past the destructors: deliver the queues first. */
void _exit(int status) {
    if (getpid() != owner_pid) syscall(SYS_exit_group, status);  /* a vfork child: the parent's state, not its own */
    if (delay_on && writer_started) drain_all(10000000000LL);
    write_stats();
    syscall(SYS_exit_group, status);
    __builtin_unreachable();
}

void _Exit(int status) { _exit(status); }
