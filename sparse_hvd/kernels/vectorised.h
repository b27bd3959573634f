// SPARSE_HVD_VECTORISED: a function compiled twice, for the x86-64 baseline (SSE2) and for
// AVX2, the one the CPU has chosen once when the library loads (GCC's function
// multi-versioning, ``target_clones``). The library is built where it is first used, which
// may be a login node whose CPU is newer than the compute nodes' (a cache directory shared
// over the network), so the whole library cannot take ``-march``: an instruction the node
// lacks would kill the job.
//
// Both versions give the same bits: the build turns off contraction into fused
// multiply-adds (``-ffp-contract=off``; the AVX2 clone does not enable FMA anyway), and
// without ``-ffast-math`` the compiler keeps every floating-point reduction in source order, so
// a vectorised loop only does, lane by lane, the IEEE operations the scalar loop does. Ranks
// on different CPUs therefore compute identical averages: replicas stay identical.

#ifndef SPARSE_HVD_KERNELS_VECTORISED_H_
#define SPARSE_HVD_KERNELS_VECTORISED_H_

// (-DSPARSE_HVD_BASELINE_ONLY builds the baseline alone: to compare the two versions' bits.)
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(SPARSE_HVD_BASELINE_ONLY)
#define SPARSE_HVD_VECTORISED __attribute__((target_clones("avx2", "default")))
#else
#define SPARSE_HVD_VECTORISED
#endif

// An inner step of a SPARSE_HVD_VECTORISED loop: inlined into each version, so that it is
// compiled for that version's instructions.
#if defined(__GNUC__)
#define SPARSE_HVD_INLINE inline __attribute__((always_inline))
#else
#define SPARSE_HVD_INLINE inline
#endif

// The sum of eight lanes of partial sums (entry i of a loop in lane i % 8), added in one fixed
// order, so that every compiled version, and every kernel that sums this way, gives the same
// bits for the same entries.
SPARSE_HVD_INLINE double SumOfEightLanes(const double (&lanes)[8]) {
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

#endif  // SPARSE_HVD_KERNELS_VECTORISED_H_
