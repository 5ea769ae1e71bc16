// SPDX-License-Identifier: Apache-2.0
//
// Asynchronous file I/O for the disk tier of offload (the ``async_io`` op).
//
// A handle owns a pool of I/O threads. A request (read or write ``nbytes`` of host memory at ``address`` from or to
// a file at ``offset``) is cut into blocks of ``block_size`` bytes; the blocks of every request go through one FIFO
// and at most ``queue_depth * intra_op_parallelism`` of them (one per thread, at most 64 threads) are in the kernel
// at once. Each thread moves its block with plain pread/pwrite, retrying short transfers and EINTR.
//
// Why threads with pread/pwrite rather than io_uring or libaio: they need nothing beyond the C library, and on the
// machines measured they moved as many bytes per second as io_uring (docs/ops.md has the figures and the prototype
// that measured them). libaio is not on the machines this package is built on.
//
// Files are opened with O_DIRECT (the page cache is bypassed, as upstream's op does) when the request's address and
// file offset are aligned to 4096 bytes; a file system that refuses O_DIRECT (EINVAL) gets buffered I/O for that
// request instead, counted in ``direct_refused()`` (the caller warns). A block whose address, offset or length is not
// aligned (the tail of a request whose length is not a multiple of 4096) goes through a second, buffered descriptor of
// the same file: the kernel keeps direct and buffered I/O of one file coherent when they do not overlap in time.
// Descriptors are opened when a request is submitted (an open that fails is reported at once) and closed by the
// thread that completes its last block, so a handle holds open files only for requests in flight, however many it
// has run. A request on a caller's file descriptor (``fd >= 0``) uses it as is and never closes it.
//
// Completion: ``wait_op(id)`` waits for one request, ``wait_all()`` for every request submitted so far and returns
// how many of those not waited for one by one completed since the last ``wait_all()`` (0 when nothing was queued). An error (the errno, the file, the
// offset; a read that reached the end of the file before the requested bytes is one) is returned as a message by
// whichever wait reports that request first.
//
// The op is a plain shared library with a C interface (the end of this file), loaded with ctypes by
// deepspeed/ops/aio/backends.py: ctypes releases the GIL during every call, so a Python thread the I/O threads never
// need runs while a caller waits, and the library includes neither torch nor pybind11 headers: it compiles in about
// two seconds and does not depend on torch's C++ ABI. The Python side checks tensors and passes raw addresses.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kAlignment = 4096;
constexpr int64_t kMaxThreads = 64;

bool aligned(int64_t value) { return value % kAlignment == 0; }

std::string errno_text(int error) { return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")"; }

struct Request {
    int64_t id = 0;
    bool write = false;
    char* buffer = nullptr;
    int64_t nbytes = 0;
    int64_t offset = 0;
    std::string path;
    int direct_fd = -1;    // O_DIRECT descriptor, or -1
    int buffered_fd = -1;  // plain descriptor, or -1
    bool owns_fds = true;  // false for a caller's descriptor
    int64_t blocks_left = 0;
    std::string error;
};

struct Block {
    std::shared_ptr<Request> request;
    int64_t start;
    int64_t length;
    bool direct;
};

// A fault the tests inject: after ``after`` more successful blocks of one kind (0 reads, 1 writes), blocks of that kind
// fail with ``error``; kind 2 makes O_DIRECT opens fail with ``error`` (EINVAL: a file system that refuses it).
enum FaultKind : int { kFaultRead = 0, kFaultWrite = 1, kFaultDirectOpen = 2 };

struct Fault {
    bool armed = false;
    int kind = kFaultWrite;
    int64_t after = 0;
    int error = 0;
};

class IOHandle {
public:
    IOHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events, int64_t intra_op)
        : block_size_(block_size), queue_depth_(queue_depth), single_submit_(single_submit),
          overlap_events_(overlap_events), intra_op_(intra_op)
    {
        if (block_size_ <= 0 || queue_depth_ <= 0 || intra_op_ <= 0) {
            throw std::invalid_argument("aio handle: block_size, queue_depth and intra_op_parallelism must be >= 1");
        }
        // Blocks are whole multiples of the alignment, so every block of an aligned request can be direct.
        io_block_ = ((block_size_ + kAlignment - 1) / kAlignment) * kAlignment;
        threads_wanted_ = std::min<int64_t>(kMaxThreads, queue_depth_ * intra_op_);
    }

    ~IOHandle() { shutdown(); }

    int64_t block_size() const { return block_size_; }
    int64_t queue_depth() const { return queue_depth_; }
    bool single_submit() const { return single_submit_; }
    bool overlap_events() const { return overlap_events_; }
    int64_t intra_op_parallelism() const { return intra_op_; }
    int64_t threads() const { return threads_wanted_; }

    // Queue one request; returns (id, error). On an error (the file cannot be opened) nothing is queued and id is -1.
    std::pair<int64_t, std::string> submit(bool write, uintptr_t address, int64_t nbytes, const std::string& path,
                                           int fd, int64_t offset)
    {
        if (nbytes < 0 || offset < 0) return {-1, "aio: negative size or offset"};
        auto request = std::make_shared<Request>();
        request->write = write;
        request->buffer = reinterpret_cast<char*>(address);
        request->nbytes = nbytes;
        request->offset = offset;
        request->path = path;
        const bool base_aligned = aligned(static_cast<int64_t>(address)) && aligned(offset);
        const bool needs_buffered = !base_aligned || !aligned(nbytes);
        if (fd >= 0) {  // the caller's descriptor, whatever its flags: every block through it
            request->buffered_fd = fd;
            request->owns_fds = false;
        } else {
            const int flags = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
            if (base_aligned && nbytes >= kAlignment) {
                const int refused = injected_open_error();
                request->direct_fd = refused ? -1 : ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
                if (request->direct_fd < 0) {
                    const int error = refused ? refused : errno;
                    if (error != EINVAL) return {-1, "aio: cannot open " + path + ": " + errno_text(error)};
                    std::lock_guard<std::mutex> lock(mutex_);
                    ++direct_refused_;  // the file system takes no O_DIRECT: buffered I/O below
                }
            }
            if (needs_buffered || request->direct_fd < 0) {
                request->buffered_fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
                if (request->buffered_fd < 0) {
                    const int error = errno;
                    if (request->direct_fd >= 0) ::close(request->direct_fd);
                    return {-1, "aio: cannot open " + path + ": " + errno_text(error)};
                }
            }
        }
        std::vector<Block> blocks;
        for (int64_t start = 0; start < nbytes; start += io_block_) {
            const int64_t length = std::min(io_block_, nbytes - start);
            const bool direct = request->direct_fd >= 0 && aligned(length);
            blocks.push_back(Block{request, start, length, direct});
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (stopping_) {
                close_fds(*request);
                return {-1, "aio: the handle is closed"};
            }
            request->id = next_id_++;
            if (blocks.empty()) {  // nothing to move: complete at once
                completed_.insert(request->id);
                close_fds(*request);
                return {request->id, ""};
            }
            request->blocks_left = static_cast<int64_t>(blocks.size());
            pending_.insert(request->id);
            for (auto& block : blocks) queue_.push_back(std::move(block));
            start_threads_locked();
        }
        work_.notify_all();
        return {request->id, ""};
    }

    // Block until request ``id`` completed; its error message, or "" (also for an id already reported).
    std::string wait_op(int64_t id)
    {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return pending_.count(id) == 0; });
        completed_.erase(id);  // reported here: not counted by the next wait_all
        auto found = errors_.find(id);
        if (found == errors_.end()) return "";
        std::string message = found->second;
        errors_.erase(found);
        return message;
    }

    // Block until nothing is in flight; (requests completed since the last wait_all, error of the first failed one).
    std::pair<int64_t, std::string> wait_all()
    {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return pending_.empty(); });
        const int64_t count = static_cast<int64_t>(completed_.size());
        completed_.clear();
        std::string message;
        if (!errors_.empty()) {
            message = errors_.begin()->second;
            if (errors_.size() > 1) {
                message += " (and " + std::to_string(errors_.size() - 1) + " more failed requests)";
            }
            errors_.clear();
        }
        return {count, message};
    }

    bool is_done(int64_t id) const
    {
        std::lock_guard<std::mutex> lock(mutex_);
        return pending_.count(id) == 0;
    }

    int64_t pending() const
    {
        std::lock_guard<std::mutex> lock(mutex_);
        return static_cast<int64_t>(pending_.size());
    }

    int64_t direct_refused() const
    {
        std::lock_guard<std::mutex> lock(mutex_);
        return direct_refused_;
    }

    void inject_fault(int kind, int64_t after, int error)
    {
        std::lock_guard<std::mutex> lock(mutex_);
        fault_ = Fault{error != 0, kind, after, error};
    }

    void shutdown()
    {
        {
            std::unique_lock<std::mutex> lock(mutex_);
            done_.wait(lock, [&] { return pending_.empty(); });
            stopping_ = true;
        }
        work_.notify_all();
        for (auto& thread : threads_) {
            if (thread.joinable()) thread.join();
        }
        threads_.clear();
    }

private:
    // The errno an injected fault gives this O_DIRECT open, or 0.
    int injected_open_error()
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!fault_.armed || fault_.kind != kFaultDirectOpen) return 0;
        if (fault_.after > 0) {
            --fault_.after;
            return 0;
        }
        return fault_.error;
    }

    void start_threads_locked()
    {
        while (static_cast<int64_t>(threads_.size()) < threads_wanted_ &&
               threads_.size() < queue_.size() + busy_) {
            threads_.emplace_back([this] { run(); });
        }
    }

    static void close_fds(Request& request)
    {
        if (!request.owns_fds) return;
        if (request.direct_fd >= 0) ::close(request.direct_fd);
        if (request.buffered_fd >= 0) ::close(request.buffered_fd);
        request.direct_fd = request.buffered_fd = -1;
    }

    void run()
    {
        for (;;) {
            Block block;
            int injected = 0;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
                if (queue_.empty()) return;
                block = std::move(queue_.front());
                queue_.pop_front();
                ++busy_;
                if (fault_.armed && fault_.kind == (block.request->write ? kFaultWrite : kFaultRead)) {
                    if (fault_.after > 0) {
                        --fault_.after;
                    } else {
                        injected = fault_.error;
                    }
                }
            }
            std::string error = injected ? describe(block, block.request->offset + block.start, injected) : transfer(block);
            finish(block, error);
        }
    }

    static std::string describe(const Block& block, int64_t at, int error)
    {
        const Request& r = *block.request;
        return std::string("aio: ") + (r.write ? "write to " : "read from ") + r.path + " at byte " +
               std::to_string(at) + " failed: " + errno_text(error);
    }

    static std::string transfer(const Block& block)
    {
        const Request& r = *block.request;
        const int fd = block.direct ? r.direct_fd : r.buffered_fd;
        char* data = r.buffer + block.start;
        int64_t at = r.offset + block.start;
        int64_t left = block.length;
        while (left > 0) {
            const ssize_t n = r.write ? ::pwrite(fd, data, static_cast<size_t>(left), at)
                                      : ::pread(fd, data, static_cast<size_t>(left), at);
            if (n < 0) {
                if (errno == EINTR) continue;
                return describe(block, at, errno);
            }
            if (n == 0) {
                if (r.write) return describe(block, at, EIO);
                struct stat st;
                const int64_t size = ::fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
                return "aio: short read from " + r.path + ": the file ends at byte " + std::to_string(size) +
                       ", the request reads bytes [" + std::to_string(r.offset) + ", " +
                       std::to_string(r.offset + r.nbytes) + ")";
            }
            data += n;
            at += n;
            left -= n;
        }
        return "";
    }

    void finish(const Block& block, const std::string& error)
    {
        Request& r = *block.request;
        bool done = false;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            --busy_;
            if (!error.empty() && r.error.empty()) r.error = error;
            if (--r.blocks_left == 0) {
                done = true;
                close_fds(r);
                pending_.erase(r.id);
                completed_.insert(r.id);
                if (!r.error.empty()) errors_[r.id] = r.error;
            }
        }
        if (done) done_.notify_all();
    }

    const int64_t block_size_;
    const int64_t queue_depth_;
    const bool single_submit_;
    const bool overlap_events_;
    const int64_t intra_op_;
    int64_t io_block_ = kAlignment;
    int64_t threads_wanted_ = 1;

    mutable std::mutex mutex_;
    std::condition_variable work_;
    std::condition_variable done_;
    std::deque<Block> queue_;
    std::vector<std::thread> threads_;
    std::unordered_set<int64_t> pending_;
    std::map<int64_t, std::string> errors_;
    std::unordered_set<int64_t> completed_;  // completed, not yet reported by wait_op or counted by wait_all
    int64_t next_id_ = 0;
    int64_t busy_ = 0;
    int64_t direct_refused_ = 0;
    bool stopping_ = false;
    Fault fault_;
};

}  // namespace

// The C interface the Python side loads with ctypes (which releases the GIL during every call): messages go into the
// caller's buffer ``err`` of ``errlen`` bytes, and no C++ exception crosses it.
namespace {

void put(const std::string& message, char* err, int64_t errlen)
{
    if (err == nullptr || errlen <= 0) return;
    const size_t n = std::min<size_t>(message.size(), static_cast<size_t>(errlen - 1));
    std::memcpy(err, message.data(), n);
    err[n] = '\0';
}

}  // namespace

extern "C" {

int64_t ds_aio_alignment() { return kAlignment; }

int64_t ds_aio_max_threads() { return kMaxThreads; }

void* ds_aio_create(int64_t block_size, int64_t queue_depth, int single_submit, int overlap_events,
                    int64_t intra_op_parallelism, char* err, int64_t errlen)
{
    try {
        return new IOHandle(block_size, queue_depth, single_submit != 0, overlap_events != 0, intra_op_parallelism);
    } catch (const std::exception& error) {
        put(error.what(), err, errlen);
        return nullptr;
    }
}

void ds_aio_destroy(void* handle) { delete static_cast<IOHandle*>(handle); }

int64_t ds_aio_threads(void* handle) { return static_cast<IOHandle*>(handle)->threads(); }

// The request's id, or -1 with the reason in ``err``.
int64_t ds_aio_submit(void* handle, int write, uint64_t address, int64_t nbytes, const char* path, int fd,
                      int64_t offset, char* err, int64_t errlen)
{
    try {
        auto result = static_cast<IOHandle*>(handle)->submit(write != 0, static_cast<uintptr_t>(address), nbytes,
                                                             path ? std::string(path) : std::string(), fd, offset);
        if (!result.second.empty()) {
            put(result.second, err, errlen);
            return -1;
        }
        return result.first;
    } catch (const std::exception& error) {
        put(std::string("aio: ") + error.what(), err, errlen);
        return -1;
    }
}

// 0 when request ``id`` succeeded, 1 with its error in ``err``.
int ds_aio_wait_op(void* handle, int64_t id, char* err, int64_t errlen)
{
    const std::string message = static_cast<IOHandle*>(handle)->wait_op(id);
    put(message, err, errlen);
    return message.empty() ? 0 : 1;
}

// The count of requests completed since the last call; ``*failed`` is 1 with the first error in ``err``.
int64_t ds_aio_wait_all(void* handle, char* err, int64_t errlen, int* failed)
{
    auto result = static_cast<IOHandle*>(handle)->wait_all();
    put(result.second, err, errlen);
    *failed = result.second.empty() ? 0 : 1;
    return result.first;
}

int64_t ds_aio_pending(void* handle) { return static_cast<IOHandle*>(handle)->pending(); }

// 1 when request ``id`` is no longer in flight (waiting for it would not block).
int ds_aio_is_done(void* handle, int64_t id) { return static_cast<IOHandle*>(handle)->is_done(id) ? 1 : 0; }

int64_t ds_aio_direct_refused(void* handle) { return static_cast<IOHandle*>(handle)->direct_refused(); }

void ds_aio_inject_fault(void* handle, int kind, int64_t after, int error)
{
    static_cast<IOHandle*>(handle)->inject_fault(kind, after, error);
}

void ds_aio_shutdown(void* handle) { static_cast<IOHandle*>(handle)->shutdown(); }

}  // extern "C"
