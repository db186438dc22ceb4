// The CPU kernels' own thread pool: parallel loops that never wait for a thread that has not arrived.
//
// OpenMP's parallel regions (torch's at::parallel_for) end at a barrier that every thread of the team must
// reach. When another process takes a core for a moment, the thread it preempted holds every region's
// barrier until it runs again, and the other thread spins idle meanwhile: beside a busy loop taking half
// of one of two cores, the engine lost 37% of its tokens/s (BENCHMARKS, "The engine beside a busy loop").
// Here the calling thread publishes a loop as chunks in one contiguous run per thread, then claims chunks
// itself: its own run first, then whatever the others have left. A worker that is awake claims the same
// way; one that is asleep or preempted claims nothing, and the caller waits only for chunks a worker has
// already claimed, never for a worker to turn up. So a preempted worker costs the chunk it holds, not the
// loop. Workers spin a short while between loops (a step's loops follow each other within microseconds),
// then sleep on a condition variable; the caller wakes sleepers only when there are any.
//
// Each run's state is one 64-bit word, [tag:24 | end:20 | next:20], claimed by compare-and-swap. A claim
// that succeeds owns chunk `next` of the loop that word belongs to; that loop cannot finish before the
// claimed chunk is done, so its body pointer stays valid. Words of finished loops are exhausted
// (next == end), so a late worker claims nothing from them.
#pragma once
#include <ATen/Parallel.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MB_PAUSE() _mm_pause()
#else
#define MB_PAUSE() std::this_thread::yield()
#endif

namespace mb {

class Pool {
 public:
  static constexpr int64_t kMaxThreads = 64;
  static constexpr int64_t kMaxChunks = (1 << 20) - 1;

  static Pool& instance() {
    static Pool pool;
    if (pool.pid_ != getpid()) pool.reset_after_fork();
    return pool;
  }

  // Runs body(c) for every c in [0, chunks) on this thread and the pool's workers; returns when all are done.
  // Serial when one thread is asked for (at::get_num_threads()), inside a chunk, or while another thread
  // runs a loop on the pool.
  template <typename F>
  void run(int64_t chunks, const F& body) {
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), kMaxThreads);
    std::unique_lock<std::mutex> mine(run_mutex_, std::try_to_lock);
    if (chunks <= 1 || threads <= 1 || in_chunk_ || !mine.owns_lock()) {
      for (int64_t c = 0; c < chunks; ++c) body(c);
      return;
    }
    if (threads != size_) resize(threads);
    call_ = [](const void* ctx, int64_t c) { (*static_cast<const F*>(ctx))(c); };
    ctx_ = &body;
    done_.store(0, std::memory_order_relaxed);
    const uint64_t tag = (++loops_) & 0xFFFFFF;
    for (int64_t w = 0; w < size_; ++w) {
      const uint64_t begin = chunks * w / size_, end = chunks * (w + 1) / size_;
      words_[w].store(tag << 40 | end << 20 | begin, std::memory_order_release);
    }
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    claim(0);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 4096) {
        MB_PAUSE();
      } else {
        std::this_thread::yield();  // a worker holds a chunk but lost its core: let it have this one
      }
    }
  }

 private:
  Pool() : pid_(getpid()) {}
  ~Pool() { stop_workers(); }

  // Claim and run chunks: run `first`'s own first, then the others'.
  void claim(int64_t first) {
    in_chunk_ = true;
    for (int64_t k = 0; k < size_; ++k) {
      std::atomic<uint64_t>& word = words_[(first + k) % size_];
      uint64_t v = word.load(std::memory_order_acquire);
      while ((v & 0xFFFFF) < ((v >> 20) & 0xFFFFF)) {
        if (word.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
          call_(ctx_, static_cast<int64_t>(v & 0xFFFFF));
          done_.fetch_add(1, std::memory_order_release);
          v = word.load(std::memory_order_acquire);
        }
      }
    }
    in_chunk_ = false;
  }

  void worker(int64_t index) {
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    while (true) {
      int spins = 0;
      while (epoch_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed)) {
        if (++spins < kSpins) {
          MB_PAUSE();
          continue;
        }
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return epoch_.load(std::memory_order_seq_cst) != seen || stop_.load(); });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        break;
      }
      if (stop_.load()) return;
      seen = epoch_.load(std::memory_order_acquire);
      claim(index);
    }
  }

  void resize(int64_t threads) {
    stop_workers();
    size_ = threads;
    for (int64_t w = 0; w < kMaxThreads; ++w) words_[w].store(0, std::memory_order_relaxed);
    stop_.store(false);
    for (int64_t w = 1; w < size_; ++w) workers_.emplace_back([this, w] { worker(w); });
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      stop_.store(true);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
    workers_.clear();
    size_ = 1;
  }

  // A forked child has none of the parent's threads: start over (the parent's are not ours to join).
  void reset_after_fork() {
    for (auto& t : workers_) t.detach();
    workers_.clear();
    new (&run_mutex_) std::mutex();
    new (&sleep_mutex_) std::mutex();
    new (&wake_) std::condition_variable();
    sleepers_.store(0);
    size_ = 1;
    pid_ = getpid();
  }

  // About 20-60 us of spinning between loops before a worker sleeps: the gaps inside a step are shorter.
  static constexpr int kSpins = 2000;
  static inline thread_local bool in_chunk_ = false;

  pid_t pid_;
  int64_t size_ = 1;
  uint64_t loops_ = 0;
  void (*call_)(const void*, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  std::atomic<uint64_t> words_[kMaxThreads] = {};
  std::atomic<int64_t> done_{0};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> stop_{false};
  std::mutex run_mutex_, sleep_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> workers_;
};

// at::parallel_for's shape on the pool: fn(begin, end) over [begin, end) in pieces of at least `grain`,
// about four pieces a thread so that a late thread's share is taken by the others.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t piece = std::max<int64_t>(std::max<int64_t>(grain, 1), (n + 4 * threads - 1) / (4 * threads));
  piece = std::max(piece, (n + Pool::kMaxChunks - 1) / Pool::kMaxChunks);
  const int64_t chunks = (n + piece - 1) / piece;
  Pool::instance().run(chunks, [&](int64_t c) { fn(begin + c * piece, std::min(end, begin + (c + 1) * piece)); });
}

}  // namespace mb
