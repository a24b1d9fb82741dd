//! One safetensors file: its header parsed and checked, its tensors read on demand.
//!
//! Tensors are read with positional reads (`pread`) into buffers of exactly their size, not
//! through a memory map: mapping a file is `unsafe` (another process may change it under the
//! map), which kiln keeps out of everything but the kernels, and a map saves little here — the
//! export touches each byte once, and the page cache serves both. Memory stays bounded by the
//! tensors in flight either way.
//!
//! The header is validated here rather than by `safetensors::SafeTensors` because that wants
//! the whole file in one buffer and reports size mismatches without the tensor's name.

use super::{CheckpointError, io};
use safetensors::Dtype;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The largest header accepted (as the `safetensors` crate does).
const MAX_HEADER: u64 = 100_000_000;

/// A tensor's entry in a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// The tensor's name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: u64,
    /// End of the byte range (exclusive).
    pub end: u64,
}

impl TensorMeta {
    /// The number of data bytes.
    pub fn byte_len(&self) -> u64 {
        self.end - self.start
    }

    /// The number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    dtype: Dtype,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

/// An opened safetensors file.
#[derive(Debug)]
pub struct Shard {
    path: PathBuf,
    file: File,
    tensors: Vec<TensorMeta>,
}

impl Shard {
    /// Opens `path` and validates its header against the file's length.
    pub fn open(path: &Path) -> Result<Self, CheckpointError> {
        let file = File::open(path).map_err(io(path))?;
        let len = file.metadata().map_err(io(path))?.len();
        let header = |message: String| CheckpointError::Header {
            file: path.to_path_buf(),
            message,
        };
        if len < 8 {
            return Err(header(format!(
                "{len} bytes: too short for the 8-byte header length (truncated file?)"
            )));
        }
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(io(path))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER {
            return Err(header(format!(
                "header length {n} is over the {MAX_HEADER}-byte limit"
            )));
        }
        if 8 + n > len {
            return Err(header(format!(
                "header length {n} runs past the end of the file ({len} bytes; truncated?)"
            )));
        }
        let mut text = vec![0u8; n as usize];
        file.read_exact_at(&mut text, 8).map_err(io(path))?;
        let doc: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&text)
            .map_err(|e| header(format!("header is not a JSON object: {e}")))?;
        let data_start = 8 + n;
        let data_len = len - data_start;
        let mut tensors = Vec::with_capacity(doc.len());
        for (name, value) in doc {
            if name == "__metadata__" {
                continue;
            }
            let bad = |message: String| CheckpointError::Tensor {
                file: path.to_path_buf(),
                tensor: name.clone(),
                message,
            };
            let raw: RawEntry =
                serde_json::from_value(value).map_err(|e| bad(format!("malformed entry: {e}")))?;
            let (begin, end) = raw.data_offsets;
            if end < begin {
                return Err(bad(format!(
                    "data_offsets [{begin}, {end}] end before they start"
                )));
            }
            if end > data_len {
                return Err(bad(format!(
                    "data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes; truncated?)"
                )));
            }
            let bits = raw
                .shape
                .iter()
                .try_fold(raw.dtype.bitsize() as u64, |acc, &d| {
                    acc.checked_mul(d as u64)
                })
                .ok_or_else(|| bad(format!("shape {:?} overflows", raw.shape)))?;
            if bits % 8 != 0 || bits / 8 != end - begin {
                return Err(bad(format!(
                    "holds {} bytes, but shape {:?} of {:?} needs {}",
                    end - begin,
                    raw.shape,
                    raw.dtype,
                    bits as f64 / 8.0
                )));
            }
            tensors.push(TensorMeta {
                name,
                dtype: raw.dtype,
                shape: raw.shape,
                start: data_start + begin,
                end: data_start + end,
            });
        }
        tensors.sort_by(|a, b| (a.start, a.end, &a.name).cmp(&(b.start, b.end, &b.name)));
        for pair in tensors.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if b.start < a.end && b.byte_len() > 0 && a.byte_len() > 0 {
                return Err(CheckpointError::Tensor {
                    file: path.to_path_buf(),
                    tensor: b.name.clone(),
                    message: format!("data overlaps tensor `{}`", a.name),
                });
            }
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Shard {
            path: path.to_path_buf(),
            file,
            tensors,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensors, sorted by name.
    pub fn tensors(&self) -> &[TensorMeta] {
        &self.tensors
    }

    /// Reads tensor `i` as elements of `T`.
    pub fn read_as<T: bytemuck::Pod>(&self, i: usize) -> Result<Vec<T>, CheckpointError> {
        let t = &self.tensors[i];
        let size = std::mem::size_of::<T>() as u64;
        self.read_range_as(i, 0, (t.byte_len() / size) as usize)
    }

    /// Reads elements `start..start + len` of tensor `i` (flat, row-major) as `T`: one expert
    /// of a 3-D tensor without reading the others.
    pub fn read_range_as<T: bytemuck::Pod>(
        &self,
        i: usize,
        start: usize,
        len: usize,
    ) -> Result<Vec<T>, CheckpointError> {
        let t = &self.tensors[i];
        let size = std::mem::size_of::<T>() as u64;
        let fail = |message: String| CheckpointError::Tensor {
            file: self.path.clone(),
            tensor: t.name.clone(),
            message,
        };
        if !t.byte_len().is_multiple_of(size) || t.dtype.bitsize() as u64 != size * 8 {
            return Err(fail(format!(
                "is {:?}, not readable as {}-byte elements",
                t.dtype, size
            )));
        }
        let count = t.byte_len() / size;
        if start as u64 + len as u64 > count {
            return Err(fail(format!(
                "elements {start}..{} are past its {count}",
                start + len
            )));
        }
        let mut out = vec![T::zeroed(); len];
        self.file
            .read_exact_at(
                bytemuck::cast_slice_mut(&mut out),
                t.start + start as u64 * size,
            )
            .map_err(io(&self.path))?;
        Ok(out)
    }

    /// Reads tensor `i`'s bytes into `buf`.
    pub fn read(&self, i: usize, buf: &mut Vec<u8>) -> Result<(), CheckpointError> {
        let t = &self.tensors[i];
        buf.clear();
        buf.resize(t.byte_len() as usize, 0);
        self.file
            .read_exact_at(buf, t.start)
            .map_err(io(&self.path))
    }
}
