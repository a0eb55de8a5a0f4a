/* A workgroup's threads as host threads: the GPU primitives of gpu.h for a host build of a kernel
 * body (KG_HOST_SIMT), so that a host test runs the very body the GPU objects are built from.
 *
 * Tests only (tests/test_gdn.py builds kernels/gdn/gdn_host.cc with it); no part of any object.
 * One workgroup runs at a time: its N threads are std::threads, the body's shared storage is
 * static (so one workgroup's), KG_BARRIER a std::barrier, and KG_SHFL writes the value to a slot
 * of the thread and reads the lane's slot of its 32-thread warp between two barriers (so every
 * thread of the workgroup must reach each KG_SHFL, as every thread of a warp must on the GPU).
 * Floating point is the host's IEEE single precision; build with -ffp-contract=off as the GPU
 * objects are. What a host run cannot catch: a read of shared storage before any write (the statics
 * hold the previous workgroup's values where a GPU's are undefined), and a KG_SHFL reached by part of
 * a warp (here it waits on the whole workgroup: a hang, not a wrong value). So the host run checks a
 * body's arithmetic and order, and bench/gdn_check.py checks the GPU's bits.
 */
#ifndef DFLASH_KERNELS_SIMT_HOST_H
#define DFLASH_KERNELS_SIMT_HOST_H

#include <barrier>
#include <functional>
#include <thread>
#include <vector>

#define KG_HOST_SIMT 1

static thread_local int kg_host_tid_;
static std::barrier<>* kg_host_bar_;
static float kg_host_lanes_[1024];

static inline int kg_host_tid() { return kg_host_tid_; }
static inline void kg_host_barrier() { kg_host_bar_->arrive_and_wait(); }
static inline float kg_host_shfl(float v, int lane) {
  kg_host_lanes_[kg_host_tid_] = v;
  kg_host_bar_->arrive_and_wait();
  const float r = kg_host_lanes_[(kg_host_tid_ & ~31) + (lane & 31)];  /* both GPU forms wrap the lane */
  kg_host_bar_->arrive_and_wait();
  return r;
}

/* Runs body(tid) on `threads` host threads, one workgroup. */
static inline void kg_host_workgroup(int threads, const std::function<void(int)>& body) {
  std::barrier<> bar(threads);
  kg_host_bar_ = &bar;
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      kg_host_tid_ = t;
      body(t);
    });
  for (auto& th : pool) th.join();
}

#include "gpu.h"

#endif
