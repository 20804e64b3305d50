/* The main process's side of a worker channel, in C: read what a worker
 * sent without blocking, split it into frames, and keep the descriptors
 * (SCM_RIGHTS) that came with them.  No Python object is touched here, so
 * the fetcher thread runs all of it with the GIL released.
 *
 * The frame format is mxload/_runtime/messages.py's (the one place that
 * defines cross-process formats): a header of MXL_FRAME_HEADER bytes (2
 * magic bytes, protocol version, type tag, uint32 payload length, uint8
 * descriptor count; little endian), then the payload.  The payload of the
 * BatchRef type (its tag, the magic and the version are the receiver's
 * arguments, from messages.py) is MXL_BATCH_WORDS little-endian int64
 * (mxl_batch_frame); every other frame is left to Python.
 * tests/test_core_receive.py checks that both sides agree.
 */
#ifndef MXL_RECV_H
#define MXL_RECV_H

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#define MXL_FRAME_HEADER 9
#define MXL_HEADER_LENGTH_AT 4
#define MXL_HEADER_NFDS_AT 8
#define MXL_HEADER_TAG_AT 3
#define MXL_HEADER_VERSION_AT 2
#define MXL_BATCH_WORDS 5
#define MXL_BATCH_SIZE (8 * MXL_BATCH_WORDS)
/* Descriptors held for frames not yet complete; a frame carries at most one. */
#define MXL_FDQ 16
#define MXL_READ_CHUNK 4096

typedef struct {
    int64_t epoch, idx, slab_id, nbytes, layout_id;
} mxl_batch_frame;

typedef struct {
    int sock;            /* -1: slot unused */
    int sentinel;        /* readable when the worker process has ended; -1: none */
    int64_t tag;         /* the caller's name for whoever is attached (copied into stored batches) */
    char *buf;           /* received bytes; frames start at buf[start] */
    size_t start, len, cap;
    int fds[MXL_FDQ];    /* received descriptors not yet given to a frame, in order */
    int nfds;
    int eof;             /* the peer closed its end (or the channel broke) */
    int fd_overflow;     /* MSG_CTRUNC: this process had no room for a descriptor */
    int end_reported;    /* the consumer was told of the end above: it stops polling the channel */
    int death_reported;  /* the watcher was told the process ended: it stops polling the sentinel */
} mxl_channel;

static void mxl_channel_init(mxl_channel *ch)
{
    memset(ch, 0, sizeof(*ch));
    ch->sock = -1;
    ch->sentinel = -1;
}

/* Close every descriptor still held and free the buffer; the socket and the
 * sentinel belong to the caller. */
static void mxl_channel_reset(mxl_channel *ch)
{
    int i;
    for (i = 0; i < ch->nfds; i++)
        close(ch->fds[i]);
    free(ch->buf);
    mxl_channel_init(ch);
}

static int mxl_channel_reserve(mxl_channel *ch, size_t extra)
{
    char *p;
    size_t want;
    if (ch->start > 0 && (ch->start == ch->len || ch->start >= ch->cap / 2)) {
        memmove(ch->buf, ch->buf + ch->start, ch->len - ch->start);
        ch->len -= ch->start;
        ch->start = 0;
    }
    if (ch->cap - ch->len >= extra)
        return 0;
    want = ch->cap ? ch->cap : 2 * MXL_READ_CHUNK;
    while (want - ch->len < extra)
        want *= 2;
    p = (char *)realloc(ch->buf, want);
    if (p == NULL)
        return -1;
    ch->buf = p;
    ch->cap = want;
    return 0;
}

static inline uint32_t mxl_le32(const char *p)
{
    const unsigned char *u = (const unsigned char *)p;
    return (uint32_t)u[0] | ((uint32_t)u[1] << 8) | ((uint32_t)u[2] << 16) | ((uint32_t)u[3] << 24);
}

static inline int64_t mxl_le64(const char *p)
{
    const unsigned char *u = (const unsigned char *)p;
    uint64_t v = 0;
    int i;
    for (i = 7; i >= 0; i--)
        v = (v << 8) | u[i];
    return (int64_t)v;
}

/* One non-blocking recvmsg into the channel's buffer.  Returns the bytes
 * read, 0 at end of stream (ch->eof set), -1 with errno (EAGAIN: nothing
 * waiting; ENOMEM: no buffer).  A read asks for at least the rest of the
 * frame being received, so a large frame takes few calls. */
static ssize_t mxl_channel_fill(mxl_channel *ch)
{
    struct msghdr msg;
    struct iovec iov;
    union {
        char space[CMSG_SPACE(sizeof(int) * MXL_FDQ)];
        struct cmsghdr align;
    } control;
    struct cmsghdr *cm;
    size_t want = MXL_READ_CHUNK;
    ssize_t n;
    if (ch->len - ch->start >= MXL_FRAME_HEADER) {
        size_t frame = MXL_FRAME_HEADER + (size_t)mxl_le32(ch->buf + ch->start + MXL_HEADER_LENGTH_AT);
        if (frame > ch->len - ch->start && frame - (ch->len - ch->start) > want)
            want = frame - (ch->len - ch->start);
    }
    if (mxl_channel_reserve(ch, want) != 0) {
        errno = ENOMEM;
        return -1;
    }
    memset(&msg, 0, sizeof(msg));
    iov.iov_base = ch->buf + ch->len;
    iov.iov_len = ch->cap - ch->len;
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    /* Room for as many descriptors as the queue still holds. */
    msg.msg_control = control.space;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (MXL_FDQ - ch->nfds));
    if (ch->nfds >= MXL_FDQ) {
        msg.msg_control = NULL;
        msg.msg_controllen = 0;
    }
    do {
        n = recvmsg(ch->sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0)
        return -1;
    for (cm = msg.msg_controllen ? CMSG_FIRSTHDR(&msg) : NULL; cm != NULL; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            size_t k, count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            for (k = 0; k < count; k++) {
                int fd;
                memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof(int));
                if (ch->nfds < MXL_FDQ)
                    ch->fds[ch->nfds++] = fd;
                else
                    close(fd);
            }
        }
    }
    if (msg.msg_flags & MSG_CTRUNC)
        ch->fd_overflow = 1;
    if (n == 0)
        ch->eof = 1;
    ch->len += (size_t)n;
    return n;
}

/* The next complete frame: 1 and its header, payload and descriptor count,
 * or 0 if none is complete yet. */
static int mxl_channel_next(const mxl_channel *ch, const char **header, const char **payload,
                            uint32_t *plen, int *nfds)
{
    size_t have = ch->len - ch->start;
    uint32_t length;
    if (have < MXL_FRAME_HEADER)
        return 0;
    length = mxl_le32(ch->buf + ch->start + MXL_HEADER_LENGTH_AT);
    if (have < MXL_FRAME_HEADER + (size_t)length)
        return 0;
    *nfds = (unsigned char)ch->buf[ch->start + MXL_HEADER_NFDS_AT];
    *header = ch->buf + ch->start;
    *payload = ch->buf + ch->start + MXL_FRAME_HEADER;
    *plen = length;
    return 1;
}

/* Drop the frame mxl_channel_next returned (its descriptors too, unless the
 * caller took them with mxl_channel_take_fds). */
static void mxl_channel_pop(mxl_channel *ch, uint32_t plen)
{
    ch->start += MXL_FRAME_HEADER + (size_t)plen;
    if (ch->start == ch->len)
        ch->start = ch->len = 0;
}

/* Move the first `n` queued descriptors to `out` (n <= MXL_FDQ); returns
 * how many there were (fewer than n: the frame lied, or they were lost). */
static int mxl_channel_take_fds(mxl_channel *ch, int n, int *out)
{
    int k = n < ch->nfds ? n : ch->nfds;
    memcpy(out, ch->fds, sizeof(int) * (size_t)k);
    memmove(ch->fds, ch->fds + k, sizeof(int) * (size_t)(ch->nfds - k));
    ch->nfds -= k;
    return k;
}

static void mxl_batch_decode(const char *p, mxl_batch_frame *f)
{
    f->epoch = mxl_le64(p);
    f->idx = mxl_le64(p + 8);
    f->slab_id = mxl_le64(p + 16);
    f->nbytes = mxl_le64(p + 24);
    f->layout_id = mxl_le64(p + 32);
}

/* The consumer's wake-up: an eventfd that other threads signal when they
 * change what the consumer waits for (an item put, the buffer closed, a
 * worker attached).  Level-triggered until cleared, so none is lost. */
static int mxl_event_open(void)
{
    return eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
}

static void mxl_event_signal(int fd)
{
    uint64_t one = 1;
    ssize_t r;
    do {
        r = write(fd, &one, sizeof(one));
    } while (r < 0 && errno == EINTR);
}

static void mxl_event_close(int fd)
{
    close(fd);
}

static void mxl_event_clear(int fd)
{
    uint64_t value;
    ssize_t r;
    do {
        r = read(fd, &value, sizeof(value));
    } while (r < 0 && errno == EINTR);
}

#endif
