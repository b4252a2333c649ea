/* A barrier for the thread team of one OpenMP parallel region, where libgomp's costs more than the phase it ends.

   Why: a one-sequence decode step (decode_step.c) meets at a barrier five times a layer, 150 times a step for
   SmolLM2, and on a 2-core VM libgomp's barrier took 440-490 ns a crossing against 170 ns for this one (both
   threads arriving together, a loop of 200,000 crossings); the one-sequence step ran 1.003-1.009x faster with
   it (alternated in one engine). It counts arrivals on one atomic and releases the team
   by bumping a generation number that the others spin on (acquire / release: every write before a member's
   arrival is visible to every member after the release). A member that has spun for about 2^16 pauses without
   a release yields the CPU each further round, so a descheduled partner (more runnable threads than cores) is
   not starved by a spinning one.

   The barrier lives in the region's shared scope, initialised (team_barrier_init) before the region, and every
   member passes the team's size; members must cross the same barriers in the same order, as with omp barrier. */
#ifndef INFERQ_TEAM_H
#define INFERQ_TEAM_H

#include <immintrin.h>
#include <sched.h>
#include <stdatomic.h>

typedef struct {
    _Atomic int arrived;
    _Atomic int generation;
} team_barrier;

static inline void team_barrier_init(team_barrier* b) {
    atomic_init(&b->arrived, 0);
    atomic_init(&b->generation, 0);
}

static inline void team_barrier_wait(team_barrier* b, int members) {
    const int gen = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == members - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed); /* ordered before the release below */
        atomic_store_explicit(&b->generation, gen + 1, memory_order_release);
        return;
    }
    for (unsigned spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == gen; spins++) {
        if (spins < (1u << 16))
            _mm_pause();
        else
            sched_yield();
    }
}

#endif
