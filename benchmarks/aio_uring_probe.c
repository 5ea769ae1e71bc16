// SPDX-License-Identifier: Apache-2.0
//
// How fast io_uring moves a file with O_DIRECT, to compare with the async_io op's thread pool (docs/ops.md says why
// the op uses threads). Raw system calls, no liburing: one ring of QUEUE_DEPTH entries, READ/WRITE requests of
// BLOCK bytes from one aligned buffer, kept QUEUE_DEPTH in flight until SIZE bytes moved; LOOPS timed passes, the
// median printed in GB/s (1e9 bytes/s).
//
//   cc -O2 -o /tmp/uring_probe benchmarks/aio_uring_probe.c
//   /tmp/uring_probe FILE SIZE_MB BLOCK_KB QUEUE_DEPTH [LOOPS]     # writes FILE, then reads it back
//
// Prints "uring write X GB/s" and "uring read Y GB/s", or why io_uring is not available (a kernel without it, or a
// sandbox refusing io_uring_setup).

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

struct ring {
    int fd;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe* sqes;
    struct io_uring_cqe* cqes;
};

static int ring_init(struct ring* r, unsigned entries)
{
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (r->fd < 0) return -errno;
    size_t sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    char* sq = mmap(0, sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    char* cq = mmap(0, cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_CQ_RING);
    r->sqes = mmap(0, p.sq_entries * sizeof(struct io_uring_sqe), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                   r->fd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || cq == MAP_FAILED || r->sqes == MAP_FAILED) return -errno;
    r->sq_head = (unsigned*)(sq + p.sq_off.head);
    r->sq_tail = (unsigned*)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned*)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned*)(sq + p.sq_off.array);
    r->cq_head = (unsigned*)(cq + p.cq_off.head);
    r->cq_tail = (unsigned*)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned*)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe*)(cq + p.cq_off.cqes);
    return 0;
}

static void push(struct ring* r, int write, int fd, char* buf, unsigned len, long long off)
{
    unsigned tail = *r->sq_tail;
    unsigned index = tail & *r->sq_mask;
    struct io_uring_sqe* sqe = &r->sqes[index];
    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = fd;
    sqe->addr = (unsigned long)buf;
    sqe->len = len;
    sqe->off = (unsigned long long)off;
    r->sq_array[index] = index;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
}

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// One pass over the file; seconds, or a negative errno.
static double pass(struct ring* r, int write, int fd, char* buf, long long size, unsigned block, unsigned depth)
{
    double start = now();
    long long next = 0, done = 0;
    unsigned inflight = 0;
    while (done < size) {
        unsigned submit = 0;
        while (inflight < depth && next < size) {
            unsigned len = (unsigned)((size - next) < block ? (size - next) : block);
            push(r, write, fd, buf + (next % (64LL << 20)), len, next);  // requests cycle over a 64 MiB buffer
            next += len;
            ++inflight;
            ++submit;
        }
        int got = (int)syscall(__NR_io_uring_enter, r->fd, submit, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (got < 0 && errno != EINTR) return -errno;
        unsigned head = *r->cq_head;
        while (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            struct io_uring_cqe* cqe = &r->cqes[head & *r->cq_mask];
            if (cqe->res < 0) return cqe->res;
            done += cqe->res;
            --inflight;
            ++head;
        }
        __atomic_store_n(r->cq_head, head, __ATOMIC_RELEASE);
    }
    return now() - start;
}

static int cmp(const void* a, const void* b)
{
    double x = *(const double*)a, y = *(const double*)b;
    return (x > y) - (x < y);
}

int main(int argc, char** argv)
{
    if (argc < 5) {
        fprintf(stderr, "usage: %s FILE SIZE_MB BLOCK_KB QUEUE_DEPTH [LOOPS]\n", argv[0]);
        return 2;
    }
    const char* path = argv[1];
    long long size = atoll(argv[2]) << 20;
    unsigned block = (unsigned)atoi(argv[3]) << 10;
    unsigned depth = (unsigned)atoi(argv[4]);
    int loops = argc > 5 ? atoi(argv[5]) : 3;
    struct ring r;
    int status = ring_init(&r, depth);
    if (status < 0) {
        printf("uring unavailable: io_uring_setup failed: %s\n", strerror(-status));
        return 0;
    }
    char* buf;
    if (posix_memalign((void**)&buf, 4096, 64LL << 20)) return 1;
    memset(buf, 7, 64LL << 20);
    int fd = open(path, O_RDWR | O_CREAT | O_DIRECT, 0644);
    if (fd < 0) {
        printf("uring unavailable: open(O_DIRECT) failed: %s\n", strerror(errno));
        return 0;
    }
    for (int write = 1; write >= 0; --write) {
        double times[64];
        int n = loops < 64 ? loops : 64;
        pass(&r, write, fd, buf, size, block, depth);  // warm-up
        for (int i = 0; i < n; ++i) {
            times[i] = pass(&r, write, fd, buf, size, block, depth);
            if (times[i] < 0) {
                printf("uring %s failed: %s\n", write ? "write" : "read", strerror((int)-times[i]));
                return 1;
            }
        }
        qsort(times, n, sizeof(double), cmp);
        printf("uring %s %.2f GB/s\n", write ? "write" : "read", size / times[n / 2] / 1e9);
    }
    close(fd);
    unlink(path);
    return 0;
}
