//! The C allocator's footprint in the long-running commands (`agent`, `top`).

/// At most two glibc malloc arenas, set before any thread starts. By default glibc gives
/// threads up to 8 arenas per core; a long-running command's few threads (the agent's
/// sampler, HTTP and notifications; `top`'s collector and screen) then each keep freed pages
/// in an arena of their own, and a soak showed RSS creeping up while the heap in use stayed
/// flat. Fewer arenas cost nothing here: the threads rarely allocate at the same time.
pub fn limit_malloc_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter; called before threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}

/// Hands the allocator's free pages back to the kernel after a collection that allocated
/// much (a full scan reads every process's fd list): freed chunks scattered through the heap
/// otherwise keep their pages resident.
pub fn return_free_pages() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases memory the allocator holds and no one uses.
    unsafe {
        libc::malloc_trim(0);
    }
}
