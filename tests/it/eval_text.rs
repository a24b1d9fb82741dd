//! `kiln eval --ctx N` (llama-perplexity's protocol on plain text) and `--kl-divergence`.
//!
//! The chunked score is checked against the whole-sample evaluation (`perplexity`), a separate
//! code path: by causality, the second half of a chunk's NLL is the chunk's total NLL less its
//! first `ctx/2 + 1` tokens' own total.

use crate::common;

use kiln_runtime::model::candle::{DType, Device};
use kiln_runtime::model::eval::{chunked, chunks, perplexity};

fn lcg(seed: &mut u64) -> u32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (*seed >> 33) as u32
}

#[test]
fn chunked_perplexity_is_the_second_halves_nll() {
    let model_dir = common::root().join("tests/compat/llama-tiny/model");
    let model =
        kiln_runtime::formats::load_model(&model_dir, DType::F32, &Device::Cpu, true).unwrap();
    let mut seed = 9;
    let ids: Vec<u32> = (0..3 * 64 + 17).map(|_| lcg(&mut seed) % 256).collect();
    let ctx = 64;
    let cs = chunks(&ids, ctx, Some(1));
    assert_eq!(cs.len(), 3);
    let e = chunked(&model, None, &cs, |_, _| {}).unwrap();
    assert_eq!(e.scored, 3 * (ctx - 1 - ctx / 2));
    // The same tokens through `perplexity`: per chunk, total NLL over the chunk minus that over
    // its first ctx/2 + 1 tokens.
    let mut second_halves = 0f64;
    for c in &cs {
        let whole = perplexity(&model, std::slice::from_ref(c)).unwrap();
        let head = perplexity(&model, &[c[..ctx / 2 + 1].to_vec()]).unwrap();
        second_halves += whole.nll * whole.predicted as f64 - head.nll * head.predicted as f64;
    }
    let want = (second_halves / e.scored as f64).exp();
    assert!(
        (e.perplexity - want).abs() <= 1e-4 * want,
        "chunked {} vs {want}",
        e.perplexity
    );
    // Against itself: no divergence, every top token the same.
    let same = chunked(&model, Some(&model), &cs, |_, _| {}).unwrap();
    let kl = same.kl.unwrap();
    assert_eq!((kl.mean, kl.max, kl.top1), (0.0, 0.0, 1.0));
    assert_eq!(kl.reference_perplexity, same.perplexity);
}

#[test]
fn eval_ctx_scores_text_and_compares_an_export_with_its_base() {
    let tmp = tempfile::tempdir().unwrap();
    let base = common::family("llama-tiny", tmp.path());
    let text: String = {
        let mut seed = 4;
        (0..3000)
            .map(|_| char::from(b'a' + (lcg(&mut seed) % 26) as u8))
            .collect()
    };
    let data = tmp.path().join("text.txt");
    std::fs::write(&data, &text).unwrap();
    let quant = tmp.path().join("w4a16");
    common::export("compressed-tensors", &base, &quant, "w4a16");
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (b, d, q) = (
        base.to_str().unwrap(),
        data.to_str().unwrap(),
        quant.to_str().unwrap(),
    );
    let (ok, out, err) = run(&[
        "eval",
        "--model",
        q,
        "--data",
        d,
        "--ctx",
        "128",
        "--kl-divergence",
        b,
        "--tokenizer",
        base.join("tokenizer.json").to_str().unwrap(),
        "--json",
    ]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    // 3000 letters are 3000 tokens: 23 chunks of 128, 63 scored in each.
    assert_eq!(v["chunks"], 23);
    assert_eq!(v["scored_tokens"], 23 * 63);
    let kl = &v["kl_divergence"];
    assert!(kl["mean"].as_f64().unwrap() > 0.0, "{v}");
    assert!(kl["p99"].as_f64().unwrap() >= kl["median"].as_f64().unwrap());
    assert!(kl["same_top1"].as_f64().unwrap() > 0.5, "{v}");
    let dppl = kl["delta_perplexity"].as_f64().unwrap();
    let (p, rp) = (
        v["perplexity"].as_f64().unwrap(),
        kl["reference_perplexity"].as_f64().unwrap(),
    );
    assert!((p - rp - dppl).abs() < 1e-9);
    // The base scored alone gives the reference's perplexity.
    let (ok, out, err) = run(&["eval", "--model", b, "--data", d, "--ctx", "128", "--json"]);
    assert!(ok, "{err}");
    let alone: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!((alone["perplexity"].as_f64().unwrap() - rp).abs() < 1e-9 * rp);
    // In bf16 (the weights and the activations rounded): close to f32's, not the same numbers.
    let (ok, out, err) = run(&[
        "eval", "--model", b, "--data", d, "--ctx", "128", "--dtype", "bf16", "--json",
    ]);
    assert!(ok, "{err}");
    let bf16 = serde_json::from_str::<serde_json::Value>(&out).unwrap()["perplexity"]
        .as_f64()
        .unwrap();
    assert!(
        bf16 != rp && (bf16 - rp).abs() < 0.01 * rp,
        "bf16 perplexity {bf16} against f32's {rp}"
    );
    // Too little text for one chunk is a named error.
    let (ok, _, err) = run(&["eval", "--model", b, "--data", d, "--ctx", "4096"]);
    assert!(
        !ok && err.contains("fewer than one chunk of --ctx 4096"),
        "{err}"
    );
}
