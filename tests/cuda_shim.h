// CUDA on the CPU, for tests: the definitions a rawkernels/*.cu source needs to build with g++, and a
// launcher that runs a grid the way the GPU would, block after block, the threads of a block as
// cooperative fibers (ucontext) that meet at every __syncthreads.
//
// A block starts with thread 0 on a fiber. If it finishes without reaching a barrier, the other threads
// run one after another on the launcher's own stack (a grid-stride kernel pays almost nothing); a
// barrier reached by one of them is then an error, since thread 0 never reached it. If thread 0 waits
// at a barrier, every thread gets a fiber and they run in rounds: each runs to its next barrier or to
// its end, and a round must leave all of them at the same barrier (the same source line) or all done.
// Anything else (some threads done while others wait, threads at different barriers) is reported as
// an error of the launch: on a GPU it would hang or corrupt shared memory.
//
// A fiber starts through makecontext/swapcontext; every later switch is a _setjmp/_longjmp pair, which
// unlike swapcontext makes no system call (a barrier round costs nanoseconds per thread, not a
// microsecond).
//
// `__shared__` variables are function statics: one copy, shared by the threads of the running block and
// reused by the next block, which is what blocks that run one after another need.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct dim3 {
  unsigned int x, y, z;
};
inline dim3 threadIdx, blockIdx, blockDim, gridDim;
inline constexpr int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)

namespace shim {

enum State { READY, WAITING, DONE };

struct Fiber {
  ucontext_t context;  // for the first entry only
  jmp_buf resume_point;
  bool started;
  State state;
  dim3 index;
  int barrier_line;
  char* stack;
};

constexpr size_t STACK_BYTES = 128 * 1024;
inline ucontext_t launcher_context;
inline jmp_buf launcher;
inline std::vector<Fiber> fibers;
inline int running = -1;  // the fiber running now; -1: a thread run on the launcher's stack
inline const std::function<void()>* thread_body = nullptr;
inline char error_text[1024];

inline void fail(const char* format, ...) {
  if (error_text[0]) return;  // keep the first error
  va_list args;
  va_start(args, format);
  vsnprintf(error_text, sizeof error_text, format, args);
  va_end(args);
}

inline void barrier(int line) {
  if (running < 0) {
    fail("thread (%u, %u, %u) of block (%u, %u, %u) reached the __syncthreads of line %d, which thread 0 "
         "of its block finished without reaching",
         threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z, line);
    return;
  }
  Fiber& fiber = fibers[running];
  fiber.state = WAITING;
  fiber.barrier_line = line;
  if (!_setjmp(fiber.resume_point)) _longjmp(launcher, 1);
}

inline void fiber_main() {
  (*thread_body)();
  fibers[running].state = DONE;
  _longjmp(launcher, 1);  // never returns: the launcher resumes
}

inline dim3 thread_index(unsigned t) {
  return {t % blockDim.x, (t / blockDim.x) % blockDim.y, t / (blockDim.x * blockDim.y)};
}

inline void start(unsigned t) {
  Fiber& fiber = fibers[t];
  if (fiber.stack == nullptr) fiber.stack = static_cast<char*>(std::malloc(STACK_BYTES));
  getcontext(&fiber.context);
  fiber.context.uc_stack.ss_sp = fiber.stack;
  fiber.context.uc_stack.ss_size = STACK_BYTES;
  fiber.context.uc_link = nullptr;
  makecontext(&fiber.context, fiber_main, 0);
  fiber.started = false;
  fiber.state = READY;
  fiber.index = thread_index(t);
  fiber.barrier_line = 0;
}

inline void resume(unsigned t) {
  threadIdx = fibers[t].index;
  running = static_cast<int>(t);
  if (!_setjmp(launcher)) {
    Fiber& fiber = fibers[t];
    if (fiber.started) _longjmp(fiber.resume_point, 1);
    fiber.started = true;
    swapcontext(&launcher_context, &fiber.context);
  }
  running = -1;
}

// Runs the threads of the current block; false after an error.
inline bool run_block(unsigned threads) {
  if (fibers.size() < threads) fibers.resize(threads, Fiber{});
  start(0);
  resume(0);
  if (fibers[0].state == DONE) {
    for (unsigned t = 1; t < threads && !error_text[0]; ++t) {
      threadIdx = thread_index(t);
      (*thread_body)();
    }
    return !error_text[0];
  }
  for (unsigned t = 1; t < threads; ++t) {
    start(t);
    resume(t);
  }
  while (true) {
    unsigned waiting = 0, done = 0;
    int line = fibers[0].barrier_line;
    bool same = true;
    for (unsigned t = 0; t < threads; ++t) {
      if (fibers[t].state == DONE) {
        ++done;
      } else {
        ++waiting;
        same = same && fibers[t].barrier_line == fibers[0].barrier_line;
        line = fibers[t].barrier_line;
      }
    }
    if (done == threads) return !error_text[0];
    if (done > 0) {
      fail("block (%u, %u, %u): %u of its %u threads finished while the others wait at the __syncthreads of "
           "line %d (a barrier that not every thread of the block reaches)",
           blockIdx.x, blockIdx.y, blockIdx.z, done, threads, line);
      return false;
    }
    if (!same) {
      fail("block (%u, %u, %u): its threads wait at different __syncthreads (lines %d and %d)", blockIdx.x,
           blockIdx.y, blockIdx.z, fibers[0].barrier_line, line);
      return false;
    }
    for (unsigned t = 0; t < threads; ++t) {
      fibers[t].state = READY;
      resume(t);
    }
  }
}

// Runs `body` for every thread of the grid; returns 0, or 1 with error_text set.
inline int run_grid(dim3 grid, dim3 block, const std::function<void()>& body) {
  error_text[0] = 0;
  gridDim = grid;
  blockDim = block;
  thread_body = &body;
  const unsigned threads = block.x * block.y * block.z;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = {x, y, z};
        if (!run_block(threads)) return 1;
      }
  return 0;
}

// --- kernels called with CuPy's convention: an array of pointers to the argument values --------------
template <typename T>
void describe(std::string& out) {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_pointer_v<U>) {
    using P = std::remove_cv_t<std::remove_pointer_t<U>>;
    out += "p";
    if constexpr (std::is_void_v<P>) {
      out += "v0";
    } else {
      describe<P>(out);
      out.pop_back();  // the pointee's separator
    }
  } else if constexpr (std::is_same_v<U, bool>) {
    out += "b" + std::to_string(sizeof(U));
  } else if constexpr (std::is_floating_point_v<U>) {
    out += "f" + std::to_string(sizeof(U));
  } else if constexpr (std::is_integral_v<U>) {
    out += (std::is_signed_v<U> ? "i" : "u") + std::to_string(sizeof(U));
  } else {
    out += "s" + std::to_string(sizeof(U));
  }
  out += ",";
}

// The parameters of a kernel, e.g. "pi8,i8,i8," for (const long long*, long long, long long).
template <typename... A>
std::string signature(void (*)(A...)) {
  std::string out;
  (describe<A>(out), ...);
  return out;
}

template <typename... A, size_t... I>
void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A>
int launch(void (*kernel)(A...), const unsigned* grid, const unsigned* block, void** args) {
  const std::function<void()> body = [&] { call(kernel, args, std::index_sequence_for<A...>{}); };
  return run_grid({grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]}, body);
}

}  // namespace shim

#define __syncthreads() shim::barrier(__LINE__)

// A launch from tests/cuda_on_cpu.py's C wrappers: the variadic argument is the kernel call.
#define SHIM_LAUNCH(grid, block, ...)                                                       \
  do {                                                                                      \
    const std::function<void()> body_ = [&] { __VA_ARGS__; };                               \
    const unsigned grid_ = (unsigned)(grid), block_ = (unsigned)(block);                    \
    if (shim::run_grid({grid_, 1u, 1u}, {block_, 1u, 1u}, body_)) {                         \
      std::fprintf(stderr, "cuda_shim: %s\n", shim::error_text);                            \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)
