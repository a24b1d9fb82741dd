//! The output folder's transaction and the shard writer, read back independently.

use super::*;
use safetensors::{Dtype, SafeTensors};

fn tensor(i: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|k| i.wrapping_mul(31).wrapping_add(k as u8))
        .collect()
}

fn write_five(dir: &Path, max: u64) -> WrittenShards {
    let mut w = ShardWriter::new(dir, max);
    for i in 0..5u8 {
        w.write(
            &format!("layer.{i}.weight"),
            Dtype::BF16,
            &[4, 5],
            &tensor(i, 40),
        )
        .unwrap();
    }
    w.finish().unwrap()
}

#[test]
fn shards_split_at_the_size_limit_and_read_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let written = write_five(dir.path(), 100);
    assert_eq!(
        written.files,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors"
        ]
    );
    assert_eq!((written.total_bytes, written.tensors), (200, 5));
    let index: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(dir.path().join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"]["total_size"], 200);
    assert_eq!(
        index["weight_map"]["layer.4.weight"],
        "model-00003-of-00003.safetensors"
    );
    assert_eq!(
        index["weight_map"]["layer.1.weight"],
        "model-00001-of-00003.safetensors"
    );
    // The safetensors crate, reading independently, sees the same tensors.
    for (file, names) in [(&written.files[0], [0u8, 1]), (&written.files[1], [2, 3])] {
        let bytes = fs::read(dir.path().join(file)).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for i in names {
            let t = st.tensor(&format!("layer.{i}.weight")).unwrap();
            assert_eq!((t.dtype(), t.shape()), (Dtype::BF16, &[4usize, 5][..]));
            assert_eq!(t.data(), &tensor(i, 40)[..]);
        }
    }
    // And kiln's own reader opens the folder as a checkpoint.
    fs::write(dir.path().join("config.json"), r#"{"architectures":["X"]}"#).unwrap();
    let c = crate::checkpoint::Checkpoint::open(dir.path()).unwrap();
    let mut buf = Vec::new();
    c.read("layer.4.weight", &mut buf).unwrap();
    assert_eq!(buf, tensor(4, 40));
    // No scratch files remain.
    let leftovers: Vec<_> = fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            n.starts_with('.').then_some(n)
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn one_shard_is_model_safetensors_without_an_index_and_big_tensors_get_their_own_shard() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(write_five(dir.path(), 1 << 20).files, ["model.safetensors"]);
    assert!(!dir.path().join("model.safetensors.index.json").exists());

    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardWriter::new(dir.path(), 50);
    w.write("small", Dtype::U8, &[10], &[1; 10]).unwrap();
    w.write("big", Dtype::U8, &[80], &[2; 80]).unwrap();
    w.write("small2", Dtype::U8, &[10], &[3; 10]).unwrap();
    assert_eq!(w.finish().unwrap().files.len(), 3);
}

#[test]
fn the_same_tensors_give_the_same_bytes() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let fa = write_five(a.path(), 100);
    write_five(b.path(), 100);
    for f in fa
        .files
        .iter()
        .chain(std::iter::once(&"model.safetensors.index.json".to_string()))
    {
        assert_eq!(
            fs::read(a.path().join(f)).unwrap(),
            fs::read(b.path().join(f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn bad_tensors_are_named_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardWriter::new(dir.path(), 100);
    let err = w
        .write("w", Dtype::F32, &[2, 2], &[0; 15])
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "tensor `w`: 15 bytes, but shape [2, 2] of F32 needs 16"
    );
    w.write("w", Dtype::F32, &[2, 2], &[0; 16]).unwrap();
    assert_eq!(
        w.write("w", Dtype::F32, &[2, 2], &[0; 16])
            .unwrap_err()
            .to_string(),
        "tensor `w` was written twice"
    );
}

#[test]
fn output_appears_only_on_commit() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("out");
    {
        let out = OutputDir::create(&target, false).unwrap();
        fs::write(out.path().join("config.json"), "{}").unwrap();
        assert!(!target.exists(), "nothing at the target before commit");
        // Dropped without commit: a failed export leaves nothing behind.
    }
    assert!(!target.exists());
    assert_eq!(
        fs::read_dir(root.path()).unwrap().count(),
        0,
        "the temporary folder is removed"
    );

    let out = OutputDir::create(&target, false).unwrap();
    fs::write(out.path().join("config.json"), "{\"v\":1}").unwrap();
    assert_eq!(out.commit().unwrap(), target);
    assert_eq!(
        fs::read_to_string(target.join("config.json")).unwrap(),
        "{\"v\":1}"
    );
    assert_eq!(fs::read_dir(root.path()).unwrap().count(), 1);
}

#[test]
fn an_existing_target_is_replaced_only_with_force() {
    let root = tempfile::tempdir().unwrap();
    let target = root.path().join("out");
    fs::create_dir(&target).unwrap();
    fs::write(target.join("old.txt"), "old").unwrap();
    let err = OutputDir::create(&target, false).unwrap_err().to_string();
    assert!(
        err.ends_with("out already exists (pass --force to replace it)"),
        "{err}"
    );
    assert!(
        target.join("old.txt").exists(),
        "the existing folder is untouched"
    );

    let out = OutputDir::create(&target, true).unwrap();
    fs::write(out.path().join("new.txt"), "new").unwrap();
    out.commit().unwrap();
    assert!(target.join("new.txt").exists() && !target.join("old.txt").exists());
    assert_eq!(
        fs::read_dir(root.path()).unwrap().count(),
        1,
        "no leftover folders"
    );
}

#[test]
fn a_header_larger_than_its_room_still_gives_a_valid_shard() {
    // 4 KiB of room; 200 tensors with long names need more.
    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardWriter::new(dir.path(), 1 << 20).with_header_room(4096);
    let long = "x".repeat(60);
    for i in 0..200u8 {
        w.write(&format!("{long}.{i}.weight"), Dtype::U8, &[3], &[i, i, i])
            .unwrap();
    }
    assert_eq!(w.finish().unwrap().files, ["model.safetensors"]);
    let bytes = fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(
        st.tensor(&format!("{long}.199.weight")).unwrap().data(),
        &[199, 199, 199]
    );
    assert_eq!(st.len(), 200);
}

/// Renames that fail at the `fail_at`-th call (from 1), over a filesystem with or without an
/// atomic exchange.
struct Faulty {
    fail_at: usize,
    calls: std::cell::Cell<usize>,
    exchange: bool,
}

impl Faulty {
    fn tick(&self) -> std::io::Result<()> {
        let n = self.calls.get() + 1;
        self.calls.set(n);
        if n == self.fail_at {
            return Err(std::io::Error::other("injected rename failure"));
        }
        Ok(())
    }
}

impl DirOps for Faulty {
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.tick()?;
        fs::rename(from, to)
    }

    fn exchange(&self, a: &Path, b: &Path) -> std::io::Result<bool> {
        if !self.exchange {
            return Ok(false);
        }
        self.tick()?;
        RealFs.exchange(a, b)
    }
}

/// The target's files and contents, or `None` when it is missing.
fn snapshot(dir: &Path) -> Option<Vec<(String, Vec<u8>)>> {
    let mut v: Vec<_> = fs::read_dir(dir)
        .ok()?
        .map(|e| {
            let p = e.unwrap().path();
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                fs::read(&p).unwrap(),
            )
        })
        .collect();
    v.sort();
    Some(v)
}

#[test]
fn a_failing_rename_leaves_the_old_target_or_the_new_one() {
    // Every rename of the commit fails in turn, with and without an atomic exchange, over an
    // existing target and over none: the target is then the complete old folder (or absent
    // when there was none), a retry succeeds, and no temporary folder is left behind.
    for exchange in [true, false] {
        for had_target in [true, false] {
            for fail_at in 1..=3 {
                let dir = tempfile::tempdir().unwrap();
                let target = dir.path().join("out");
                if had_target {
                    fs::create_dir(&target).unwrap();
                    fs::write(target.join("model.safetensors"), b"old weights").unwrap();
                    fs::write(target.join("config.json"), b"old config").unwrap();
                }
                let before = snapshot(&target);
                let write = || {
                    let out = OutputDir::create(&target, true).unwrap();
                    fs::write(out.path().join("model.safetensors"), b"new weights").unwrap();
                    out
                };
                let ops = Faulty {
                    fail_at,
                    calls: Default::default(),
                    exchange,
                };
                let result = write().commit_with(&ops);
                let case = format!("exchange {exchange}, target {had_target}, fail at {fail_at}");
                let new = Some(vec![("model.safetensors".into(), b"new weights".to_vec())]);
                match result {
                    Err(e) => {
                        assert!(e.to_string().contains("injected rename failure"), "{case}");
                        assert_eq!(snapshot(&target), before, "{case}");
                        let again = write().commit_with(&RealFs);
                        assert!(again.is_ok(), "{case}: {again:?}");
                    }
                    // Fewer renames than `fail_at` were needed.
                    Ok(_) => assert!(ops.calls.get() < fail_at, "{case}"),
                }
                assert_eq!(snapshot(&target), new, "{case}");
                let left: Vec<_> = fs::read_dir(dir.path())
                    .unwrap()
                    .map(|e| e.unwrap().file_name())
                    .collect();
                assert_eq!(left, ["out"], "{case}");
            }
        }
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_replaced_target_is_swapped_in_one_step() {
    // On Linux the old and new folders trade places atomically (renameat2 RENAME_EXCHANGE):
    // a file opened in the old folder before the commit is unaffected, and no `.old` name is
    // ever used.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out");
    fs::create_dir(&target).unwrap();
    fs::write(target.join("a"), b"old").unwrap();
    let out = OutputDir::create(&target, true).unwrap();
    fs::write(out.path().join("a"), b"new").unwrap();
    let ops = Faulty {
        fail_at: 0,
        calls: Default::default(),
        exchange: true,
    };
    out.commit_with(&ops).unwrap();
    assert_eq!(ops.calls.get(), 1, "one exchange, no renames");
    assert_eq!(fs::read(target.join("a")).unwrap(), b"new");
}

#[cfg(target_os = "linux")]
#[test]
fn what_a_killed_run_left_is_cleared_and_a_stranded_old_target_restored() {
    // Process ids above Linux's pid_max (2^22) are never running.
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("out");
    let dead = dir.path().join(".out.kiln-partial-999999991");
    let stranded = dir.path().join(".out.kiln-partial-999999992.old");
    let live = dir
        .path()
        .join(format!(".out.kiln-partial-{}", std::process::id()));
    let other = dir.path().join(".other.kiln-partial-999999993");
    for d in [&dead, &stranded, &live, &other] {
        fs::create_dir(d).unwrap();
    }
    fs::write(stranded.join("model.safetensors"), b"old weights").unwrap();
    sweep_stale(dir.path(), "out", &target).unwrap();
    assert_eq!(
        snapshot(&target),
        Some(vec![("model.safetensors".into(), b"old weights".to_vec())]),
        "the old target is back"
    );
    assert!(!dead.exists() && !stranded.exists());
    assert!(live.exists(), "this process's own folder is not touched");
    assert!(other.exists(), "another target's folders are not touched");
    // With the target restored, a run without --force is refused, as before the killed one.
    assert!(matches!(
        OutputDir::create(&target, false),
        Err(SinkError::Exists { .. })
    ));
}
