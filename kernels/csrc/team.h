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
#include <stdlib.h>

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

/* Scratch for the work a team shares inside one parallel region, kept across the region's calls (the fused
   step's thirty attention calls a token) so that none allocates: one buffer every member reads, grown by member
   0 before a barrier, and one buffer per member. Initialised before the region for up to `members` threads
   (omp_get_max_threads()), freed after it; `bar` is the team's barrier. */
typedef struct {
    team_barrier* bar;
    int members;
    int failed; /* member 0 could not grow `shared`: written before a barrier, read after it */
    float* shared;
    size_t shared_cap;
    float** own;
    size_t* own_cap;
} team_scratch;

/* 0, or -1 where the per-member tables could not be allocated */
static inline int team_scratch_init(team_scratch* t, team_barrier* bar, int members) {
    t->bar = bar;
    t->members = members;
    t->failed = 0;
    t->shared = NULL;
    t->shared_cap = 0;
    t->own = (float**)calloc((size_t)members, sizeof(float*));
    t->own_cap = (size_t*)calloc((size_t)members, sizeof(size_t));
    return t->own && t->own_cap ? 0 : -1;
}

/* *buf with room for `need` floats (grown, contents not kept), or NULL where memory ran out */
static inline float* team_scratch_grow(float** buf, size_t* cap, size_t need) {
    if (need > *cap) {
        free(*buf);
        *buf = (float*)malloc(sizeof(float) * need);
        *cap = *buf ? need : 0;
    }
    return *buf;
}

static inline void team_scratch_free(team_scratch* t) {
    for (int i = 0; t->own && i < t->members; i++) free(t->own[i]);
    free(t->own);
    free(t->own_cap);
    free(t->shared);
}

#endif
