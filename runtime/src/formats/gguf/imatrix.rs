//! llama.cpp's importance matrix files: what `llama-imatrix` writes and `llama-quantize
//! --imatrix` reads (`common/imatrix-loader.cpp`, `tools/imatrix/imatrix.cpp` of the pinned
//! llama.cpp).
//!
//! - **GGUF** (the default): `general.type` `imatrix`, `imatrix.datasets` (strings),
//!   `imatrix.chunk_count` and `imatrix.chunk_size` (u32); per weight matrix `W` (sorted by
//!   name) two F32 tensors, `W.in_sum2` `[cols, n_mat]` (the sum over tokens of each input
//!   column's squared activation, per expert) and `W.counts` `[1, n_mat]` (tokens seen).
//! - **legacy `.dat`**: i32 entry count; per entry an i32-length name, i32 `ncall`, i32 value
//!   count and the values `sum / count · ncall` (f32); then optionally the i32 chunk count and
//!   an i32-length dataset name.
//!
//! [`Imatrix::weights`] gives a matrix's importance weights as `llama-quantize` loads them:
//! GGUF sums divided by their expert's count (all ones for an expert that saw no token), legacy
//! values divided by `ncall`.

use crate::formats::gguf::container::{GgufError, GgufFile, GgufWriter, Value};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// An error reading or writing an importance matrix, naming the file and what was wrong.
#[derive(Debug, thiserror::Error)]
pub enum ImatrixError {
    /// The GGUF container was unreadable.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// The file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not an importance matrix llama-quantize would accept.
    #[error("{}: {what}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the entry or field.
        what: String,
    },
}

/// One weight matrix's statistics: `sums` (`n_mat` blocks of `cols`) and one count per
/// matrix (expert).
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// Σ x² per input column, expert after expert.
    pub sums: Vec<f32>,
    /// Tokens each expert (or the one dense matrix) saw.
    pub counts: Vec<i64>,
}

/// An importance matrix: entries by GGUF tensor name (`blk.0.attn_q.weight`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Imatrix {
    /// The statistics, by weight name.
    pub entries: BTreeMap<String, Entry>,
    /// The text files it was computed on.
    pub datasets: Vec<String>,
    /// Chunks processed.
    pub chunk_count: u32,
    /// Tokens per chunk (`--ctx`).
    pub chunk_size: u32,
    /// Read from a legacy `.dat` file: `sums` hold `sum / count · ncall` and `counts` the one
    /// `ncall`.
    pub legacy: bool,
}

impl Imatrix {
    /// Reads `path`: a GGUF imatrix, else (not GGUF) a legacy `.dat`. Refuses what
    /// llama-quantize refuses: no entries, a GGUF without the three `imatrix.*` keys,
    /// mismatched or non-F32 sums and counts, and non-finite values.
    pub fn read(path: &Path) -> Result<Imatrix, ImatrixError> {
        let invalid = |what: String| ImatrixError::Invalid {
            path: path.to_path_buf(),
            what,
        };
        let mut magic = [0u8; 4];
        let is_gguf = std::fs::File::open(path)
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
            .map(|()| &magic == b"GGUF")
            .unwrap_or(false);
        let m = if is_gguf {
            Self::read_gguf(path)?
        } else {
            Self::read_legacy(path)?
        };
        if m.entries.is_empty() {
            return Err(invalid("no importance matrix entries".into()));
        }
        for (name, e) in &m.entries {
            if let Some(v) = e.sums.iter().find(|v| !v.is_finite()) {
                return Err(invalid(format!("`{name}` holds a non-finite value {v}")));
            }
        }
        Ok(m)
    }

    fn read_gguf(path: &Path) -> Result<Imatrix, ImatrixError> {
        let invalid = |what: String| ImatrixError::Invalid {
            path: path.to_path_buf(),
            what,
        };
        let f = GgufFile::open(path)?;
        let md = &f.metadata;
        let (datasets, count, size) = (
            md.get("imatrix.datasets"),
            md.get("imatrix.chunk_count"),
            md.get("imatrix.chunk_size"),
        );
        let (Some(datasets), Some(count), Some(size)) = (datasets, count, size) else {
            return Err(invalid(
                "missing imatrix metadata (imatrix.datasets, imatrix.chunk_count, \
                 imatrix.chunk_size): llama-quantize refuses such a file"
                    .into(),
            ));
        };
        let datasets = match datasets {
            Value::Array(items) => items
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            _ => Vec::new(),
        };
        let u32_of = |v: &Value, key: &str| {
            v.as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| invalid(format!("`{key}` is not a u32")))
        };
        let mut pairs: BTreeMap<String, (Option<usize>, Option<usize>)> = BTreeMap::new();
        for (i, t) in f.tensors.iter().enumerate() {
            if let Some(n) = t.name.strip_suffix(".in_sum2") {
                pairs.entry(n.to_string()).or_default().0 = Some(i);
            } else if let Some(n) = t.name.strip_suffix(".counts") {
                pairs.entry(n.to_string()).or_default().1 = Some(i);
            }
        }
        let mut entries = BTreeMap::new();
        for (name, pair) in pairs {
            let (Some(s), Some(c)) = pair else {
                return Err(invalid(format!("mismatched sums and counts for `{name}`")));
            };
            let (s, c) = (&f.tensors[s], &f.tensors[c]);
            if s.ggml_type != 0 || c.ggml_type != 0 {
                return Err(invalid(format!("sums and counts for `{name}` must be F32")));
            }
            let floats = |b: Vec<u8>| -> Vec<f32> {
                b.chunks_exact(4)
                    .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                    .collect()
            };
            let sums = floats(f.read(s)?);
            let counts: Vec<i64> = floats(f.read(c)?)
                .iter()
                .map(|&x| x.round() as i64)
                .collect();
            if counts.is_empty() || !sums.len().is_multiple_of(counts.len()) {
                return Err(invalid(format!(
                    "`{name}`: {} sums are not whole rows for {} counts",
                    sums.len(),
                    counts.len()
                )));
            }
            entries.insert(name, Entry { sums, counts });
        }
        Ok(Imatrix {
            entries,
            datasets,
            chunk_count: u32_of(count, "imatrix.chunk_count")?,
            chunk_size: u32_of(size, "imatrix.chunk_size")?,
            legacy: false,
        })
    }

    fn read_legacy(path: &Path) -> Result<Imatrix, ImatrixError> {
        let bytes = std::fs::read(path).map_err(|source| ImatrixError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |what: String| ImatrixError::Invalid {
            path: path.to_path_buf(),
            what,
        };
        let mut pos = 0usize;
        let i32_at = |pos: &mut usize, field: &str| -> Result<i32, ImatrixError> {
            let b = bytes
                .get(*pos..*pos + 4)
                .ok_or_else(|| invalid(format!("ends inside {field}")))?;
            *pos += 4;
            Ok(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let n = i32_at(
            &mut pos,
            "the entry count (neither GGUF nor a legacy imatrix)",
        )?;
        if n < 1 {
            return Err(invalid("no data (entry count below 1)".into()));
        }
        let mut entries = BTreeMap::new();
        for i in 0..n {
            let len = i32_at(&mut pos, "an entry's name length")?;
            let name = usize::try_from(len)
                .ok()
                .and_then(|len| bytes.get(pos..pos + len).map(|b| (b, len)))
                .ok_or_else(|| invalid(format!("entry {}: bad name length {len}", i + 1)))?;
            pos += name.1;
            let name = String::from_utf8_lossy(name.0).into_owned();
            let ncall = i32_at(&mut pos, "an entry's ncall")?;
            let nval = i32_at(&mut pos, "an entry's value count")?;
            let nval = usize::try_from(nval)
                .ok()
                .filter(|&v| v >= 1 && v <= (bytes.len() - pos) / 4)
                .ok_or_else(|| invalid(format!("`{name}`: bad value count {nval}")))?;
            let sums = bytes[pos..pos + 4 * nval]
                .chunks_exact(4)
                .map(|x| f32::from_le_bytes([x[0], x[1], x[2], x[3]]))
                .collect();
            pos += 4 * nval;
            entries.insert(
                name,
                Entry {
                    sums,
                    counts: vec![i64::from(ncall)],
                },
            );
        }
        let mut m = Imatrix {
            entries,
            legacy: true,
            ..Imatrix::default()
        };
        if pos < bytes.len() {
            if let Ok(c) = i32_at(&mut pos, "the chunk count") {
                m.chunk_count = c.max(0) as u32;
            }
            if let Ok(len) = i32_at(&mut pos, "the dataset name's length")
                && let Some(b) = usize::try_from(len)
                    .ok()
                    .filter(|&l| l > 0)
                    .and_then(|l| bytes.get(pos..pos + l))
            {
                m.datasets.push(String::from_utf8_lossy(b).into_owned());
            }
        }
        Ok(m)
    }

    /// The importance weights of `name` as `llama-quantize` loads them (`load_imatrix` of
    /// `tools/quantize`): per expert `sum / count` in f32, ones for an expert with no count;
    /// legacy files' values divided by `ncall` (as they are when `ncall` is 0). `None`: no
    /// entry.
    pub fn weights(&self, name: &str) -> Option<Vec<f32>> {
        let e = self.entries.get(name)?;
        if self.legacy {
            let ncall = e.counts.first().copied().unwrap_or(0);
            return Some(if ncall > 0 {
                e.sums.iter().map(|&s| s / ncall as f32).collect()
            } else {
                e.sums.clone()
            });
        }
        let per = e.sums.len() / e.counts.len().max(1);
        let mut w = vec![0f32; e.sums.len()];
        for (j, &c) in e.counts.iter().enumerate() {
            let c = c as f32;
            for i in 0..per {
                w[j * per + i] = if c > 0.0 {
                    e.sums[j * per + i] / c
                } else {
                    1.0
                };
            }
        }
        Some(w)
    }

    /// Writes the GGUF form (`llama-imatrix`'s default): the metadata in its order, then each
    /// entry's `in_sum2` and `counts` in name order.
    pub fn write_gguf(&self, path: &Path) -> Result<(), ImatrixError> {
        let md = vec![
            ("general.type".to_string(), Value::String("imatrix".into())),
            (
                "imatrix.datasets".to_string(),
                Value::Array(
                    self.datasets
                        .iter()
                        .map(|d| Value::String(d.clone()))
                        .collect(),
                ),
            ),
            (
                "imatrix.chunk_count".to_string(),
                Value::U32(self.chunk_count),
            ),
            (
                "imatrix.chunk_size".to_string(),
                Value::U32(self.chunk_size),
            ),
        ];
        // ggml writes a tensor's dimensions up to its last one above 1 (`ggml_n_dims`): a
        // dense matrix's sums are `[cols]`, its count `[1]`.
        let dims = |d: Vec<u64>| {
            let n = d.iter().rposition(|&x| x > 1).map_or(1, |i| i + 1);
            d[..n].to_vec()
        };
        let mut tensors = Vec::new();
        for (name, e) in &self.entries {
            let n_mat = e.counts.len() as u64;
            tensors.push((
                format!("{name}.in_sum2"),
                dims(vec![e.sums.len() as u64 / n_mat.max(1), n_mat]),
                0,
            ));
            tensors.push((format!("{name}.counts"), dims(vec![1, n_mat]), 0));
        }
        let mut w = GgufWriter::create(path, &md, &tensors)?;
        for (name, e) in &self.entries {
            let sums: Vec<u8> = e.sums.iter().flat_map(|v| v.to_le_bytes()).collect();
            w.write_tensor(&format!("{name}.in_sum2"), &sums)?;
            let counts: Vec<u8> = e
                .counts
                .iter()
                .flat_map(|&c| (c as f32).to_le_bytes())
                .collect();
            w.write_tensor(&format!("{name}.counts"), &counts)?;
        }
        w.finish()?;
        Ok(())
    }

    /// Writes the legacy `.dat` form (`llama-imatrix --output-format dat`): entries whose
    /// counts are all zero skipped, `ncall = ⌈max count / chunk_size⌉`, each value
    /// `sum / count · ncall` (1 for an expert without tokens), then the chunk count and the
    /// last dataset's name.
    pub fn write_dat(&self, path: &Path) -> Result<(), ImatrixError> {
        let io = |source| ImatrixError::Io {
            path: path.to_path_buf(),
            source,
        };
        let chunk = i64::from(self.chunk_size.max(1));
        let kept: Vec<(&String, &Entry)> = self
            .entries
            .iter()
            .filter(|(_, e)| e.counts.iter().any(|&c| c != 0))
            .collect();
        let mut b = Vec::new();
        b.extend_from_slice(&(kept.len() as i32).to_le_bytes());
        for (name, e) in kept {
            b.extend_from_slice(&(name.len() as i32).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            let max = e.counts.iter().copied().max().unwrap_or(0);
            let ncall = ((max + chunk - 1) / chunk) as i32;
            b.extend_from_slice(&ncall.to_le_bytes());
            b.extend_from_slice(&(e.sums.len() as i32).to_le_bytes());
            let per = e.sums.len() / e.counts.len().max(1);
            for (i, &s) in e.sums.iter().enumerate() {
                let mut count = e.counts[i / per.max(1)] as f32;
                let mut value = s;
                if count == 0.0 {
                    value = 1.0;
                    count = 1.0;
                }
                b.extend_from_slice(&((value / count) * ncall as f32).to_le_bytes());
            }
        }
        b.extend_from_slice(&(self.chunk_count as i32).to_le_bytes());
        let dataset = self.datasets.last().map_or("", String::as_str);
        b.extend_from_slice(&(dataset.len() as i32).to_le_bytes());
        b.extend_from_slice(dataset.as_bytes());
        let mut f = std::fs::File::create(path).map_err(io)?;
        f.write_all(&b).map_err(io)?;
        f.sync_all().map_err(io)
    }
}

/// `llama-imatrix`'s collection (`IMatrixCollector::collect_imatrix`) as a forward-pass
/// observer: each weight matrix's input (by its GGUF name; `blk.*` only, plus `output` when
/// asked) adds every row's squared values to its sums, in f32, row after row; a dense matrix
/// skips inputs of fewer than 16 rows as llama.cpp does, an expert counts each routed token.
#[cfg(feature = "exec")]
pub struct Collector {
    names: super::Names,
    experts: usize,
    process_output: bool,
    entries: BTreeMap<String, Entry>,
}

#[cfg(feature = "exec")]
impl Collector {
    /// A collector for a model with `experts` experts per MoE block (0: dense);
    /// `process_output`: also `output.weight` (llama-imatrix's `--process-output`), which a
    /// model whose embeddings are tied has not (llama.cpp's output matmul is then
    /// `token_embd`'s, which it never collects).
    pub fn new(experts: usize, process_output: bool, tied_embeddings: bool) -> Collector {
        Collector {
            names: super::Names::generic(experts),
            experts,
            process_output: process_output && !tied_embeddings,
            entries: BTreeMap::new(),
        }
    }

    /// The importance matrix gathered so far, over `chunks` chunks of `chunk_size` tokens of
    /// `datasets`.
    pub fn finish(self, datasets: Vec<String>, chunks: u32, chunk_size: u32) -> Imatrix {
        Imatrix {
            entries: self.entries,
            datasets,
            chunk_count: chunks,
            chunk_size,
            legacy: false,
        }
    }
}

#[cfg(feature = "exec")]
impl crate::model::Observer for Collector {
    fn linear_input(
        &mut self,
        module: &str,
        x: &candle_core::Tensor,
    ) -> Result<(), crate::model::ModelError> {
        let Some(super::Target::Tensor { name, expert, .. }) =
            self.names.target(&format!("{module}.weight"))
        else {
            return Ok(());
        };
        if !(name.starts_with("blk.") || (self.process_output && name == "output.weight")) {
            return Ok(());
        }
        let cols = x.dims().last().copied().unwrap_or(0);
        if cols == 0 {
            return Ok(());
        }
        let v: Vec<f32> = x
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let rows = v.len() / cols;
        if expert.is_none() && rows < 16 {
            return Ok(());
        }
        let mats = if expert.is_some() {
            self.experts.max(1)
        } else {
            1
        };
        let e = self.entries.entry(name.clone()).or_insert_with(|| Entry {
            sums: vec![0.0; cols * mats],
            counts: vec![0; mats],
        });
        if e.sums.len() != cols * mats {
            return Err(crate::model::ModelError::Config(format!(
                "imatrix: inconsistent size for `{name}` ({} vs {})",
                e.sums.len(),
                cols * mats
            )));
        }
        let slot = expert.unwrap_or(0);
        if slot >= mats {
            return Err(crate::model::ModelError::Config(format!(
                "imatrix: expert {slot} of `{name}` beyond the model's {mats}"
            )));
        }
        let acc = &mut e.sums[slot * cols..(slot + 1) * cols];
        for row in v.chunks_exact(cols) {
            for (a, &x) in acc.iter_mut().zip(row) {
                *a += x * x;
            }
        }
        e.counts[slot] += rows as i64;
        if acc.iter().any(|a| !a.is_finite()) {
            return Err(crate::model::ModelError::Config(format!(
                "imatrix: non-finite values detected in `{name}`"
            )));
        }
        Ok(())
    }

    fn key_value(
        &mut self,
        _attention: &str,
        _k: &candle_core::Tensor,
        _v: &candle_core::Tensor,
    ) -> Result<(), crate::model::ModelError> {
        Ok(())
    }
}

/// A layer-by-layer run ([`crate::calibrate::max::calibrate_by_layer`]) collects the same sums:
/// each matrix sees the chunks in the same order either way.
#[cfg(feature = "exec")]
impl crate::calibrate::max::LayerCalibration for Collector {}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Imatrix {
        let mut entries = BTreeMap::new();
        entries.insert(
            "blk.0.attn_q.weight".to_string(),
            Entry {
                sums: vec![2.0, 4.0, 8.0],
                counts: vec![4],
            },
        );
        entries.insert(
            "blk.0.ffn_up_exps.weight".to_string(),
            Entry {
                sums: vec![1.0, 3.0, 5.0, 7.0],
                counts: vec![2, 0],
            },
        );
        Imatrix {
            entries,
            datasets: vec!["text.txt".into()],
            chunk_count: 1,
            chunk_size: 4,
            legacy: false,
        }
    }

    #[test]
    fn weights_divide_by_each_experts_count() {
        let m = sample();
        assert_eq!(
            m.weights("blk.0.attn_q.weight").unwrap(),
            vec![0.5, 1.0, 2.0]
        );
        // The expert that saw no token gets ones, as llama-quantize fills it.
        assert_eq!(
            m.weights("blk.0.ffn_up_exps.weight").unwrap(),
            vec![0.5, 1.5, 1.0, 1.0]
        );
        assert!(m.weights("output.weight").is_none());
    }

    #[test]
    fn gguf_and_dat_round_trip_to_the_same_weights() {
        let dir = tempfile::tempdir().unwrap();
        let m = sample();
        let g = dir.path().join("m.gguf");
        m.write_gguf(&g).unwrap();
        assert_eq!(Imatrix::read(&g).unwrap(), m);
        let d = dir.path().join("m.dat");
        m.write_dat(&d).unwrap();
        let back = Imatrix::read(&d).unwrap();
        assert!(back.legacy);
        assert_eq!(back.datasets, m.datasets);
        for name in m.entries.keys() {
            let (a, b) = (m.weights(name).unwrap(), back.weights(name).unwrap());
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-6 * x.abs(), "{name}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn refuses_what_llama_quantize_refuses() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = sample();
        m.entries.get_mut("blk.0.attn_q.weight").unwrap().sums[1] = f32::NAN;
        let p = dir.path().join("nan.gguf");
        m.write_gguf(&p).unwrap();
        let e = Imatrix::read(&p).unwrap_err().to_string();
        assert!(
            e.contains("blk.0.attn_q.weight") && e.contains("non-finite"),
            "{e}"
        );
        let p = dir.path().join("junk.dat");
        std::fs::write(&p, [0u8; 3]).unwrap();
        let e = Imatrix::read(&p).unwrap_err().to_string();
        assert!(e.contains("junk.dat"), "{e}");
        let p = dir.path().join("nometa.gguf");
        GgufWriter::create(&p, &[], &[("x.in_sum2".into(), vec![1, 1], 0)])
            .and_then(|mut w| {
                w.write_tensor("x.in_sum2", &1f32.to_le_bytes())?;
                w.finish()
            })
            .unwrap();
        let e = Imatrix::read(&p).unwrap_err().to_string();
        assert!(e.contains("missing imatrix metadata"), "{e}");
    }
}
