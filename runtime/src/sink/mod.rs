//! Where an export's output goes: a folder built beside the target and renamed into place
//! only when everything is written, and the safetensors shards streamed into it.
//!
//! A failure (or a dropped [`OutputDir`]) removes the temporary folder, so a partial
//! checkpoint never appears at the target; an existing target is replaced only with `force`.

mod shards;

pub use shards::{ShardWriter, WrittenShards};

use std::fs;
use std::path::{Path, PathBuf};

/// An error writing the output.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// A file or folder could not be written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The target exists and `force` was not given.
    #[error("{} already exists (pass --force to replace it)", path.display())]
    Exists {
        /// The file or folder.
        path: PathBuf,
    },
    /// The same tensor name was written twice.
    #[error("tensor `{0}` was written twice")]
    DuplicateTensor(String),
    /// A tensor's bytes disagree with its dtype and shape.
    #[error("tensor `{name}`: {got} bytes, but shape {shape:?} of {dtype:?} needs {expected}")]
    TensorSize {
        /// The tensor's name.
        name: String,
        /// The element type.
        dtype: safetensors::Dtype,
        /// The shape.
        shape: Vec<usize>,
        /// Bytes given.
        got: usize,
        /// Bytes the shape needs.
        expected: usize,
    },
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SinkError + '_ {
    move |source| SinkError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A folder being written beside its target; [`OutputDir::commit`] moves it into place.
#[derive(Debug)]
pub struct OutputDir {
    target: PathBuf,
    temp: PathBuf,
    force: bool,
    committed: bool,
}

impl OutputDir {
    /// Starts writing `target`: refuses an existing target unless `force`, and creates an
    /// empty temporary folder next to it (same filesystem, so the final rename is atomic).
    ///
    /// Folders an earlier, killed run left beside the target are cleared first (see
    /// [`sweep_stale`]).
    pub fn create(target: impl AsRef<Path>, force: bool) -> Result<Self, SinkError> {
        let target = target.as_ref().to_path_buf();
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let parent = target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if parent.is_dir() {
            sweep_stale(parent, &name, &target)?;
        }
        if target.exists() && !force {
            return Err(SinkError::Exists { path: target });
        }
        fs::create_dir_all(parent).map_err(io(parent))?;
        let temp = parent.join(format!("{}{}", partial_prefix(&name), std::process::id()));
        if temp.exists() {
            fs::remove_dir_all(&temp).map_err(io(&temp))?;
        }
        fs::create_dir(&temp).map_err(io(&temp))?;
        Ok(OutputDir {
            target,
            temp,
            force,
            committed: false,
        })
    }

    /// The temporary folder files are written into.
    pub fn path(&self) -> &Path {
        &self.temp
    }

    /// The final location.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Syncs every file and moves the folder into place (replacing the target with `force`).
    pub fn commit(self) -> Result<PathBuf, SinkError> {
        self.commit_with(&RealFs)
    }

    fn commit_with(mut self, ops: &dyn DirOps) -> Result<PathBuf, SinkError> {
        sync_files(&self.temp)?;
        if self.target.exists() && !self.force {
            return Err(SinkError::Exists {
                path: self.target.clone(),
            });
        }
        install(&self.temp, &self.target, ops)?;
        self.committed = true;
        Ok(self.target.clone())
    }
}

impl Drop for OutputDir {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: a failed export must not leave a partial folder behind.
            let _ = fs::remove_dir_all(&self.temp);
        }
    }
}

/// `.{name}.kiln-partial-`: the temporary folders of `name` begin so, followed by the writing
/// process's id (and `.old` for a replaced target on its way out).
fn partial_prefix(name: &str) -> String {
    format!(".{name}.kiln-partial-")
}

/// Whether process `pid` is running; `None` where this platform cannot tell.
fn alive(pid: u32) -> Option<bool> {
    if cfg!(target_os = "linux") {
        Some(Path::new("/proc").join(pid.to_string()).exists())
    } else {
        None
    }
}

/// Clears what a killed run left beside `target` (`name` is its file name): the temporary
/// folders of processes no longer running are removed, and a replaced target that a run killed
/// between its two renames left as `….old` (platforms without an atomic exchange) is put back
/// when the target is missing. Folders of running processes, and everything on platforms where
/// liveness cannot be told, are left alone.
pub fn sweep_stale(parent: &Path, name: &str, target: &Path) -> Result<(), SinkError> {
    let prefix = partial_prefix(name);
    let Ok(entries) = fs::read_dir(parent) else {
        return Ok(());
    };
    let mut stale = Vec::new();
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix(&prefix) else {
            continue;
        };
        let (pid, old) = match rest.strip_suffix(".old") {
            Some(p) => (p, true),
            None => (rest, false),
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        if pid == std::process::id() || alive(pid) != Some(false) {
            continue;
        }
        stale.push((e.path(), old));
    }
    // Put a stranded old target back before anything is deleted.
    for (path, old) in &stale {
        if *old && !target.exists() {
            fs::rename(path, target).map_err(io(target))?;
        }
    }
    for (path, _) in stale {
        if path.exists() {
            remove(&path)?;
        }
    }
    Ok(())
}

fn remove(path: &Path) -> Result<(), SinkError> {
    if path.is_dir() {
        fs::remove_dir_all(path).map_err(io(path))
    } else {
        fs::remove_file(path).map_err(io(path))
    }
}

/// Flushes every file directly in `dir` to the disk.
pub(crate) fn sync_files(dir: &Path) -> Result<(), SinkError> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.is_file() {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(io(&path))?;
        }
    }
    Ok(())
}

/// The renames that move a finished folder into place; tests substitute failing ones.
pub(crate) trait DirOps {
    /// `std::fs::rename`.
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()>;
    /// Swaps two existing paths in one step; `Ok(false)` where the platform or the filesystem
    /// cannot.
    fn exchange(&self, a: &Path, b: &Path) -> std::io::Result<bool>;
}

/// The real filesystem.
pub(crate) struct RealFs;

impl DirOps for RealFs {
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        fs::rename(from, to)
    }

    #[cfg(any(target_os = "linux", target_os = "android", target_vendor = "apple"))]
    fn exchange(&self, a: &Path, b: &Path) -> std::io::Result<bool> {
        use rustix::fs::{CWD, RenameFlags, renameat_with};
        use rustix::io::Errno;
        match renameat_with(CWD, a, CWD, b, RenameFlags::EXCHANGE) {
            Ok(()) => Ok(true),
            // The kernel or the filesystem has no atomic exchange: the caller renames twice.
            Err(e) if e == Errno::INVAL || e == Errno::NOSYS || e == Errno::NOTSUP => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    #[cfg(not(any(target_os = "linux", target_os = "android", target_vendor = "apple")))]
    fn exchange(&self, _: &Path, _: &Path) -> std::io::Result<bool> {
        Ok(false)
    }
}

/// Moves the finished folder `temp` to `target`, replacing what is there, so that at every
/// moment `target` holds either the complete old content or the complete new one:
///
/// - no target: one rename;
/// - a target, where the platform can: one atomic exchange, then the old content (now at
///   `temp`) is removed;
/// - otherwise the old target is renamed to `temp.old` and `temp` to the target; a failure of
///   the second rename puts the old one back, and a process killed between the two leaves
///   `….old`, which the next run's [`sweep_stale`] restores.
///
/// The parent folder is synced afterwards so the rename itself survives a power cut.
pub(crate) fn install(temp: &Path, target: &Path, ops: &dyn DirOps) -> Result<(), SinkError> {
    if fs::symlink_metadata(target).is_ok() {
        if ops.exchange(temp, target).map_err(io(target))? {
            remove(temp)?;
        } else {
            let mut old = temp.as_os_str().to_owned();
            old.push(".old");
            let old = PathBuf::from(old);
            ops.rename(target, &old).map_err(io(target))?;
            if let Err(e) = ops.rename(temp, target) {
                // Best effort: the old content goes back to where it was.
                let _ = ops.rename(&old, target);
                return Err(io(target)(e));
            }
            remove(&old)?;
        }
    } else {
        ops.rename(temp, target).map_err(io(target))?;
    }
    sync_parent(target);
    Ok(())
}

/// Syncs the folder holding `path` (its entries: the rename); best effort, and only where a
/// folder can be opened for it.
fn sync_parent(path: &Path) {
    #[cfg(unix)]
    if let Some(parent) = path.parent() {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        let _ = fs::File::open(parent).and_then(|f| f.sync_all());
    }
    #[cfg(not(unix))]
    let _ = path;
}

#[cfg(test)]
mod tests;
