//! Streams tensors into size-bounded safetensors shards plus `model.safetensors.index.json`,
//! with the names transformers' `save_pretrained` uses.
//!
//! A safetensors header must precede its data, and a shard's header is known only when the
//! shard is full. Each shard reserves room for its header, streams its data right after it,
//! and writes the header into the room when it closes, padded with spaces to the reserved
//! length (trailing whitespace is valid JSON; the header length field covers it). A header that
//! outgrows its room — more tensors than the reservation allows for — is written into a new
//! file with the data copied behind it (`std::io::copy`, `copy_file_range` on Linux). Memory
//! holds one tensor at a time, never a shard.

use super::{SinkError, io};
use safetensors::Dtype;
use serde_json::{Map, Value, json};
use std::fs::{self, File};
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

struct Entry {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    start: u64,
    end: u64,
}

struct OpenShard {
    path: PathBuf,
    data: BufWriter<File>,
    entries: Vec<Entry>,
    len: u64,
}

/// The shards written, for the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenShards {
    /// File names, in order.
    pub files: Vec<String>,
    /// Total tensor bytes.
    pub total_bytes: u64,
    /// Number of tensors.
    pub tensors: usize,
}

/// Writes tensors, in the order given, into shards of at most `max_shard_bytes` of tensor
/// data (a larger tensor gets a shard of its own).
pub struct ShardWriter {
    dir: PathBuf,
    max_shard_bytes: u64,
    /// Bytes reserved for each shard's header (8-byte length excluded).
    header_room: u64,
    open: Option<OpenShard>,
    closed: Vec<(PathBuf, Vec<String>)>,
    names: std::collections::HashSet<String>,
    total: u64,
}

impl ShardWriter {
    /// A writer into `dir` (normally an [`super::OutputDir`]'s temporary folder); each shard
    /// reserves 64 KiB for its header (see [`ShardWriter::with_header_room`]).
    pub fn new(dir: impl Into<PathBuf>, max_shard_bytes: u64) -> Self {
        let max_shard_bytes = max_shard_bytes.max(1);
        let header_room = 64 << 10;
        ShardWriter {
            dir: dir.into(),
            max_shard_bytes,
            header_room,
            open: None,
            closed: Vec::new(),
            names: Default::default(),
            total: 0,
        }
    }

    /// Reserves `bytes` (rounded up to a multiple of 8, at least 64) for each shard's header.
    /// Enough room lets every shard be written in place; too little only costs a copy.
    pub fn with_header_room(mut self, bytes: u64) -> Self {
        self.header_room = bytes.max(64).div_ceil(8) * 8;
        self
    }

    /// Appends one tensor. `data` must hold exactly `shape × dtype` bytes.
    pub fn write(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        data: &[u8],
    ) -> Result<(), SinkError> {
        let expected = shape.iter().product::<usize>() * dtype.bitsize() / 8;
        if data.len() != expected {
            return Err(SinkError::TensorSize {
                name: name.into(),
                dtype,
                shape: shape.to_vec(),
                got: data.len(),
                expected,
            });
        }
        if !self.names.insert(name.to_string()) {
            return Err(SinkError::DuplicateTensor(name.to_string()));
        }
        let len = data.len() as u64;
        if self
            .open
            .as_ref()
            .is_some_and(|s| !s.entries.is_empty() && s.len + len > self.max_shard_bytes)
        {
            self.close_shard()?;
        }
        if self.open.is_none() {
            let path = self
                .dir
                .join(format!(".shard-{:05}.safetensors", self.closed.len() + 1));
            let mut file = File::create(&path).map_err(io(&path))?;
            file.seek(SeekFrom::Start(8 + self.header_room))
                .map_err(io(&path))?;
            self.open = Some(OpenShard {
                path,
                data: BufWriter::with_capacity(1 << 20, file),
                entries: Vec::new(),
                len: 0,
            });
        }
        let shard = self.open.as_mut().expect("opened above");
        shard.data.write_all(data).map_err(io(&shard.path))?;
        shard.entries.push(Entry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            start: shard.len,
            end: shard.len + len,
        });
        shard.len += len;
        self.total += len;
        Ok(())
    }

    fn close_shard(&mut self) -> Result<(), SinkError> {
        let Some(shard) = self.open.take() else {
            return Ok(());
        };
        let path = shard.path.clone();
        let file = shard.data.into_inner().map_err(|e| SinkError::Io {
            path: path.clone(),
            source: e.into_error(),
        })?;
        let mut header = Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        for e in &shard.entries {
            header.insert(
                e.name.clone(),
                json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [e.start, e.end]}),
            );
        }
        let mut text =
            serde_json::to_string(&Value::Object(header)).expect("a JSON map serializes");
        if text.len() as u64 <= self.header_room {
            // Fill the reserved room: the header, then spaces.
            text.extend(std::iter::repeat_n(
                ' ',
                (self.header_room - text.len() as u64) as usize,
            ));
            let mut head = (text.len() as u64).to_le_bytes().to_vec();
            head.extend_from_slice(text.as_bytes());
            file.write_all_at(&head, 0).map_err(io(&path))?;
        } else {
            // Too many tensors for the room: a new file, header first, data copied behind it.
            while !text.len().is_multiple_of(8) {
                text.push(' ');
            }
            let moved = path.with_extension("tmp");
            let mut out = File::create(&moved).map_err(io(&moved))?;
            out.write_all(&(text.len() as u64).to_le_bytes())
                .map_err(io(&moved))?;
            out.write_all(text.as_bytes()).map_err(io(&moved))?;
            let mut data = File::open(&path).map_err(io(&path))?;
            data.seek(SeekFrom::Start(8 + self.header_room))
                .map_err(io(&path))?;
            std::io::copy(&mut data, &mut out).map_err(io(&moved))?;
            fs::rename(&moved, &path).map_err(io(&path))?;
        }
        self.closed
            .push((path, shard.entries.into_iter().map(|e| e.name).collect()));
        Ok(())
    }

    /// Closes the last shard and names the files: `model.safetensors` when there is one, else
    /// `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`.
    pub fn finish(mut self) -> Result<WrittenShards, SinkError> {
        self.close_shard()?;
        let n = self.closed.len();
        let mut files = Vec::with_capacity(n);
        let mut weight_map = std::collections::BTreeMap::new();
        for (i, (path, names)) in self.closed.iter().enumerate() {
            let name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", i + 1)
            };
            let dest = self.dir.join(&name);
            fs::rename(path, &dest).map_err(io(&dest))?;
            for t in names {
                weight_map.insert(t.clone(), name.clone());
            }
            files.push(name);
        }
        if n > 1 {
            let index = json!({"metadata": {"total_size": self.total}, "weight_map": weight_map});
            let path = self.dir.join("model.safetensors.index.json");
            let text = serde_json::to_string_pretty(&index).expect("JSON serializes") + "\n";
            fs::write(&path, text).map_err(io(&path))?;
        }
        Ok(WrittenShards {
            files,
            total_bytes: self.total,
            tensors: self.names.len(),
        })
    }

    /// The directory shards are written into.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}
