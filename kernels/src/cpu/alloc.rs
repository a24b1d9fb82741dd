//! The C allocator's settings for tensor work (glibc only).
//!
//! A training step, a calibration layer or an eval chunk allocates and frees the same few
//! hundred buffers of 0.1–32 MB again and again. glibc's defaults give each one back to the
//! kernel as it is freed (a buffer over the adaptive `mmap` threshold is its own mapping; the
//! heap's free top is trimmed past twice that threshold), so the next allocation of the same
//! size faults every page in again and the kernel zeroes it first. [`keep_freed_memory`] fixes
//! the mmap threshold at 32 MiB (the most glibc's adaptive threshold ever rises to on 64-bit,
//! `DEFAULT_MMAP_THRESHOLD_MAX`) and turns trimming off, so buffers up to 32 MiB are reused
//! from the heap. Larger ones stay their own mappings and are given back, so the peak resident
//! memory is what is live plus the heap's fragmentation
//! (BENCHMARKS.md: the small demo model's SFT step 12 % faster, the 254M model's peak
//! within 1 %).
//!
//! A user's own choice wins: with `GLIBC_TUNABLES` naming a `glibc.malloc.` setting, or
//! `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` set, nothing is changed.

/// The mmap threshold set: the ceiling of glibc's adaptive one (`DEFAULT_MMAP_THRESHOLD_MAX`,
/// 32 MiB on 64-bit).
pub const MMAP_THRESHOLD: i32 = 32 << 20;
/// The trim threshold set: the largest `mallopt` takes, so the heap's top is kept.
pub const TRIM_THRESHOLD: i32 = i32::MAX;

/// What [`keep_freed_memory`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocSettings {
    /// Both thresholds set.
    Applied,
    /// Left alone: the user set the named environment variable.
    UserSet(&'static str),
    /// Left alone: not a glibc target.
    Unsupported,
    /// glibc refused a value (`mallopt` returned 0).
    Refused(&'static str),
}

/// Which user setting, if any, leaves the allocator alone: `GLIBC_TUNABLES` naming a
/// `glibc.malloc.` tunable, or glibc's older `MALLOC_*_` variables.
pub fn user_setting(
    tunables: Option<&str>,
    mmap_env: bool,
    trim_env: bool,
) -> Option<&'static str> {
    if tunables.is_some_and(|t| t.contains("glibc.malloc.")) {
        Some("GLIBC_TUNABLES")
    } else if mmap_env {
        Some("MALLOC_MMAP_THRESHOLD_")
    } else if trim_env {
        Some("MALLOC_TRIM_THRESHOLD_")
    } else {
        None
    }
}

/// Sets glibc's mmap threshold to [`MMAP_THRESHOLD`] and its trim threshold to
/// [`TRIM_THRESHOLD`] for this process, unless the user set either (see the module docs).
/// Call it once, early; it is safe to call at any time and from any thread.
pub fn keep_freed_memory() -> AllocSettings {
    let tunables = std::env::var("GLIBC_TUNABLES").ok();
    if let Some(name) = user_setting(
        tunables.as_deref(),
        std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some(),
        std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some(),
    ) {
        return AllocSettings::UserSet(name);
    }
    set_thresholds()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> AllocSettings {
    // SAFETY: `mallopt` only changes the allocator's parameters, under glibc's own arena lock;
    // it takes no pointers and may be called at any time from any thread.
    if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) } == 0 {
        return AllocSettings::Refused("M_MMAP_THRESHOLD");
    }
    // SAFETY: as above.
    if unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) } == 0 {
        return AllocSettings::Refused("M_TRIM_THRESHOLD");
    }
    AllocSettings::Applied
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> AllocSettings {
    AllocSettings::Unsupported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_malloc_setting_wins() {
        assert_eq!(user_setting(None, false, false), None);
        assert_eq!(
            user_setting(Some("glibc.cpu.hwcaps=-AVX2"), false, false),
            None
        );
        assert_eq!(
            user_setting(Some("glibc.malloc.arena_max=2"), false, false),
            Some("GLIBC_TUNABLES")
        );
        assert_eq!(
            user_setting(None, true, false),
            Some("MALLOC_MMAP_THRESHOLD_")
        );
        assert_eq!(
            user_setting(None, false, true),
            Some("MALLOC_TRIM_THRESHOLD_")
        );
    }
}
