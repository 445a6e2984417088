//! When to hand work to rayon's pool. A caller outside the pool (the engine's worker, the
//! learner's backward thread) that hands a job to a pool of one thread only adds a
//! cross-thread round trip per call; with one thread, work runs on the caller.

/// Whether rayon's pool has more than one thread (`threads` / `RAYON_NUM_THREADS`).
pub fn multi_threaded() -> bool {
    rayon::current_num_threads() > 1
}
