//! kiln's GGUF quantizers (`ops::gguf`) against llama.cpp's own: `tests/vectors/gguf_cases.json`,
//! written by `quantize_<type>` of ggml-quants.c (llama-cpp-python 0.3.36's sources, built
//! with `-ffp-contract=off`; `tests/vectors/gguf_gen.py`) for random, heavy-tailed, one-signed,
//! zero, constant, outlier and exact-grid inputs and all-zero groups inside non-zero blocks,
//! each without importance weights and (every
//! type that reads them) with two sets shaped like an imatrix's, one with dead columns. Every
//! output byte must match, and decoding
//! must give gguf-py's dequantized values (within 1e-6 relative: numpy may
//! associate a product differently).

use kiln_kernels::cpu;
use kiln_kernels::ops::gguf::{GgufType, dequantize, quantize, quantize_with};
use serde_json::Value;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn kiln_reproduces_llama_cpps_reference_quantizers_bit_for_bit() {
    let path = format!(
        "{}/tests/vectors/gguf_cases.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v["source"], "llama-cpp-python==0.3.36");
    let cases = v["cases"].as_array().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    let mut weighted = std::collections::BTreeSet::new();
    for case in cases {
        let name = case["type"].as_str().unwrap();
        let ty = *GgufType::ALL.iter().find(|t| t.name() == name).unwrap();
        seen.insert(name);
        let id = format!("{} {name}", case["input"]);
        let x: Vec<f32> = unhex(case["x"].as_str().unwrap())
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let cols = case["shape"][1].as_u64().unwrap() as usize;
        let want = unhex(case["q"].as_str().unwrap());
        let w: Option<Vec<f32>> = case["w"].as_str().map(|w| {
            unhex(w)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        });
        if w.is_some() {
            weighted.insert(name);
        }
        let mut got = vec![0u8; ty.bytes_for(x.len())];
        quantize_with(ty, &x, cols, w.as_deref(), &mut got).unwrap();
        if got != want {
            let block = got
                .chunks(ty.block_bytes())
                .zip(want.chunks(ty.block_bytes()))
                .position(|(a, b)| a != b)
                .unwrap();
            let b = ty.block_bytes();
            panic!(
                "{id}: block {block} differs\n kiln {:?}\n ggml {:?}",
                &got[block * b..(block + 1) * b],
                &want[block * b..(block + 1) * b]
            );
        }
        // The threaded driver writes the same bytes.
        let mut threaded = vec![0u8; got.len()];
        cpu::quantize_gguf_with(ty, &x, cols, w.as_deref(), &mut threaded).unwrap();
        assert!(
            threaded == got,
            "{id}: cpu::quantize_gguf differs from the reference"
        );
        let mut back = vec![0f32; x.len()];
        dequantize(ty, &got, &mut back).unwrap();
        let decoded: Vec<f32> = unhex(case["y"].as_str().unwrap())
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        for (i, (a, b)) in back.iter().zip(&decoded).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs(),
                "{id}: element {i} decodes to {a}, gguf-py {b}"
            );
        }
    }
    assert_eq!(seen.len(), GgufType::ALL.len(), "every type has cases");
    let reads_weights = GgufType::ALL
        .iter()
        .filter(|t| kiln_kernels::ops::gguf::weighted(**t))
        .count();
    assert_eq!(
        weighted.len(),
        reads_weights,
        "every weighted type has cases"
    );
}

/// Over many tasks (an input of several 64 KiB chunks), the threaded driver still writes the
/// reference's bytes.
#[test]
fn the_threaded_driver_equals_the_reference_on_a_large_input() {
    let (rows, cols) = (96, 1024);
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as u64 * 2_654_435_761 % 10_007) as f32 / 5003.5 - 1.0) * 0.02)
        .collect();
    let w: Vec<f32> = (0..cols).map(|i| 0.01 + (i % 17) as f32 * 0.3).collect();
    for ty in GgufType::ALL {
        let mut want = vec![0u8; ty.bytes_for(x.len())];
        let mut got = vec![0u8; want.len()];
        if kiln_kernels::ops::gguf::needs_weights(ty) {
            // IQ2_XXS / IQ2_XS without importance weights: refused by name, as ggml asserts.
            let e = quantize(ty, &x, cols, &mut want).unwrap_err().to_string();
            assert!(e.contains(ty.name()) && e.contains("importance"), "{e}");
            assert!(cpu::quantize_gguf(ty, &x, cols, &mut got).is_err());
        } else {
            quantize(ty, &x, cols, &mut want).unwrap();
            cpu::quantize_gguf(ty, &x, cols, &mut got).unwrap();
            assert!(got == want, "{}", ty.name());
        }
        quantize_with(ty, &x, cols, Some(&w), &mut want).unwrap();
        cpu::quantize_gguf_with(ty, &x, cols, Some(&w), &mut got).unwrap();
        assert!(got == want, "{} with importance weights", ty.name());
    }
}
