/* Passthrough tunnels relayed by one native thread: epoll, recv/send and splice(2).
 *
 * The same relay as engines/splice_kernel.py (which stays as the fallback where this
 * extension is not built), moved off the event loop: a direct passthrough tunnel's
 * sockets are handed over (the descriptors now belong to this module) and a thread of
 * its own, which never takes the GIL, moves their bytes. Python learns only that a
 * tunnel ended: its id is queued and an eventfd the loop watches becomes readable
 * (`Relayer.reap`). Measured on a quiet machine (bench's passthrough row at c10): 24.8-25.1
 * us of CPU a request against the loop's relay's 35.5-36.1 and squid's 25.1-25.6
 * (docs/performance.md, "A relay in C").
 *
 * A direction (`way`) reads small exchanges into the thread's buffer and sends them on
 * at once (what the destination does not take is kept, and reading pauses until it is
 * sent); a read that fills the buffer turns the direction to splicing socket -> pipe ->
 * socket, and a spliced read under SMALL bytes turns it back. A pipe is lent to a
 * direction only while it holds bytes (a pool of KEEP empty ones). A full pipe stops
 * the reading until the destination has taken it all. An EOF is passed on as a
 * half-close once the held bytes are sent; both directions ended, or any socket
 * failing, ends the tunnel.
 *
 * Locking: one mutex guards every tunnel and the pool. The thread holds it while it
 * handles the events of one epoll_wait; Python takes it to add, read or close a tunnel.
 * A tunnel's memory is freed only when both Python's object and the thread have let it
 * go; the thread lets go at the top of its loop, after handling every event of the wait
 * that might still name it (an fd is removed from epoll before it is closed, so no later
 * wait can).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SCRATCH (64 * 1024)
#define SMALL 4096
#define KEEP 8
#define EVENTS 64
#define SPLICE_FLAGS (SPLICE_F_MOVE | SPLICE_F_NONBLOCK)

typedef struct relay relay;
typedef struct tunnel tunnel;

typedef struct {
    int fd;
    int events;        /* what epoll watches for now (0: not registered) */
    struct way *src_of; /* the direction reading this socket */
    struct way *dst_of; /* the direction writing to it */
} end;

typedef struct way {
    tunnel *t;
    end *src, *dst;
    int pipe_r, pipe_w, cap; /* lent while bytes are held in it (-1: none) */
    size_t held;             /* bytes in the pipe */
    uint64_t moved;          /* bytes read from src */
    char *rest;              /* of a small read, what dst did not take */
    size_t rest_len, rest_off;
    int ended, reading, writing, small;
} way;

enum { RUNNING, FINISHED, CLOSED };

struct tunnel {
    uint64_t id;
    int state;
    int refs;          /* Python's object + the thread */
    int ways_ended;
    double last;       /* CLOCK_MONOTONIC seconds of the last bytes read */
    end client, upstream;
    way out, into;     /* client -> upstream, upstream -> client */
    tunnel *prev, *next; /* the running ones (stop closes them) */
    tunnel *next_dead;
};

typedef struct {
    int r, w, cap;
} pipe_t;

struct relay {
    pthread_mutex_t lock;
    pthread_t thread;
    int threaded, stopping; /* threaded: the thread was started (run) */
    int ep;            /* the tunnels' epoll */
    int wake;          /* eventfd: stop the thread */
    int notify;        /* eventfd: tunnels have finished (Python's loop watches it) */
    int pipe_size;
    uint64_t next_id;
    pipe_t pool[KEEP];
    int pooled;
    tunnel *first;     /* the running tunnels */
    tunnel *dead;      /* closed or finished, for the thread to let go */
    uint64_t *finished;
    size_t n_finished, cap_finished;
    char scratch[SCRATCH];
    /* counters (tests, /metrics): reads through the buffer and through a pipe */
    uint64_t small_reads, spliced_reads;
    int running;
};

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* -- pipes ------------------------------------------------------------------------ */

static int pipe_take(relay *rl, way *w) {
    if (rl->pooled > 0) {
        pipe_t p = rl->pool[--rl->pooled];
        w->pipe_r = p.r;
        w->pipe_w = p.w;
        w->cap = p.cap;
        return 0;
    }
    int fds[2];
    if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) < 0)
        return -1;
    fcntl(fds[1], F_SETPIPE_SZ, rl->pipe_size); /* (over fs.pipe-max-size: keeps 64 KiB) */
    int cap = fcntl(fds[1], F_GETPIPE_SZ);
    w->pipe_r = fds[0];
    w->pipe_w = fds[1];
    w->cap = cap > 0 ? cap : 65536;
    return 0;
}

static void pipe_return(relay *rl, way *w) {
    if (w->pipe_r < 0 || w->held)
        return;
    if (rl->pooled < KEEP) {
        rl->pool[rl->pooled++] = (pipe_t){w->pipe_r, w->pipe_w, w->cap};
    } else {
        close(w->pipe_r);
        close(w->pipe_w);
    }
    w->pipe_r = w->pipe_w = -1;
}

static void pool_clear(relay *rl) {
    while (rl->pooled > 0) {
        pipe_t p = rl->pool[--rl->pooled];
        close(p.r);
        close(p.w);
    }
}

/* -- registration ----------------------------------------------------------------- */

/* Watch `e` for what its directions want now: readable while its reader reads,
 * writable while its writer waits; an end that wants nothing is not registered (a
 * level-triggered hang-up would otherwise be reported again and again). */
static int watch(relay *rl, end *e) {
    int want = 0;
    if (e->src_of->reading)
        want |= EPOLLIN;
    if (e->dst_of->writing)
        want |= EPOLLOUT;
    if (want == e->events)
        return 0;
    struct epoll_event ev = {.events = (uint32_t)want, .data.ptr = e};
    int rc;
    if (!want)
        rc = epoll_ctl(rl->ep, EPOLL_CTL_DEL, e->fd, &ev);
    else if (!e->events)
        rc = epoll_ctl(rl->ep, EPOLL_CTL_ADD, e->fd, &ev);
    else
        rc = epoll_ctl(rl->ep, EPOLL_CTL_MOD, e->fd, &ev);
    if (rc == 0)
        e->events = want;
    return rc;
}

/* -- a tunnel's end ----------------------------------------------------------------- */

static void way_teardown(relay *rl, way *w) {
    w->reading = w->writing = 0;
    if (w->pipe_r >= 0) { /* bytes never delivered: not a pipe to lend again */
        close(w->pipe_r);
        close(w->pipe_w);
        w->pipe_r = w->pipe_w = -1;
        w->held = 0;
    }
    free(w->rest);
    w->rest = NULL;
    w->rest_len = w->rest_off = 0;
    (void)rl;
}

static void end_teardown(relay *rl, end *e) {
    if (e->events && rl->ep >= 0) {
        struct epoll_event ev = {0};
        epoll_ctl(rl->ep, EPOLL_CTL_DEL, e->fd, &ev);
        e->events = 0;
    }
    if (e->fd >= 0) {
        close(e->fd);
        e->fd = -1;
    }
}

/* Stop relaying, close both sockets, and queue the tunnel for the thread to let go.
 * Called with the lock held, from the thread (FINISHED) or from Python (CLOSED). */
static void teardown(relay *rl, tunnel *t, int state) {
    if (t->state != RUNNING)
        return;
    t->state = state;
    way_teardown(rl, &t->out);
    way_teardown(rl, &t->into);
    end_teardown(rl, &t->client);
    end_teardown(rl, &t->upstream);
    if (t->prev)
        t->prev->next = t->next;
    else
        rl->first = t->next;
    if (t->next)
        t->next->prev = t->prev;
    t->prev = t->next = NULL;
    t->next_dead = rl->dead;
    rl->dead = t;
    rl->running--;
}

static void finish(relay *rl, tunnel *t) {
    if (t->state != RUNNING)
        return;
    teardown(rl, t, FINISHED);
    if (rl->n_finished == rl->cap_finished) {
        size_t cap = rl->cap_finished ? rl->cap_finished * 2 : 64;
        uint64_t *grown = realloc(rl->finished, cap * sizeof *grown);
        if (grown == NULL)
            return; /* (Python's sweep still ends it: its descriptors are closed) */
        rl->finished = grown;
        rl->cap_finished = cap;
    }
    rl->finished[rl->n_finished++] = t->id;
    uint64_t one = 1;
    if (write(rl->notify, &one, sizeof one) < 0) { /* (saturated: still readable) */
    }
}

static void way_ended(relay *rl, way *w) {
    tunnel *t = w->t;
    if (++t->ways_ended == 2)
        finish(rl, t);
}

/* -- one direction ---------------------------------------------------------------- */

static int flush(relay *rl, way *w);

static int stop_reading(relay *rl, way *w) {
    w->reading = 0;
    return watch(rl, w->src);
}

static int pass_eof(relay *rl, way *w) {
    if (w->held || w->rest_len)
        return 0; /* (once the held bytes are sent) */
    if (shutdown(w->dst->fd, SHUT_WR) < 0)
        return -1;
    way_ended(rl, w);
    return 0;
}

static int got_eof(relay *rl, way *w) {
    pipe_return(rl, w);
    w->ended = 1;
    if (stop_reading(rl, w) < 0)
        return -1;
    return pass_eof(rl, w);
}

static int read_small(relay *rl, way *w) {
    ssize_t n = recv(w->src->fd, rl->scratch, SCRATCH, 0);
    if (n < 0)
        return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    if (n == 0)
        return got_eof(rl, w);
    rl->small_reads++;
    w->moved += (uint64_t)n;
    w->t->last = now();
    if (n == SCRATCH)
        w->small = 0;
    ssize_t sent = send(w->dst->fd, rl->scratch, (size_t)n, MSG_NOSIGNAL);
    if (sent < 0) {
        if (errno != EAGAIN && errno != EINTR)
            return -1;
        sent = 0;
    }
    if (sent < n) { /* dst takes no more yet: keep the rest, read again once it is sent */
        w->rest_len = (size_t)(n - sent);
        w->rest_off = 0;
        w->rest = malloc(w->rest_len);
        if (w->rest == NULL)
            return -1;
        memcpy(w->rest, rl->scratch + sent, w->rest_len);
        w->reading = 0;
        w->writing = 1;
        if (watch(rl, w->src) < 0 || watch(rl, w->dst) < 0)
            return -1;
    }
    return 0;
}

static int send_rest(relay *rl, way *w) {
    ssize_t sent = send(w->dst->fd, w->rest + w->rest_off, w->rest_len, MSG_NOSIGNAL);
    if (sent < 0)
        return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    w->rest_off += (size_t)sent;
    w->rest_len -= (size_t)sent;
    if (w->rest_len)
        return 0;
    free(w->rest);
    w->rest = NULL;
    w->rest_off = 0;
    w->writing = 0;
    w->reading = 1;
    if (watch(rl, w->dst) < 0 || watch(rl, w->src) < 0)
        return -1;
    return 0;
}

static int read_way(relay *rl, way *w) {
    if (w->pipe_r < 0 && w->small)
        return read_small(rl, w);
    if (w->pipe_r < 0 && pipe_take(rl, w) < 0)
        return -1; /* no descriptors left */
    ssize_t n = splice(w->src->fd, NULL, w->pipe_w, NULL, (size_t)w->cap - w->held,
                       SPLICE_FLAGS);
    if (n < 0) {
        if (errno == EINTR)
            return 0;
        if (errno != EAGAIN)
            return -1;
        if (!w->held) { /* nothing to read after all */
            pipe_return(rl, w);
            return 0;
        }
        /* The pipe has no slot left (each spliced segment takes one, however short)
         * while dst takes no more: read again once it has taken the pipe's bytes
         * (flush), not on every readiness of src until then. */
        return stop_reading(rl, w);
    }
    if (n == 0)
        return got_eof(rl, w);
    rl->spliced_reads++;
    w->held += (size_t)n;
    w->moved += (uint64_t)n;
    w->t->last = now();
    if (n < SMALL)
        w->small = 1; /* (from the next read on, once this pipe is drained) */
    if (w->writing) { /* dst takes no more yet: its writer flushes */
        if (w->held >= (size_t)w->cap)
            return stop_reading(rl, w);
        return 0;
    }
    return flush(rl, w);
}

static int flush(relay *rl, way *w) {
    while (w->held) {
        ssize_t n = splice(w->pipe_r, NULL, w->dst->fd, NULL, w->held, SPLICE_FLAGS);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN)
                return -1;
            /* Reading goes on into the pipe while it has room; a full pipe stops it
             * until dst has taken every byte. */
            if (w->reading && w->held >= (size_t)w->cap)
                w->reading = 0;
            w->writing = 1;
            if (watch(rl, w->src) < 0 || watch(rl, w->dst) < 0)
                return -1;
            return 0;
        }
        w->held -= (size_t)n;
    }
    pipe_return(rl, w);
    if (w->writing) {
        w->writing = 0;
        if (watch(rl, w->dst) < 0)
            return -1;
    }
    if (w->ended)
        return pass_eof(rl, w);
    if (!w->reading) {
        w->reading = 1;
        return watch(rl, w->src);
    }
    return 0;
}

/* One end's readiness: its reader reads, its writer writes; any failure ends the
 * tunnel. A hang-up or error wakes whichever is waiting, and its call sees it. */
static void ready(relay *rl, end *e, uint32_t events) {
    tunnel *t = e->src_of->t;
    if (t->state != RUNNING)
        return; /* (closed while this wait was under way) */
    int rc = 0;
    uint32_t bad = EPOLLERR | EPOLLHUP;
    if ((events & (EPOLLOUT | bad)) && e->dst_of->writing) {
        way *w = e->dst_of;
        rc = w->rest_len ? send_rest(rl, w) : flush(rl, w);
    }
    if (rc == 0 && t->state == RUNNING && (events & (EPOLLIN | bad)) && e->src_of->reading)
        rc = read_way(rl, e->src_of);
    if (rc < 0)
        finish(rl, t);
}

/* -- the thread ----------------------------------------------------------------- */

static void drop_dead(relay *rl);

static void handle(relay *rl, struct epoll_event *events, int n) {
    for (int i = 0; i < n; i++) {
        if (events[i].data.ptr == NULL) { /* the wake-up: stopping */
            uint64_t v;
            if (read(rl->wake, &v, sizeof v) < 0) {
            }
            continue;
        }
        ready(rl, events[i].data.ptr, events[i].events);
    }
}

static void *run(void *arg) {
    relay *rl = arg;
    struct epoll_event events[EVENTS];
    pthread_mutex_lock(&rl->lock);
    for (;;) {
        drop_dead(rl); /* no event of a later wait can name these */
        if (rl->stopping)
            break;
        pthread_mutex_unlock(&rl->lock);
        int n = epoll_wait(rl->ep, events, EVENTS, -1);
        pthread_mutex_lock(&rl->lock);
        handle(rl, events, n);
    }
    pthread_mutex_unlock(&rl->lock);
    return NULL;
}

static void release(relay *rl, tunnel *t) {
    (void)rl;
    if (--t->refs == 0)
        free(t);
}

static void drop_dead(relay *rl) {
    while (rl->dead) {
        tunnel *t = rl->dead;
        rl->dead = t->next_dead;
        release(rl, t);
    }
}

/* == Python ====================================================================== */

typedef struct {
    PyObject_HEAD
    relay *rl;
} RelayerObject;

typedef struct {
    PyObject_HEAD
    RelayerObject *owner;
    tunnel *t;
} TunnelObject;

static PyTypeObject TunnelType;

static int started(RelayerObject *self) {
    if (self->rl == NULL || self->rl->stopping) {
        PyErr_SetString(PyExc_RuntimeError, "the relayer has stopped");
        return 0;
    }
    return 1;
}

static void relay_free(relay *rl) {
    pool_clear(rl);
    if (rl->ep >= 0)
        close(rl->ep);
    if (rl->wake >= 0)
        close(rl->wake);
    if (rl->notify >= 0)
        close(rl->notify);
    free(rl->finished);
    pthread_mutex_destroy(&rl->lock);
    free(rl);
}

static PyObject *Relayer_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"pipe_size", NULL};
    int pipe_size = 1024 * 1024;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i", kwlist, &pipe_size))
        return NULL;
    RelayerObject *self = (RelayerObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    relay *rl = calloc(1, sizeof *rl);
    if (rl == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    pthread_mutex_init(&rl->lock, NULL);
    rl->pipe_size = pipe_size;
    rl->ep = epoll_create1(EPOLL_CLOEXEC);
    rl->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    rl->notify = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (rl->ep < 0 || rl->wake < 0 || rl->notify < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        relay_free(rl);
        Py_DECREF(self);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(rl->ep, EPOLL_CTL_ADD, rl->wake, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        relay_free(rl);
        Py_DECREF(self);
        return NULL;
    }
    /* The thread takes no signal: they are the interpreter's main thread's. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&rl->thread, NULL, run, rl);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        relay_free(rl);
        Py_DECREF(self);
        return NULL;
    }
    rl->threaded = 1;
    self->rl = rl;
    return (PyObject *)self;
}

/* Stop the thread (tunnels still running are closed) and free what it held. */
static PyObject *Relayer_stop(RelayerObject *self, PyObject *Py_UNUSED(ignored)) {
    relay *rl = self->rl;
    if (rl == NULL || rl->stopping)
        Py_RETURN_NONE;
    pthread_mutex_lock(&rl->lock);
    rl->stopping = 1;
    pthread_mutex_unlock(&rl->lock);
    if (rl->threaded) {
        uint64_t one = 1;
        if (write(rl->wake, &one, sizeof one) < 0) {
        }
        Py_BEGIN_ALLOW_THREADS
        pthread_join(rl->thread, NULL);
        Py_END_ALLOW_THREADS
    }
    /* The thread is gone: close what still runs, let go of the thread's references (a
     * tunnel Python still holds keeps its memory until its object goes), and close the
     * relayer's descriptors, so nothing is left open after a shutdown. */
    pthread_mutex_lock(&rl->lock);
    while (rl->first)
        teardown(rl, rl->first, CLOSED);
    drop_dead(rl);
    pool_clear(rl);
    close(rl->ep);
    close(rl->wake);
    close(rl->notify);
    rl->ep = rl->wake = rl->notify = -1;
    pthread_mutex_unlock(&rl->lock);
    Py_RETURN_NONE;
}

static void Relayer_dealloc(RelayerObject *self) {
    PyObject *r = Relayer_stop(self, NULL);
    Py_XDECREF(r);
    if (self->rl != NULL)
        relay_free(self->rl);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int set_nonblocking(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0)
        return -1;
    return fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

static void way_init(tunnel *t, way *w, end *src, end *dst) {
    w->t = t;
    w->src = src;
    w->dst = dst;
    w->pipe_r = w->pipe_w = -1;
    w->small = 1;
    src->src_of = w;
    dst->dst_of = w;
}

/* add(client_fd, upstream_fd, client_ended=False) -> Tunnel: relay between two
 * connected stream sockets, whose descriptors now belong to the relayer (closed by
 * it, even when this call fails). */
static PyObject *Relayer_add(RelayerObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"client", "upstream", "client_ended", NULL};
    int cfd, ufd, client_ended = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ii|p", kwlist, &cfd, &ufd, &client_ended))
        return NULL;
    if (!started(self)) {
        close(cfd);
        close(ufd);
        return NULL;
    }
    relay *rl = self->rl;
    TunnelObject *obj = PyObject_New(TunnelObject, &TunnelType);
    tunnel *t = calloc(1, sizeof *t);
    if (obj == NULL || t == NULL || set_nonblocking(cfd) < 0 || set_nonblocking(ufd) < 0) {
        if (obj != NULL && t == NULL)
            PyErr_NoMemory();
        else if (obj != NULL)
            PyErr_SetFromErrno(PyExc_OSError);
        free(t);
        if (obj != NULL) {
            obj->t = NULL;
            obj->owner = NULL;
            Py_DECREF(obj);
        }
        close(cfd);
        close(ufd);
        return NULL;
    }
    t->refs = 2;
    t->state = RUNNING;
    t->last = now();
    t->client.fd = cfd;
    t->upstream.fd = ufd;
    way_init(t, &t->out, &t->client, &t->upstream);
    way_init(t, &t->into, &t->upstream, &t->client);
    Py_INCREF(self);
    obj->owner = self;
    obj->t = t;
    pthread_mutex_lock(&rl->lock);
    t->id = ++rl->next_id;
    rl->running++;
    t->next = rl->first;
    if (rl->first)
        rl->first->prev = t;
    rl->first = t;
    int rc = 0;
    if (client_ended) {
        t->out.ended = 1;
        rc = pass_eof(rl, &t->out);
    } else {
        t->out.reading = 1;
        rc = watch(rl, &t->client);
    }
    if (rc == 0 && t->state == RUNNING) {
        t->into.reading = 1;
        rc = watch(rl, &t->upstream);
    }
    if (rc < 0)
        finish(rl, t);
    pthread_mutex_unlock(&rl->lock);
    return (PyObject *)obj;
}

/* The ids of the tunnels that ended since the last call, as a list (lock held). */
static PyObject *take_finished(relay *rl) {
    PyObject *ids = PyList_New((Py_ssize_t)rl->n_finished);
    if (ids == NULL)
        return NULL;
    for (size_t i = 0; i < rl->n_finished; i++) {
        PyObject *id = PyLong_FromUnsignedLongLong(rl->finished[i]);
        if (id == NULL) {
            Py_DECREF(ids);
            return NULL;
        }
        PyList_SET_ITEM(ids, (Py_ssize_t)i, id);
    }
    rl->n_finished = 0;
    return ids;
}

/* reap() -> list[int]: the ids of the tunnels that ended since the last call (a socket
 * failed, or both directions ended); their descriptors are closed already. */
static PyObject *Relayer_reap(RelayerObject *self, PyObject *Py_UNUSED(ignored)) {
    relay *rl = self->rl;
    if (rl == NULL)
        return PyList_New(0);
    uint64_t v;
    if (read(rl->notify, &v, sizeof v) < 0) {
    }
    pthread_mutex_lock(&rl->lock);
    PyObject *ids = take_finished(rl);
    pthread_mutex_unlock(&rl->lock);
    return ids;
}

static PyObject *Relayer_fileno(RelayerObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->rl == NULL)
        return PyLong_FromLong(-1);
    return PyLong_FromLong(self->rl->notify);
}

/* stats() -> (running tunnels, reads through the buffer, reads through a pipe) */
static PyObject *Relayer_stats(RelayerObject *self, PyObject *Py_UNUSED(ignored)) {
    relay *rl = self->rl;
    if (rl == NULL)
        return Py_BuildValue("(iKK)", 0, 0ULL, 0ULL);
    pthread_mutex_lock(&rl->lock);
    PyObject *r = Py_BuildValue("(iKK)", rl->running, (unsigned long long)rl->small_reads,
                                (unsigned long long)rl->spliced_reads);
    pthread_mutex_unlock(&rl->lock);
    return r;
}

static PyMethodDef Relayer_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Relayer_add, METH_VARARGS | METH_KEYWORDS,
     "add(client, upstream, client_ended=False) -> Tunnel: relay two sockets' descriptors "
     "(now the relayer's)."},
    {"reap", (PyCFunction)Relayer_reap, METH_NOARGS,
     "reap() -> list[int]: ids of the tunnels that ended since the last call."},
    {"fileno", (PyCFunction)Relayer_fileno, METH_NOARGS,
     "fileno() -> int: readable while ended tunnels wait to be reaped."},
    {"stats", (PyCFunction)Relayer_stats, METH_NOARGS,
     "stats() -> (running, small_reads, spliced_reads)."},
    {"stop", (PyCFunction)Relayer_stop, METH_NOARGS,
     "stop(): end the thread (call close() on running tunnels first)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RelayerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.engines._relay.Relayer",
    .tp_basicsize = sizeof(RelayerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Relayer(pipe_size=1 MiB): one thread relaying passthrough tunnels.",
    .tp_new = Relayer_new,
    .tp_dealloc = (destructor)Relayer_dealloc,
    .tp_methods = Relayer_methods,
};

/* -- Tunnel -------------------------------------------------------------------- */

static void Tunnel_dealloc(TunnelObject *self) {
    tunnel *t = self->t;
    RelayerObject *owner = self->owner;
    if (t != NULL && owner != NULL) {
        relay *rl = owner->rl;
        pthread_mutex_lock(&rl->lock);
        teardown(rl, t, CLOSED); /* (an object dropped while running: nothing leaks) */
        release(rl, t);
        pthread_mutex_unlock(&rl->lock);
    }
    Py_XDECREF(owner);
    PyObject_Free(self);
}

/* close(): stop relaying and close both sockets (idempotent; no reap follows). */
static PyObject *Tunnel_close(TunnelObject *self, PyObject *Py_UNUSED(ignored)) {
    relay *rl = self->owner->rl;
    pthread_mutex_lock(&rl->lock);
    teardown(rl, self->t, CLOSED);
    pthread_mutex_unlock(&rl->lock);
    Py_RETURN_NONE;
}

static PyObject *Tunnel_counts(TunnelObject *self, PyObject *Py_UNUSED(ignored)) {
    relay *rl = self->owner->rl;
    tunnel *t = self->t;
    pthread_mutex_lock(&rl->lock);
    unsigned long long out = t->out.moved, in = t->into.moved;
    double last = t->last;
    int running = t->state == RUNNING;
    pthread_mutex_unlock(&rl->lock);
    return Py_BuildValue("(KKdO)", out, in, last, running ? Py_True : Py_False);
}

static PyObject *Tunnel_id(TunnelObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(self->t->id);
}

static PyMethodDef Tunnel_methods[] = {
    {"close", (PyCFunction)Tunnel_close, METH_NOARGS,
     "close(): stop relaying and close both sockets (idempotent)."},
    {"counts", (PyCFunction)Tunnel_counts, METH_NOARGS,
     "counts() -> (bytes_out, bytes_in, last, running): bytes read from the client and "
     "from the upstream, the monotonic time of the last read."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tunnel_getset[] = {
    {"id", (getter)Tunnel_id, NULL, "the id reap() names it by", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TunnelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gateway.engines._relay.Tunnel",
    .tp_basicsize = sizeof(TunnelObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One relayed tunnel (made by Relayer.add).",
    .tp_dealloc = (destructor)Tunnel_dealloc,
    .tp_methods = Tunnel_methods,
    .tp_getset = Tunnel_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway.engines._relay",
    .m_doc = "Passthrough tunnels relayed by a native thread (engines/relay_native.py).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__relay(void) {
    if (PyType_Ready(&RelayerType) < 0 || PyType_Ready(&TunnelType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Relayer", (PyObject *)&RelayerType) < 0 ||
        PyModule_AddObjectRef(m, "Tunnel", (PyObject *)&TunnelType) < 0 ||
        PyModule_AddIntConstant(m, "SCRATCH", SCRATCH) < 0 ||
        PyModule_AddIntConstant(m, "SMALL", SMALL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
