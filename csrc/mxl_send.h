/* The per-batch task frame, packed and sent without Python objects: the
 * little-endian layout of messages.py's PackedTask (header, fixed fields,
 * dropped slab ids, then the indices straight from their memory).
 *
 * The send never blocks: it runs with the GIL held (so no other thread can
 * close the socket and let its descriptor number be reused meanwhile), and a
 * full socket (a worker that stopped reading) is left to the caller, which
 * finishes the frame with a blocking send that releases the GIL. */
#ifndef MXL_SEND_H
#define MXL_SEND_H

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

/* Header (magic, version, tag, payload length, descriptors) and fixed fields. */
#define MXL_TASK_FIXED 53
/* Dropped slab ids and indices (int64 each) a frame can hold: the payload's
 * length (44 fixed bytes, then 8 per word) is a uint32. */
#define MXL_TASK_MAX_WORDS ((0xFFFFFFFFu - 44u) / 8u)

static inline void mxl_put_le(char *p, uint64_t v, int nbytes)
{
    for (int i = 0; i < nbytes; i++)
        p[i] = (char)(v >> (8 * i));
}

/* The header and fixed fields of a task frame into `head` (MXL_TASK_FIXED
 * bytes), `prefix` being magic, version and tag (4 bytes). */
static void mxl_pack_task(char *head, const char *prefix, int64_t epoch, int64_t idx,
                          int64_t slab_id, int64_t slab_size, int flags, uint32_t ndrops,
                          uint32_t nindices, int nfds)
{
    memcpy(head, prefix, 4);
    mxl_put_le(head + 4, 44 + 8 * ((uint64_t)ndrops + nindices), 4);
    head[8] = (char)nfds;
    mxl_put_le(head + 9, (uint64_t)epoch, 8);
    mxl_put_le(head + 17, (uint64_t)idx, 8);
    mxl_put_le(head + 25, (uint64_t)slab_id, 8);
    mxl_put_le(head + 33, (uint64_t)slab_size, 8);
    head[41] = (char)flags;
    head[42] = head[43] = head[44] = 0;
    mxl_put_le(head + 45, ndrops, 4);
    mxl_put_le(head + 49, nindices, 4);
}

/* Send the `n` pieces of `iov` as one message (several task frames, each a
 * head then its indices), descriptor `fd` (-1: none) with its first byte.
 * Returns the bytes sent (0 when the socket is full), or -errno. */
static long mxl_send_pieces(int sock, struct iovec *iov, int n, int fd)
{
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    if (fd >= 0) {
        struct cmsghdr *c;
        memset(&control, 0, sizeof control);
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    for (;;) {
        ssize_t sent = sendmsg(sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (sent >= 0)
            return (long)sent;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            return 0;
        return -errno;
    }
}

/* Send `head` then `data` (one task frame) as one message, descriptor `fd`
 * (-1: none) with its first byte.  As mxl_send_pieces. */
static long mxl_send_frame(int sock, const char *head, size_t hlen, const char *data, size_t dlen, int fd)
{
    struct iovec iov[2];
    iov[0].iov_base = (void *)head;
    iov[0].iov_len = hlen;
    iov[1].iov_base = (void *)data;
    iov[1].iov_len = dlen;
    return mxl_send_pieces(sock, iov, dlen ? 2 : 1, fd);
}

#endif
