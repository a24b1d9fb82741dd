//! GGUF files (llama.cpp's format, version 3): a streaming writer and a reader that checks
//! every length and offset against the file before it allocates or reads.
//!
//! Layout (little-endian): `"GGUF"`, version `u32` (3), tensor count `u64`, metadata count
//! `u64`; the metadata, each a string key, a `u32` value type and the value; the tensor
//! infos, each a string name, `u32` dimension count, `u64` dimensions (innermost first: ggml's
//! `ne[0]` is a row's length), `u32` ggml type and `u64` offset into the data section; padding
//! to `general.alignment` (default 32); the data section, each tensor at an aligned offset.
//! A string is a `u64` byte length and UTF-8 bytes; an array a `u32` element type, a `u64`
//! count and the elements.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// The alignment GGUF uses unless `general.alignment` says otherwise.
pub const DEFAULT_ALIGNMENT: u64 = 32;
const MAGIC: &[u8; 4] = b"GGUF";
/// Longest string or array the reader accepts (a hostile length is refused before any
/// allocation).
const MAX_LEN: u64 = 1 << 28;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// An error reading or writing a GGUF file, naming the file and what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not a GGUF version 3 file, or a field is out of bounds.
    #[error("{}: {what}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the field.
        what: String,
    },
    /// A tensor given to the writer disagrees with its declared type and shape.
    #[error("GGUF tensor `{name}`: {what}")]
    Tensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        what: String,
    },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `UINT8`.
    U8(u8),
    /// `INT8`.
    I8(i8),
    /// `UINT16`.
    U16(u16),
    /// `INT16`.
    I16(i16),
    /// `UINT32`.
    U32(u32),
    /// `INT32`.
    I32(i32),
    /// `FLOAT32`.
    F32(f32),
    /// `BOOL`.
    Bool(bool),
    /// `STRING`.
    String(String),
    /// `ARRAY` of one element type (an empty one is written with element type `STRING`, what
    /// llama.cpp expects of an empty token or merge list).
    Array(Vec<Value>),
    /// `UINT64`.
    U64(u64),
    /// `INT64`.
    I64(i64),
    /// `FLOAT64`.
    F64(f64),
}

impl Value {
    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The value as an unsigned integer, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// A tensor's entry in the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name (`blk.0.attn_q.weight`, …).
    pub name: String,
    /// Dimensions, innermost first (ggml's `ne`).
    pub dims: Vec<u64>,
    /// The ggml type number (`kiln_kernels::ops::gguf::GgufType::ggml_type`, 0 = F32,
    /// 1 = F16, 30 = BF16).
    pub ggml_type: u32,
    /// Offset from the start of the data section.
    pub offset: u64,
}

/// Elements per block and bytes per block of a ggml type kiln knows, or `None`.
pub fn type_layout(ggml_type: u32) -> Option<(u64, u64)> {
    use kiln_kernels::ops::gguf::GgufType;
    match ggml_type {
        0 => Some((1, 4)),
        1 | 30 => Some((1, 2)),
        _ => GgufType::ALL
            .iter()
            .find(|t| t.ggml_type() == ggml_type)
            .map(|t| (t.block_elems() as u64, t.block_bytes() as u64)),
    }
}

/// The bytes of a tensor of `dims` and `ggml_type`, or why it has none (an unknown type, rows
/// that are not whole blocks, an overflow).
pub fn tensor_bytes(dims: &[u64], ggml_type: u32) -> Result<u64, String> {
    let (block, bytes) =
        type_layout(ggml_type).ok_or_else(|| format!("unknown ggml type {ggml_type}"))?;
    let row = *dims.first().unwrap_or(&1);
    if !row.is_multiple_of(block) {
        return Err(format!(
            "rows of {row} elements are not whole blocks of {block} (ggml type {ggml_type})"
        ));
    }
    let mut total = (row / block).checked_mul(bytes);
    for &d in dims.iter().skip(1) {
        total = total.and_then(|t| t.checked_mul(d));
    }
    total.ok_or_else(|| format!("dimensions {dims:?} overflow"))
}

fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Writes a GGUF file: the header (metadata and every tensor's info) first, then each
/// tensor's bytes in the order declared, so tensors stream one at a time.
pub struct GgufWriter {
    path: PathBuf,
    out: BufWriter<File>,
    tensors: Vec<(TensorInfo, u64)>,
    next: usize,
    written: u64,
    alignment: u64,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(u8::from(*x)),
        Value::String(s) => put_str(buf, s),
        Value::Array(items) => {
            let elem = items.first().map_or(8, Value::type_id);
            buf.extend_from_slice(&elem.to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(buf, i);
            }
        }
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
    }
}

impl GgufWriter {
    /// Creates `path` and writes the header: `metadata` in order, then `tensors` (name,
    /// dimensions innermost first, ggml type), whose offsets it assigns. Arrays must hold one
    /// element type; `general.alignment`, if given, must be a `U32` power of two.
    pub fn create(
        path: &Path,
        metadata: &[(String, Value)],
        tensors: &[(String, Vec<u64>, u32)],
    ) -> Result<Self, GgufError> {
        let malformed = |what: String| GgufError::Malformed {
            path: path.to_path_buf(),
            what,
        };
        let mut alignment = DEFAULT_ALIGNMENT;
        for (k, v) in metadata {
            if let Value::Array(items) = v
                && items.iter().any(|i| i.type_id() != items[0].type_id())
            {
                return Err(malformed(format!(
                    "metadata `{k}`: an array mixes element types"
                )));
            }
            if k == "general.alignment" {
                match v {
                    Value::U32(a) if a.is_power_of_two() => alignment = u64::from(*a),
                    _ => {
                        return Err(malformed(
                            "`general.alignment` must be a U32 power of two".into(),
                        ));
                    }
                }
            }
        }
        let mut infos = Vec::with_capacity(tensors.len());
        let mut offset = 0u64;
        for (name, dims, ty) in tensors {
            let bytes = tensor_bytes(dims, *ty).map_err(|what| GgufError::Tensor {
                name: name.clone(),
                what,
            })?;
            infos.push((
                TensorInfo {
                    name: name.clone(),
                    dims: dims.clone(),
                    ggml_type: *ty,
                    offset,
                },
                bytes,
            ));
            offset = offset
                .checked_add(bytes)
                .map(|end| align(end, alignment))
                .ok_or_else(|| GgufError::Tensor {
                    name: name.clone(),
                    what: "the data section would exceed 2^64 bytes".into(),
                })?;
        }
        let mut head = Vec::new();
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(infos.len() as u64).to_le_bytes());
        head.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (k, v) in metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut head, v);
        }
        for (t, _) in &infos {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ggml_type.to_le_bytes());
            head.extend_from_slice(&t.offset.to_le_bytes());
        }
        head.resize(align(head.len() as u64, alignment) as usize, 0);
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut out = BufWriter::new(File::create(path).map_err(io)?);
        out.write_all(&head).map_err(io)?;
        Ok(GgufWriter {
            path: path.to_path_buf(),
            out,
            tensors: infos,
            next: 0,
            written: 0,
            alignment,
        })
    }

    fn io(&self) -> impl FnOnce(std::io::Error) -> GgufError + '_ {
        move |source| GgufError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// Writes the next tensor's bytes (tensors come in the order `create` was given).
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), GgufError> {
        let Some((info, bytes)) = self.tensors.get(self.next) else {
            return Err(GgufError::Tensor {
                name: name.into(),
                what: "more tensors written than the header declares".into(),
            });
        };
        if info.name != name || *bytes != data.len() as u64 {
            return Err(GgufError::Tensor {
                name: name.into(),
                what: format!(
                    "expected `{}` of {bytes} bytes next, got {} bytes",
                    info.name,
                    data.len()
                ),
            });
        }
        let pad = info.offset - self.written;
        let (offset, bytes) = (info.offset, *bytes);
        self.out
            .write_all(&vec![0u8; pad as usize])
            .map_err(self.io())?;
        self.out.write_all(data).map_err(self.io())?;
        self.written = offset + bytes;
        self.next += 1;
        Ok(())
    }

    /// Checks every declared tensor was written, pads the end and flushes.
    pub fn finish(mut self) -> Result<(), GgufError> {
        if let Some((t, _)) = self.tensors.get(self.next) {
            return Err(GgufError::Tensor {
                name: t.name.clone(),
                what: "declared in the header but never written".into(),
            });
        }
        let end = align(self.written, self.alignment);
        let pad = vec![0u8; (end - self.written) as usize];
        self.out.write_all(&pad).map_err(self.io())?;
        self.out.flush().map_err(self.io())?;
        self.out
            .get_ref()
            .sync_all()
            .map_err(|source| GgufError::Io {
                path: self.path.clone(),
                source,
            })
    }
}

/// A GGUF file's header, read and checked; tensor data is read on demand.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    file: File,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, Value>,
    /// Tensor infos, in file order.
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
}

/// A cursor over the header bytes that refuses to read past the file.
struct Cursor<'a, R: Read> {
    r: &'a mut R,
    pos: u64,
    len: u64,
    path: &'a Path,
}

impl<R: Read> Cursor<'_, R> {
    fn err(&self, what: impl Into<String>) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            what: what.into(),
        }
    }

    fn bytes(&mut self, n: u64, field: &str) -> Result<Vec<u8>, GgufError> {
        if n > self.len.saturating_sub(self.pos) {
            return Err(self.err(format!(
                "{field}: {n} bytes at offset {} run past the end of the file ({} bytes)",
                self.pos, self.len
            )));
        }
        let mut b = vec![0u8; n as usize];
        self.r.read_exact(&mut b).map_err(|source| GgufError::Io {
            path: self.path.to_path_buf(),
            source,
        })?;
        self.pos += n;
        Ok(b)
    }

    fn array<const N: usize>(&mut self, field: &str) -> Result<[u8; N], GgufError> {
        let b = self.bytes(N as u64, field)?;
        Ok(b.try_into().unwrap_or([0; N]))
    }

    fn u32(&mut self, field: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    fn len_of(&mut self, field: &str) -> Result<u64, GgufError> {
        let n = self.u64(field)?;
        if n > MAX_LEN {
            return Err(self.err(format!("{field}: length {n} is larger than kiln accepts")));
        }
        Ok(n)
    }

    fn string(&mut self, field: &str) -> Result<String, GgufError> {
        let n = self.len_of(field)?;
        let b = self.bytes(n, field)?;
        String::from_utf8(b).map_err(|_| self.err(format!("{field}: not UTF-8")))
    }

    fn value(&mut self, ty: u32, field: &str, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>(field)?[0]),
            1 => Value::I8(self.array::<1>(field)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(field)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(field)?)),
            4 => Value::U32(self.u32(field)?),
            5 => Value::I32(i32::from_le_bytes(self.array(field)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(field)?)),
            7 => match self.array::<1>(field)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("{field}: bool byte {b}"))),
            },
            8 => Value::String(self.string(field)?),
            9 => {
                if depth > 0 {
                    return Err(self.err(format!("{field}: nested arrays")));
                }
                let elem = self.u32(field)?;
                let n = self.len_of(field)?;
                // Every element takes at least one byte: a count past the file is refused
                // before the vector is allocated.
                if n > self.len.saturating_sub(self.pos) {
                    return Err(self.err(format!(
                        "{field}: an array of {n} elements cannot fit in the rest of the file"
                    )));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(elem, field, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(field)?),
            11 => Value::I64(i64::from_le_bytes(self.array(field)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(field)?)),
            t => return Err(self.err(format!("{field}: unknown value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens `path` and reads its header, checking the magic, the version (3), every length,
    /// each tensor's type and size, and that every tensor lies inside the file.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut reader = std::io::BufReader::new(file.try_clone().map_err(io)?);
        let mut c = Cursor {
            r: &mut reader,
            pos: 0,
            len,
            path,
        };
        if &c.array::<4>("magic")? != MAGIC {
            return Err(c.err("not a GGUF file (the magic is not \"GGUF\")"));
        }
        let version = c.u32("version")?;
        if version != 3 {
            return Err(c.err(format!("GGUF version {version} (kiln reads version 3)")));
        }
        let n_tensors = c.len_of("tensor count")?;
        let n_kv = c.len_of("metadata count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key {i}"))?;
            let ty = c.u32(&format!("metadata `{key}` type"))?;
            let v = c.value(ty, &format!("metadata `{key}`"), 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(c.err(format!("metadata `{key}` appears twice")));
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
            Some(v) => {
                return Err(c.err(format!(
                    "`general.alignment` is {v:?}, not a U32 power of two"
                )));
            }
        };
        let mut tensors = Vec::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor {i} name"))?;
            let nd = c.u32(&format!("tensor `{name}` dimension count"))?;
            if nd == 0 || nd > MAX_DIMS {
                return Err(c.err(format!("tensor `{name}`: {nd} dimensions (1 to 4)")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(c.u64(&format!("tensor `{name}` dimensions"))?);
            }
            let ggml_type = c.u32(&format!("tensor `{name}` type"))?;
            let offset = c.u64(&format!("tensor `{name}` offset"))?;
            if !offset.is_multiple_of(alignment) {
                return Err(c.err(format!(
                    "tensor `{name}`: offset {offset} is not a multiple of the alignment {alignment}"
                )));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let data_start = align(c.pos, alignment);
        let mut seen = std::collections::BTreeSet::new();
        for t in &tensors {
            if !seen.insert(&t.name) {
                return Err(c.err(format!("tensor `{}` appears twice", t.name)));
            }
            let bytes = tensor_bytes(&t.dims, t.ggml_type)
                .map_err(|e| c.err(format!("tensor `{}`: {e}", t.name)))?;
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(bytes));
            if end.is_none_or(|e| e > len) {
                return Err(c.err(format!(
                    "tensor `{}`: {bytes} bytes at data offset {} run past the end of the file ({len} bytes)",
                    t.name, t.offset
                )));
            }
        }
        drop(reader);
        Ok(GgufFile {
            path: path.to_path_buf(),
            file,
            metadata,
            tensors,
            data_start,
        })
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor's bytes (checked to lie in the file when it was opened).
    pub fn read(&self, t: &TensorInfo) -> Result<Vec<u8>, GgufError> {
        use std::os::unix::fs::FileExt;
        let bytes = tensor_bytes(&t.dims, t.ggml_type).map_err(|what| GgufError::Tensor {
            name: t.name.clone(),
            what,
        })?;
        let mut buf = vec![0u8; bytes as usize];
        self.file
            .read_exact_at(&mut buf, self.data_start + t.offset)
            .map_err(|source| GgufError::Io {
                path: self.path.clone(),
                source,
            })?;
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(dir: &Path) -> PathBuf {
        let path = dir.join("t.gguf");
        let meta = vec![
            (
                "general.architecture".to_string(),
                Value::String("llama".into()),
            ),
            ("llama.block_count".to_string(), Value::U32(2)),
            (
                "tokenizer.ggml.tokens".to_string(),
                Value::Array(vec![Value::String("<s>".into()), Value::String("a".into())]),
            ),
            ("llama.rope.freq_base".to_string(), Value::F32(10000.0)),
        ];
        let tensors = vec![
            ("a".to_string(), vec![4u64, 2], 0u32),
            ("b".to_string(), vec![32u64, 1], 8u32),
        ];
        let mut w = GgufWriter::create(&path, &meta, &tensors).unwrap();
        w.write_tensor("a", &[7u8; 32]).unwrap();
        w.write_tensor("b", &[9u8; 34]).unwrap();
        w.finish().unwrap();
        path
    }

    #[test]
    fn written_files_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = sample(dir.path());
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.metadata["llama.block_count"], Value::U32(2));
        assert_eq!(f.metadata["general.architecture"].as_str(), Some("llama"));
        assert_eq!(f.tensors.len(), 2);
        let b = f.tensor("b").unwrap();
        assert_eq!((b.offset, b.ggml_type), (32, 8));
        assert_eq!(f.read(b).unwrap(), vec![9u8; 34]);
        assert_eq!(std::fs::metadata(&path).unwrap().len() % 32, 0);
    }

    #[test]
    fn writers_refuse_the_wrong_tensor_or_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.gguf");
        let tensors = vec![("a".to_string(), vec![4u64], 0u32)];
        let mut w = GgufWriter::create(&path, &[], &tensors).unwrap();
        let e = w.write_tensor("b", &[0u8; 16]).unwrap_err().to_string();
        assert!(e.contains("expected `a` of 16 bytes next"), "{e}");
        let e = GgufWriter::create(&path, &[], &[("q".into(), vec![30], 12)])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not whole blocks of 256"), "{e}");
        let w = GgufWriter::create(&path, &[], &tensors).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("never written"), "{e}");
        // A row so long its byte count overflows is an error, not a wrapped size.
        let e = tensor_bytes(&[1 << 62], 0).unwrap_err();
        assert!(e.contains("overflow"), "{e}");
        let e = tensor_bytes(&[1 << 40, 1 << 40], 1).unwrap_err();
        assert!(e.contains("overflow"), "{e}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Any corruption of a valid file — bytes overwritten anywhere, or the file cut
        /// short — is refused by name or read; never a panic, and what opens reads back.
        #[test]
        fn corrupted_files_never_panic(
            edits in proptest::collection::vec((0usize..400, proptest::prelude::any::<u8>()), 1..6),
            cut in 0usize..420,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let mut bytes = std::fs::read(sample(dir.path())).unwrap();
            for (at, b) in edits {
                let n = bytes.len();
                bytes[at % n] = b;
            }
            bytes.truncate(cut.max(1).min(bytes.len()));
            let path = dir.path().join("fuzzed.gguf");
            std::fs::write(&path, &bytes).unwrap();
            if let Ok(f) = GgufFile::open(&path) {
                for t in &f.tensors {
                    f.read(t).unwrap();
                }
            }
        }
    }

    /// Hostile headers are named errors, refused before any large allocation.
    #[test]
    fn broken_headers_are_named_errors() {
        let dir = tempfile::tempdir().unwrap();
        let good = std::fs::read(sample(dir.path())).unwrap();
        let path = dir.path().join("bad.gguf");
        let check = |bytes: &[u8], want: &str| {
            std::fs::write(&path, bytes).unwrap();
            let e = GgufFile::open(&path).unwrap_err().to_string();
            assert!(e.contains(want), "want {want:?} in {e}");
            assert!(e.contains("bad.gguf"), "{e}");
        };
        check(b"GGML", "magic");
        let mut v2 = good.clone();
        v2[4] = 2;
        check(&v2, "GGUF version 2");
        let mut huge = good.clone();
        huge[16..24].copy_from_slice(&(1u64 << 62).to_le_bytes());
        check(&huge, "larger than kiln accepts");
        check(&good[..good.len() - 40], "run past the end of the file");
        check(&good[..30], "run past the end of the file");
        // The first key's length claims the whole file.
        let mut key = good.clone();
        key[24..32].copy_from_slice(&(1u64 << 20).to_le_bytes());
        check(&key, "run past the end of the file");
    }
}
