/* How the threads of a kernel share a linear's row groups: runs.
 *
 * Each thread owns a contiguous run of the groups (1/T of the weight, one stream from
 * memory), takes it from the front a group at a time, and when it is done takes groups
 * from the back of the others' runs, so that a vCPU that runs slower (a busy host) does
 * fewer instead of holding the other at the next barrier. Taking groups from one shared
 * counter a few at a time (OpenMP's dynamic schedule) balanced as well but interleaved
 * the threads' reads across the weight: at batch 1 on the 2-core Zen 4, whole fused
 * decode steps took 5.3-5.7 ms that way against 4.0-4.8 ms with owned runs (o_proj alone
 * 0.38 -> 0.20 ms a step, gate_up 1.15 -> 0.85-1.15 ms).
 *
 * A run is one 64-bit word, front << 32 | back (the groups front..back still to take),
 * on its own cache line (RUN_STRIDE words), all empty (zero) to begin with; a thread
 * stores its run's word when it starts on a linear. That store races with nothing: after
 * a linear every run is empty, and a thread takes from a run only while it is not, so the
 * others find the old word empty or the new one whole. Every group is computed exactly
 * once, by whoever takes it, with the same arithmetic: the same bits as any split. */
#ifndef TOKENMILL_RUNS_H
#define TOKENMILL_RUNS_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RUN_STRIDE 8 /* uint64 words: a run a cache line */

/* the bytes of `threads` runs (a buffer that holds them: 64-byte aligned) */
static inline size_t runs_bytes(int64_t threads) {
    return (size_t)threads * RUN_STRIDE * sizeof(uint64_t);
}

/* `threads` runs, all empty, in a buffer of their own (free() it); NULL without memory */
static inline uint64_t *runs_new(int64_t threads) {
    uint64_t *runs = aligned_alloc(64, runs_bytes(threads));
    if (runs) memset(runs, 0, runs_bytes(threads));
    return runs;
}

static inline int64_t take_front(uint64_t *run) {
    uint64_t cur = __atomic_load_n(run, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = cur >> 32, back = cur & 0xffffffffu;
        if (front >= back) return -1;
        if (__atomic_compare_exchange_n(run, &cur, (front + 1) << 32 | back, 1,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int64_t)front;
    }
}

static inline int64_t take_back(uint64_t *run) {
    uint64_t cur = __atomic_load_n(run, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = cur >> 32, back = cur & 0xffffffffu;
        if (front >= back) return -1;
        if (__atomic_compare_exchange_n(run, &cur, front << 32 | (back - 1), 1,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int64_t)(back - 1);
    }
}

/* thread tid's run of `groups` (of nth threads) into runs[tid]: call before its first
 * next_group on this linear */
static inline void own_run(uint64_t *runs, int64_t groups, int tid, int nth) {
    const uint64_t front = (uint64_t)(groups * tid / nth), back = (uint64_t)(groups * (tid + 1) / nth);
    __atomic_store_n(runs + tid * RUN_STRIDE, front << 32 | back, __ATOMIC_RELAXED);
}

/* the next group thread tid computes, or -1 when every run is empty; *from starts at 0
 * (its own run) and counts the runs it has emptied */
static inline int64_t next_group(uint64_t *runs, int tid, int nth, int *from) {
    for (;;) {
        if (*from >= nth) return -1;
        const int64_t g = *from == 0 ? take_front(runs + tid * RUN_STRIDE)
                                     : take_back(runs + ((tid + *from) % nth) * RUN_STRIDE);
        if (g >= 0) return g;
        (*from)++;
    }
}
#endif
