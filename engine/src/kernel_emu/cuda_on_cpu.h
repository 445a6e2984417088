// CUDA kernel sources run on the CPU, for tests. A block's threads are fibers on the calling
// thread, switched only where CUDA threads wait for each other: at __syncthreads and at a warp
// shuffle (the warp's lanes exchange through a buffer, a warp-wide barrier between writing and
// reading). Blocks run one after another, first to last and last to first in turn from launch
// to launch, under two schedules in turn (block by block, and launch by launch for one-block
// grids): waiting threads resumed in index order, or the lanes
// of the warp that just waited first (so one warp runs ahead of the others, as a missing
// barrier lets it on a GPU). A barrier that some threads never reach, a shuffle from a partial
// warp or with lanes out of step (matched by count and source line, stricter than sm_70+), launch
// sizes a GPU refuses and arguments of the wrong size are errors. Dynamic shared memory starts
// filled with 0xff bytes (NaN as floats) in every block and ends at a guard page, so touching a
// word past the launch's size faults (the test process dies of SIGSEGV, naming no kernel);
// static __shared__ variables are neither poisoned nor guarded.
// cp.async copies land when issued in some blocks and only at the wait that completes their
// group in others (emu::cp_async16); one still in flight at __syncthreads or a thread's return
// is an error.
// Not emulated: __launch_bounds__ (ignored), races between blocks (one block at a time; atomics
// and fences are trivial), and CUDA's own arithmetic (the host's libm, no FMA contraction).
// The test harness (kernel_emu/mod.rs) appends the kernel source, with each
// `extern __shared__ T name[];` rewritten to `T *name = (T *)emu::dynamic_shared();`, and the
// table of its kernels, then compiles it all as one shared library.
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <source_location>
#include <utility>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct uint3 {
    unsigned int x, y, z;
};

static uint3 blockIdx, blockDim, gridDim;

__device__ inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
__device__ inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
__device__ inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
// CUDA's fast exp is approximate: at most 2 + floor(1.173 |x|) ulps off (the CUDA C++
// Programming Guide). The emulation returns the low end of that bound, so that a kernel
// using it as a bound that lets work be skipped is tested at its most eager.
// 0, infinities and NaN are exact, as on a GPU.
__device__ inline float __expf(float x) {
    const float e = expf(x);
    if (!(e > 0.0f) || e == INFINITY) return e;
    return e * (1.0f - (2.0f + floorf(1.173f * fabsf(x))) * 1.1920929e-7f);
}
__device__ inline unsigned int __umulhi(unsigned int a, unsigned int b) {
    return (unsigned int)(((uint64_t)a * b) >> 32);
}
// CUDA's integer and floating overloads of min and max, mixed signedness included.
#define EMU_MIN_MAX(R, A, B)                                           \
    __device__ inline R min(A a, B b) { return (R)a < (R)b ? (R)a : (R)b; } \
    __device__ inline R max(A a, B b) { return (R)a > (R)b ? (R)a : (R)b; }
EMU_MIN_MAX(int, int, int)
EMU_MIN_MAX(unsigned int, unsigned int, unsigned int)
EMU_MIN_MAX(unsigned int, int, unsigned int)
EMU_MIN_MAX(unsigned int, unsigned int, int)
EMU_MIN_MAX(long long, long long, long long)
EMU_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
__device__ inline float min(float a, float b) { return fminf(a, b); }
__device__ inline float max(float a, float b) { return fmaxf(a, b); }
__device__ inline double min(double a, double b) { return fmin(a, b); }
__device__ inline double max(double a, double b) { return fmax(a, b); }

// CUDA's rounded arithmetic that is never contracted into an FMA (the host compile contracts
// nothing either).
__device__ inline float __fadd_rn(float a, float b) { return a + b; }
__device__ inline float __fsub_rn(float a, float b) { return a - b; }
__device__ inline float __fmul_rn(float a, float b) { return a * b; }
__device__ inline float __fdiv_rn(float a, float b) { return a / b; }

// A host compile converts f16 in software (the kernels use PTX's cvt on a GPU).
inline float host_f16_to_f32(unsigned short bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}
inline unsigned short host_f32_to_f16(float f) {
    _Float16 h = (_Float16)f;
    unsigned short bits;
    memcpy(&bits, &h, 2);
    return bits;
}

namespace emu {

constexpr unsigned WARP = 32;
constexpr unsigned MAX_THREADS = 1024;
constexpr size_t SHARED_BYTES = 48 * 1024;
constexpr size_t STACK_BYTES = 64 * 1024;

enum State { READY, AT_BLOCK, AT_WARP, DONE };

// One 16-byte cp.async: to `dst` from `src`, or zeros where `live` is false.
struct AsyncCopy {
    void *dst;
    const void *src;
    bool live;
};

struct Fiber {
    jmp_buf env;
    ucontext_t context;
    uint3 tid;
    State state;
    bool started;
    // Shuffles this thread has made: lanes meet at the same count, and the parity picks the
    // exchange buffer.
    unsigned shuffles;
    // Its cp.async copies in flight in deferred blocks: closed groups, oldest first, and the
    // copies not yet in a group.
    std::vector<std::vector<AsyncCopy>> copy_groups;
    std::vector<AsyncCopy> open_copies;
};

struct Kernel {
    const char *name;
    unsigned arity;
    // Each parameter's size in bytes.
    const unsigned *sizes;
    void (*thunk)(void **);
};

// One block's threads and barriers; launches are serialised by the caller.
struct Block {
    Fiber fibers[MAX_THREADS];
    unsigned n, current, done, at_block;
    unsigned at_warp[MAX_THREADS / WARP];
    // The shuffle a warp's waiting lanes make: its count and its line in the source.
    unsigned warp_shuffle[MAX_THREADS / WARP];
    unsigned warp_line[MAX_THREADS / WARP];
    uint32_t exchange[MAX_THREADS / WARP][2][WARP];
    const Kernel *kernel;
    void **args;
    // Odd blocks resume the lanes of the warp that just waited before other threads.
    bool warp_first;
    // cp.async copies land when a wait lets their group complete (else when issued).
    bool defer_copies;
    // The launch's dynamic shared memory: its last bytes before a guard page.
    unsigned char *shared;
    jmp_buf launcher;
    char error[512];
};

static Block block;

inline void *dynamic_shared() { return block.shared; }

[[noreturn]] inline void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(block.error, sizeof block.error, "block (%u, %u, %u), thread %u: ",
                     blockIdx.x, blockIdx.y, blockIdx.z, block.current);
    vsnprintf(block.error + n, sizeof block.error - n, fmt, ap);
    va_end(ap);
    _longjmp(block.launcher, 2);
}

// Runs the next ready thread after `after`, in order; back to the launcher when every thread
// has returned.
// The threads of warp `w` (fewer than 32 in a block's partial last warp).
inline unsigned lanes_of(unsigned w) {
    return block.n - w * WARP < WARP ? block.n - w * WARP : WARP;
}

[[noreturn]] inline void resume(unsigned i) {
    Fiber &f = block.fibers[i];
    block.current = i;
    if (!f.started) {
        f.started = true;
        setcontext(&f.context);
    }
    _longjmp(f.env, 1);
}

[[noreturn]] inline void run_next(unsigned after) {
    if (block.warp_first) {
        const unsigned first = after / WARP * WARP, lanes = lanes_of(after / WARP);
        for (unsigned k = 1; k <= lanes; ++k) {
            const unsigned i = first + (after - first + k) % lanes;
            if (block.fibers[i].state == READY) resume(i);
        }
    }
    for (unsigned k = 1; k <= block.n; ++k) {
        const unsigned i = (after + k) % block.n;
        if (block.fibers[i].state == READY) resume(i);
    }
    if (block.done == block.n) _longjmp(block.launcher, 1);
    fail("deadlock: %u threads wait at __syncthreads, %u returned, the rest wait at warp "
         "shuffles",
         block.at_block, block.done);
}

// The current thread waits: the others run until a barrier releases it.
inline void wait() {
    Fiber &f = block.fibers[block.current];
    if (_setjmp(f.env)) return;
    run_next(block.current);
}

// cp.async on the host (the kernels' host branches). In eager blocks a copy lands when it is
// issued, so an overwrite before every lane has read the old rows shows; in deferred blocks
// only when a wait lets its group complete, so a read before its wait shows. A copy still in
// flight at __syncthreads or when its thread returns is an error: the kernels wait for their
// copies before either.
inline void land(const AsyncCopy &c) {
    if (c.live) memcpy(c.dst, c.src, 16);
    else memset(c.dst, 0, 16);
}

inline void cp_async16(void *dst, const void *src, bool live) {
    const AsyncCopy c{dst, src, live};
    if (block.defer_copies) block.fibers[block.current].open_copies.push_back(c);
    else land(c);
}

// cp.async.commit_group: the copies issued since the last one become a group.
inline void cp_async_commit() {
    Fiber &f = block.fibers[block.current];
    if (!block.defer_copies) return;
    f.copy_groups.push_back(std::move(f.open_copies));
    f.open_copies.clear();
}

// cp.async.wait_group n: every group but the n latest completes.
inline void cp_async_wait_group(size_t n) {
    Fiber &f = block.fibers[block.current];
    while (f.copy_groups.size() > n) {
        for (const AsyncCopy &c : f.copy_groups.front()) land(c);
        f.copy_groups.erase(f.copy_groups.begin());
    }
}

inline void check_no_copies_in_flight(const char *where) {
    const Fiber &f = block.fibers[block.current];
    bool any = !f.open_copies.empty();
    for (const auto &g : f.copy_groups) any = any || !g.empty();
    if (any) fail("cp.async copies in flight %s", where);
}

inline void entry() {
    block.kernel->thunk(block.args);
    check_no_copies_in_flight("when the thread returned");
    block.fibers[block.current].state = DONE;
    ++block.done;
    if (block.at_block > 0) fail("returned while %u threads wait at __syncthreads", block.at_block);
    const unsigned w = block.current / WARP;
    if (block.at_warp[w] > 0) fail("returned while its warp waits at a shuffle");
    run_next(block.current);
}

// A warp's exchange of 4-byte values: each lane writes `v`, then reads lane `src`'s.
template <typename T>
T exchange(unsigned mask, T v, unsigned src, unsigned line) {
    static_assert(sizeof(T) == 4, "the emulated shuffles move 4-byte values");
    const unsigned me = block.current, w = me / WARP, lane = me % WARP;
    if (mask != 0xffffffffu || lanes_of(w) != WARP) fail("a full-mask shuffle needs a full warp");
    Fiber &f = block.fibers[me];
    const unsigned count = f.shuffles++;
    if (block.at_warp[w] == 0) {
        block.warp_shuffle[w] = count;
        block.warp_line[w] = line;
    } else if (block.warp_shuffle[w] != count || block.warp_line[w] != line) {
        fail("lanes out of step: lane %u makes shuffle %u (line %u) while its warp makes %u "
             "(line %u)",
             lane, count, line, block.warp_shuffle[w], block.warp_line[w]);
    }
    uint32_t *buf = block.exchange[w][count & 1];
    memcpy(&buf[lane], &v, 4);
    if (++block.at_warp[w] == WARP) {
        block.at_warp[w] = 0;
        for (unsigned i = w * WARP; i < (w + 1) * WARP; ++i)
            if (block.fibers[i].state == AT_WARP) block.fibers[i].state = READY;
    } else {
        f.state = AT_WARP;
        wait();
    }
    T r;
    memcpy(&r, &buf[src], 4);
    return r;
}

template <typename... A, size_t... I>
void call(void (*f)(A...), void **args, std::index_sequence<I...>) {
    f(*static_cast<A *>(args[I])...);
}

template <typename... A>
constexpr unsigned arity(void (*)(A...)) {
    return sizeof...(A);
}

template <typename... A>
struct ParamSizes {
    static constexpr unsigned value[sizeof...(A) + 1] = {(unsigned)sizeof(A)..., 0};
};

template <typename... A>
constexpr const unsigned *param_sizes(void (*)(A...)) {
    return ParamSizes<A...>::value;
}

template <typename... A>
void call(void (*f)(A...), void **args) {
    call(f, args, std::index_sequence_for<A...>{});
}

inline int refuse(char *err, size_t err_len, const char *what) {
    snprintf(err, err_len, "%s", what);
    return 1;
}

// Runs `name` from `kernels` over the grid, as cuLaunchKernel would (args: pointers to each
// argument). 0 on success, else 1 with the reason in `err`.
// Dynamic shared memory: 48 KiB and a guard page after it, mapped once.
inline unsigned char *shared_end() {
    static unsigned char *end = [] {
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        const size_t bytes = (SHARED_BYTES + page - 1) / page * page;
        unsigned char *base = (unsigned char *)mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE,
                                                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED) return (unsigned char *)nullptr;
        if (mprotect(base + bytes, page, PROT_NONE) != 0) return (unsigned char *)nullptr;
        return base + bytes;
    }();
    return end;
}

inline int launch(const Kernel *kernels, size_t count, const char *name, const unsigned *grid,
                  const unsigned *threads, size_t shared, void **args, const unsigned *arg_sizes,
                  unsigned n_args, char *err, size_t err_len) {
    const Kernel *kernel = nullptr;
    for (size_t i = 0; i < count; ++i)
        if (strcmp(kernels[i].name, name) == 0) kernel = &kernels[i];
    if (!kernel) return refuse(err, err_len, "no such kernel");
    if (kernel->arity != n_args) return refuse(err, err_len, "wrong number of arguments");
    for (unsigned i = 0; i < n_args; ++i)
        if (kernel->sizes[i] != arg_sizes[i]) {
            snprintf(err, err_len, "argument %u is %u bytes, the kernel takes %u", i,
                     arg_sizes[i], kernel->sizes[i]);
            return 1;
        }
    const uint64_t n = (uint64_t)threads[0] * threads[1] * threads[2];
    if (n == 0 || n > MAX_THREADS || threads[2] > 64)
        return refuse(err, err_len, "block size a GPU refuses (1..=1024 threads)");
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535 ||
        grid[0] > 0x7fffffffu)
        return refuse(err, err_len, "grid size a GPU refuses");
    if (shared > SHARED_BYTES) return refuse(err, err_len, "over 48 KiB of dynamic shared memory");
    if (!shared_end()) return refuse(err, err_len, "no guarded memory for shared memory");
    // 4-byte aligned (the kernels' float and int views), so the guard follows a share of
    // whole words at once.
    block.shared = shared_end() - (shared + 3) / 4 * 4;
    static unsigned launches = 0;
    const unsigned launch_parity = launches++ % 2;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), each = STACK_BYTES + page;
    char *stacks = (char *)mmap(nullptr, n * each, PROT_READ | PROT_WRITE,
                                MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stacks == MAP_FAILED) return refuse(err, err_len, "no memory for the threads' stacks");
    // A guard page under each stack: an overflow faults instead of corrupting a neighbour.
    for (uint64_t i = 0; i < n; ++i) mprotect(stacks + i * each, page, PROT_NONE);
    block.n = (unsigned)n;
    block.kernel = kernel;
    block.args = args;
    gridDim = {grid[0], grid[1], grid[2]};
    blockDim = {threads[0], threads[1], threads[2]};
    int status = 0;
    // Every other launch runs its blocks last to first, so that no kernel's result can rest
    // on an order of blocks a GPU does not promise.
    const auto in_turn = [&](unsigned i, unsigned n) { return launch_parity ? n - 1 - i : i; };
    for (unsigned z = 0; z < grid[2] && status == 0; ++z)
        for (unsigned y = 0; y < grid[1] && status == 0; ++y)
            for (unsigned x = 0; x < grid[0] && status == 0; ++x) {
                blockIdx = {in_turn(x, grid[0]), in_turn(y, grid[1]), in_turn(z, grid[2])};
                block.warp_first = (launch_parity + x + y + z) % 2 == 1;
                // The two schedules and the two ways copies land take turns independently.
                block.defer_copies = (launch_parity + x + y + z) / 2 % 2 == 1;
                memset(shared_end() - SHARED_BYTES, 0xff, SHARED_BYTES);
                block.done = block.at_block = 0;
                memset(block.at_warp, 0, sizeof block.at_warp);
                for (unsigned i = 0; i < block.n; ++i) {
                    Fiber &f = block.fibers[i];
                    f.tid = {i % threads[0], i / threads[0] % threads[1],
                             i / (threads[0] * threads[1])};
                    f.state = READY;
                    f.started = false;
                    f.shuffles = 0;
                    f.copy_groups.clear();
                    f.open_copies.clear();
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = stacks + i * each + page;
                    f.context.uc_stack.ss_size = STACK_BYTES;
                    f.context.uc_link = nullptr;
                    makecontext(&f.context, entry, 0);
                }
                if (_setjmp(block.launcher) == 0) run_next(block.n - 1);
                if (block.done != block.n) {
                    snprintf(err, err_len, "%s", block.error);
                    status = 1;
                }
            }
    munmap(stacks, n * each);
    return status;
}

}  // namespace emu

// __syncthreads, __syncwarp (a full warp's barrier, tracked as its shuffles are), and
// __shfl_sync, __shfl_xor_sync and __shfl_down_sync (width 32).
__device__ inline void __syncthreads() {
    using namespace emu;
    if (block.done > 0) fail("__syncthreads after %u threads returned", block.done);
    check_no_copies_in_flight("at __syncthreads");
    if (++block.at_block == block.n) {
        block.at_block = 0;
        for (unsigned i = 0; i < block.n; ++i)
            if (block.fibers[i].state == AT_BLOCK) block.fibers[i].state = READY;
        return;
    }
    block.fibers[block.current].state = AT_BLOCK;
    wait();
}

__device__ inline void __syncwarp(unsigned mask = 0xffffffffu,
                                  std::source_location at = std::source_location::current()) {
    emu::exchange(mask, 0u, emu::block.current % emu::WARP, at.line());
}

template <typename T>
__device__ T __shfl_xor_sync(unsigned mask, T v, int lane_mask,
                             std::source_location at = std::source_location::current()) {
    const unsigned lane = emu::block.current % emu::WARP;
    return emu::exchange(mask, v, (lane ^ (unsigned)lane_mask) % emu::WARP, at.line());
}

template <typename T>
__device__ T __shfl_sync(unsigned mask, T v, int src_lane,
                         std::source_location at = std::source_location::current()) {
    return emu::exchange(mask, v, (unsigned)src_lane % emu::WARP, at.line());
}

template <typename T>
__device__ T __shfl_down_sync(unsigned mask, T v, unsigned delta,
                              std::source_location at = std::source_location::current()) {
    const unsigned lane = emu::block.current % emu::WARP;
    return emu::exchange(mask, v, lane + delta < emu::WARP ? lane + delta : lane, at.line());
}

#define threadIdx (emu::block.fibers[emu::block.current].tid)

// Blocks run one at a time and a block's threads switch only where they wait, so a plain
// update is atomic and every write is visible to the next block: the fence has nothing to do.
__device__ inline unsigned int atomicAdd(unsigned int *address, unsigned int value) {
    const unsigned int old = *address;
    *address = old + value;
    return old;
}
__device__ inline void __threadfence() {}

// After the kernels: the table of `NAME`s and the entry point the tests call.
#define EMU_KERNEL(NAME) \
    {#NAME, emu::arity(NAME), emu::param_sizes(NAME), [](void **a) { emu::call(NAME, a); }}
#define EMU_ENTRY(TABLE)                                                                        \
    extern "C" __attribute__((visibility("default"))) int emu_launch(                          \
        const char *name, const unsigned *grid, const unsigned *threads, size_t shared,        \
        void **args, const unsigned *arg_sizes, unsigned n_args, char *err, size_t err_len) {  \
        return emu::launch(TABLE, sizeof TABLE / sizeof TABLE[0], name, grid, threads, shared, \
                           args, arg_sizes, n_args, err, err_len);                             \
    }
