//! Fault injection against the `kiln` binary: processes killed (SIGKILL) or interrupted (SIGINT)
//! at points spread over an export, a calibrating export and a training run with checkpoints,
//! and writes that fail part-way (a file-size limit: the disk "fills" after N bytes). After each
//! fault the output is the complete old state or the complete new one — never a mix, never a
//! partial file under a final name — a rerun succeeds (and gives exactly the uninterrupted
//! result), and the input model is byte-identical to what it was.
//!
//! Failing renames are injected in the sink's unit tests (runtime/src/sink/tests.rs).

#![cfg(unix)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn kiln() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.env("NO_COLOR", "1");
    c
}

fn run(args: &[&str]) -> Output {
    kiln().args(args).output().unwrap()
}

fn ok(args: &[&str]) -> Duration {
    let t = Instant::now();
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    t.elapsed()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Every file under `dir` (relative path → bytes), or `None` when `dir` does not exist. Hidden
/// entries (a killed run's temporary folders) are listed separately by [`hidden`].
fn files(dir: &Path) -> Option<BTreeMap<String, Vec<u8>>> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            if p.file_name().unwrap().to_string_lossy().starts_with('.') {
                continue;
            }
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    if !dir.exists() {
        return None;
    }
    walk(dir, dir, &mut out);
    Some(out)
}

/// The hidden entries of `dir`.
fn hidden(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    v.sort();
    v
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        let to = dst.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &to);
        } else {
            std::fs::copy(&p, &to).unwrap();
        }
    }
}

fn reset(dir: &Path, to: Option<&Path>) {
    if dir.exists() {
        std::fs::remove_dir_all(dir).unwrap();
    }
    if let Some(src) = to {
        copy_dir(src, dir);
    }
}

#[derive(Clone, Copy, Debug)]
enum Signal {
    Kill,
    Int,
}

/// Runs `args`, and `after` into the run sends `signal`; true when the process had already
/// finished by then.
fn interrupt(args: &[&str], after: Duration, signal: Signal) -> bool {
    let mut child = kiln()
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(after);
    let finished = child.try_wait().unwrap().is_some();
    if !finished {
        match signal {
            Signal::Kill => {
                let _ = child.kill();
            }
            Signal::Int => {
                let _ = Command::new("kill")
                    .args(["-INT", &child.id().to_string()])
                    .status();
            }
        }
    }
    child.wait().unwrap();
    finished
}

/// The fractions of a run's measured duration at which the faults land: spread over the whole
/// run (start-up, reading, quantizing, writing, committing), from a fixed seed.
fn points(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed;
    (0..n)
        .map(|i| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let jitter = (x >> 33) as f64 / (1u64 << 31) as f64;
            (i as f64 + jitter) / n as f64 * 1.1
        })
        .collect()
}

/// The old state the faults are injected over: an FP8 export of `model` (its `amax.json`).
fn export_fp8(model: &Path, to: &Path) {
    let amax = model.join("amax.json");
    ok(&[
        "export",
        "--model",
        s(model),
        "--format",
        "fp8",
        "--act-amax",
        s(&amax),
        "--out",
        s(to),
    ]);
}

fn demo_model(dir: &Path) -> PathBuf {
    let model = dir.join("model");
    ok(&["demo-model", "--out", s(&model)]);
    model
}

#[test]
fn an_export_killed_anywhere_leaves_the_old_output_or_the_new_one() {
    // Over an existing export (fp8) an nvfp4 export runs with --force and is killed or
    // interrupted; with --act-amax and with --calib (the forward pass over the samples).
    let dir = tempfile::tempdir().unwrap();
    let model = demo_model(dir.path());
    let input = files(&model);
    let calib = dir.path().join("calib.jsonl");
    std::fs::write(
        &calib,
        "{\"text\": \"The quick brown fox jumps over the lazy dog.\"}\n\
         {\"text\": \"kiln turns trained models into deployable ones.\"}\n",
    )
    .unwrap();
    let amax = model.join("amax.json");
    let (old, new, out) = (
        dir.path().join("old"),
        dir.path().join("new"),
        dir.path().join("out"),
    );
    export_fp8(&model, &old);
    let old_files = files(&old);
    for (name, scales, n) in [
        ("act-amax", ["--act-amax", s(&amax)], 6),
        ("calib", ["--calib", s(&calib)], 4),
    ] {
        let args = || {
            let mut a = vec!["export", "--model", s(&model), "--format", "nvfp4"];
            a.extend(scales);
            a.extend(["--force", "--out", s(&out)]);
            a
        };
        reset(&new, None);
        reset(&out, None);
        let took = ok(&args());
        std::fs::rename(&out, &new).unwrap();
        let new_files = files(&new);
        assert_ne!(new_files, old_files);
        let (mut saw_old, mut saw_new) = (0, 0);
        for (i, at) in points(n, n as u64).into_iter().enumerate() {
            let signal = if i % 2 == 0 {
                Signal::Kill
            } else {
                Signal::Int
            };
            reset(&out, Some(&old));
            let finished = interrupt(&args(), took.mul_f64(at), signal);
            let state = files(&out);
            let case = format!("{name}: {signal:?} at {:.0} % of the run", at * 100.0);
            if state == old_files {
                saw_old += 1;
                assert!(
                    !finished,
                    "{case}: the run finished, yet the old output is there"
                );
            } else {
                assert!(
                    state == new_files,
                    "{case}: neither the old output nor the new"
                );
                saw_new += 1;
            }
            // A rerun succeeds, clears what the killed run left, and gives the same export.
            ok(&args());
            assert!(files(&out) == new_files, "{case}: the rerun differs");
            assert_eq!(hidden(dir.path()), Vec::<String>::new(), "{case}");
        }
        eprintln!("{name}: {n} faults, {saw_old} left the old output, {saw_new} the new one");
        assert!(saw_old > 0, "{name}: no fault landed before the commit");
    }
    assert!(files(&model) == input, "the input model changed");
}

#[test]
fn a_full_disk_fails_the_export_by_name_and_leaves_the_old_output() {
    // The shell sets a file-size limit (the disk is "full" after N KiB; SIGXFSZ ignored, so the
    // write returns EFBIG) before it runs kiln.
    let dir = tempfile::tempdir().unwrap();
    let model = demo_model(dir.path());
    let input = files(&model);
    let amax = model.join("amax.json");
    let (old, out) = (dir.path().join("old"), dir.path().join("out"));
    export_fp8(&model, &old);
    let old_files = files(&old);
    for kib in [0, 1, 64, 4096, 12000] {
        reset(&out, Some(&old));
        let run = Command::new("bash")
            .arg("-c")
            .arg(format!(
                "trap '' XFSZ; ulimit -f {kib}; exec \"$0\" \"$@\"; exit 99"
            ))
            .arg(env!("CARGO_BIN_EXE_kiln"))
            .args([
                "export",
                "--model",
                s(&model),
                "--format",
                "nvfp4",
                "--act-amax",
            ])
            .args([s(&amax), "--force", "--out", s(&out)])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{kib} KiB: {stderr}");
        assert!(
            stderr.contains(".shard-00001.safetensors: File too large"),
            "{kib} KiB: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{kib} KiB: {stderr}");
        assert!(
            files(&out) == old_files,
            "{kib} KiB: the old output changed"
        );
        assert_eq!(hidden(dir.path()), Vec::<String>::new(), "{kib} KiB");
    }
    ok(&[
        "export",
        "--model",
        s(&model),
        "--format",
        "nvfp4",
        "--act-amax",
        s(&amax),
        "--force",
        "--out",
        s(&out),
    ]);
    assert!(files(&out) != old_files);
    assert!(files(&model) == input, "the input model changed");
}

/// The checkpoints of a training output: each complete (its five files, `global_step` equal to
/// its name), returned by step.
fn complete_checkpoints(out: &Path, case: &str) -> Vec<u64> {
    let mut steps = Vec::new();
    let Ok(entries) = std::fs::read_dir(out) else {
        return steps;
    };
    for e in entries {
        let e = e.unwrap();
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(step) = name.strip_prefix("checkpoint-") else {
            continue;
        };
        let step: u64 = step.parse().unwrap();
        let p = e.path();
        for f in [
            "adapter_config.json",
            "adapter_model.safetensors",
            "trainable.safetensors",
            "optimizer.safetensors",
            "trainer_state.json",
        ] {
            assert!(p.join(f).is_file(), "{case}: {name} lacks {f}");
        }
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(p.join("trainer_state.json")).unwrap())
                .unwrap_or_else(|e| panic!("{case}: {name}/trainer_state.json: {e}"));
        assert_eq!(state["global_step"], step, "{case}: {name}");
        for f in ["trainable.safetensors", "optimizer.safetensors"] {
            let bytes = std::fs::read(p.join(f)).unwrap();
            safetensors::SafeTensors::deserialize(&bytes)
                .unwrap_or_else(|e| panic!("{case}: {name}/{f}: {e}"));
        }
        steps.push(step);
    }
    steps.sort();
    steps
}

#[test]
fn training_killed_anywhere_keeps_whole_checkpoints_and_resumes_exactly() {
    // sft with a checkpoint every step and only the newest two kept (saves and rotations all
    // through the run), killed or interrupted; then resumed from the newest checkpoint: the
    // final adapter is the uninterrupted run's, bit for bit.
    let dir = tempfile::tempdir().unwrap();
    let model = demo_model(dir.path());
    let input = files(&model);
    let (reference, out) = (dir.path().join("reference"), dir.path().join("out"));
    let args = |to: &Path| {
        vec![
            "train".to_string(),
            "--task".into(),
            "sft".into(),
            "--model".into(),
            s(&model).into(),
            "--max-steps".into(),
            "5".into(),
            "--save-steps".into(),
            "1".into(),
            "--save-total-limit".into(),
            "2".into(),
            "--quiet".into(),
            "--out".into(),
            s(to).into(),
        ]
    };
    let took = ok(&strs(&args(&reference)));
    let adapter = |d: &Path| std::fs::read(d.join("adapter_model.safetensors")).ok();
    let want = adapter(&reference).unwrap();
    let kept = complete_checkpoints(&reference, "the uninterrupted run");
    assert_eq!(kept.len(), 2, "{kept:?}");
    let mut resumed_from = Vec::new();
    for (i, at) in points(6, 3).into_iter().enumerate() {
        let signal = if i % 2 == 0 {
            Signal::Kill
        } else {
            Signal::Int
        };
        reset(&out, None);
        let finished = interrupt(&strs(&args(&out)), took.mul_f64(at), signal);
        let case = format!("{signal:?} at {:.0} % of the run", at * 100.0);
        let steps = complete_checkpoints(&out, &case);
        assert!(steps.len() <= 3, "{case}: rotation kept {steps:?}");
        // The final adapter is there whole, or not at all. SIGINT stops a run after its
        // current step and saves what it has (exit 130): a whole adapter of fewer steps.
        match adapter(&out) {
            Some(bytes) => {
                assert!(out.join("adapter_config.json").is_file(), "{case}");
                if matches!(signal, Signal::Int) && !finished {
                    safetensors::SafeTensors::deserialize(&bytes)
                        .unwrap_or_else(|e| panic!("{case}: the saved adapter: {e}"));
                } else {
                    assert!(
                        bytes == want,
                        "{case}: a final adapter that is not the run's"
                    );
                }
            }
            None => assert!(!out.join("adapter_config.json").exists(), "{case}"),
        }
        let mut again = args(&out);
        match steps.last() {
            Some(step) => {
                let from = out.join(format!("checkpoint-{step}"));
                again.extend(["--resume".into(), s(&from).into()]);
            }
            None => again.push("--force".into()),
        }
        resumed_from.push(steps.last().copied());
        ok(&strs(&again));
        assert!(
            adapter(&out).unwrap() == want,
            "{case}: the resumed run differs"
        );
        assert_eq!(
            complete_checkpoints(&out, &case),
            kept,
            "{case}: after the rerun"
        );
    }
    eprintln!("resumed from checkpoints {resumed_from:?}");
    assert!(files(&model) == input, "the input model changed");
}

#[test]
fn a_full_disk_fails_a_checkpoint_save_by_name_and_leaves_no_half_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let model = demo_model(dir.path());
    let out = dir.path().join("out");
    let run = Command::new("bash")
        .arg("-c")
        .arg("trap '' XFSZ; ulimit -f 16; exec \"$0\" \"$@\"; exit 99")
        .arg(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "train",
            "--task",
            "sft",
            "--model",
            s(&model),
            "--max-steps",
            "2",
        ])
        .args(["--save-steps", "1", "--quiet", "--out", s(&out)])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("File too large") && stderr.contains(".checkpoint-1.partial"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(complete_checkpoints(&out, "full disk"), Vec::<u64>::new());
    assert_eq!(
        hidden(&out),
        Vec::<String>::new(),
        "the partial save is removed"
    );
}
