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
    pub fn create(target: impl AsRef<Path>, force: bool) -> Result<Self, SinkError> {
        let target = target.as_ref().to_path_buf();
        if target.exists() && !force {
            return Err(SinkError::Exists { path: target });
        }
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let parent = target
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        fs::create_dir_all(parent).map_err(io(parent))?;
        let temp = parent.join(format!(".{name}.kiln-partial-{}", std::process::id()));
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
    pub fn commit(mut self) -> Result<PathBuf, SinkError> {
        for entry in fs::read_dir(&self.temp).map_err(io(&self.temp))? {
            let path = entry.map_err(io(&self.temp))?.path();
            if path.is_file() {
                fs::File::open(&path)
                    .and_then(|f| f.sync_all())
                    .map_err(io(&path))?;
            }
        }
        if self.target.exists() {
            if !self.force {
                return Err(SinkError::Exists {
                    path: self.target.clone(),
                });
            }
            let old = self.temp.with_extension("old");
            fs::rename(&self.target, &old).map_err(io(&self.target))?;
            fs::rename(&self.temp, &self.target).map_err(io(&self.target))?;
            fs::remove_dir_all(&old).map_err(io(&old))?;
        } else {
            fs::rename(&self.temp, &self.target).map_err(io(&self.target))?;
        }
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

#[cfg(test)]
mod tests;
