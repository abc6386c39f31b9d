//! Parity of `tallow_model::kernels::blockwise8` with bitsandbytes 0.50.2 (fixture written by
//! `scripts/make_quant_fixtures.py`: `tests/fixtures/reference/quant-dynamic.safetensors`).

use candle_core::{DType, Device, Tensor};
use tallow_model::kernels::blockwise8::{dequantize_blockwise, dynamic_map, quantize_blockwise};
use tallow_tests::fixtures;

fn load() -> (
    std::collections::HashMap<String, Tensor>,
    Vec<(String, bool)>,
) {
    let path = fixtures()
        .join("reference")
        .join("quant-dynamic.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let cases = meta.metadata().as_ref().unwrap()["cases"]
        .split(',')
        .map(|c| {
            let (name, kind) = c.split_once(':').unwrap();
            (name.to_string(), kind == "signed")
        })
        .collect();
    (
        candle_core::safetensors::load(&path, &Device::Cpu).unwrap(),
        cases,
    )
}

#[test]
fn dynamic_maps_equal_bitsandbytes() {
    let (t, _) = load();
    for (signed, key) in [(true, "map.signed"), (false, "map.unsigned")] {
        let bnb = t[key].to_vec1::<f32>().unwrap();
        let ours = dynamic_map(signed);
        for (j, (a, b)) in ours.iter().zip(&bnb).enumerate() {
            assert!((a - b).abs() <= 1e-7, "{key}[{j}]: {a} vs bitsandbytes {b}");
        }
        // in fact bit for bit (same torch linspace arithmetic)
        assert_eq!(ours.as_slice(), bnb.as_slice(), "{key}");
    }
}

#[test]
fn blockwise_codes_equal_bitsandbytes_reference_backend() {
    let (t, cases) = load();
    assert_eq!(cases.len(), 4);
    for (name, signed) in cases {
        let x = &t[&format!("{name}.x")];
        let q = quantize_blockwise(x, signed, 256).unwrap();
        let codes = q.codes.to_vec1::<u8>().unwrap();
        let bnb_codes = t[&format!("{name}.codes")].to_vec1::<u8>().unwrap();
        assert_eq!(codes.len(), bnb_codes.len(), "{name}");
        let diff = codes.iter().zip(&bnb_codes).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "{name}: {diff} codes differ from bitsandbytes");
        assert_eq!(
            q.absmax.to_vec1::<f32>().unwrap(),
            t[&format!("{name}.absmax")].to_vec1::<f32>().unwrap(),
            "{name}: absmax"
        );
        // dequantization is map[code] * absmax: finite, exact zeros for the zero block
        let back = dequantize_blockwise(&q).unwrap();
        assert_eq!(back.dims(), x.dims());
        let back = back.to_vec1::<f32>().unwrap();
        assert!(back.iter().all(|v| v.is_finite()), "{name}");
        let xs = x.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        if name != "adam_m" {
            assert!(xs[256..512].iter().all(|&v| v == 0.0));
            assert!(back[256..512].iter().all(|&v| v == 0.0), "{name}");
        }
    }
}

/// bitsandbytes' native CPU kernel (`csrc/cpu_ops.cpp`, a `BinSearch::Direct2` lookup) is not
/// exactly nearest, notably near 0 (0.0 itself gets the code 2.1e-5 with the signed map), so it
/// differs from the reference backend and from us on many elements of these multi-decade inputs.
/// The tolerance: our code is never farther from x/absmax than the native one, and the two
/// dequantized values are within 0.015 * absmax of each other.
#[test]
fn native_cpu_kernel_of_bitsandbytes_is_within_its_stated_tolerance() {
    let (t, cases) = load();
    let mut differing = 0;
    for (name, signed) in cases {
        let map = dynamic_map(signed);
        let x = t[&format!("{name}.x")]
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let q = quantize_blockwise(&t[&format!("{name}.x")], signed, 256).unwrap();
        let ours = q.codes.to_vec1::<u8>().unwrap();
        let absmax = q.absmax.to_vec1::<f32>().unwrap();
        let native = t[&format!("{name}.codes_cpu_native")]
            .to_vec1::<u8>()
            .unwrap();
        for (i, ((&v, &o), &n)) in x.iter().zip(&ours).zip(&native).enumerate() {
            let a = absmax[i / 256];
            if a == 0.0 || o == n {
                continue; // a zero block: native normalizes 0/0 = NaN, any code dequantizes to 0
            }
            differing += 1;
            let normed = v * (1.0 / a);
            let (mo, mn) = (map[o as usize], map[n as usize]);
            assert!(
                (normed - mo).abs() <= (normed - mn).abs(),
                "{name}[{i}]: ours {mo} farther from {normed} than native {mn}"
            );
            assert!((mo - mn).abs() <= 0.015, "{name}[{i}]: {mo} vs native {mn}");
        }
    }
    // the fixture does exercise the difference
    assert!(differing > 100, "{differing}");
}

#[test]
fn codes_are_fixed_points_of_dequantize_then_quantize() {
    // (The generic tensor-op path is compared with the CPU kernel bit for bit in the model
    // crate's unit tests.)
    let (t, cases) = load();
    for (name, signed) in cases {
        let q = quantize_blockwise(&t[&format!("{name}.x")], signed, 256).unwrap();
        let back = dequantize_blockwise(&q).unwrap();
        let q2 = quantize_blockwise(&back, signed, 256).unwrap();
        let (c1, c2) = (
            q.codes.to_vec1::<u8>().unwrap(),
            q2.codes.to_vec1::<u8>().unwrap(),
        );
        let same = c1.iter().zip(&c2).filter(|(a, b)| a == b).count();
        // the block's largest element maps back to exactly absmax (code 1.0), so absmax is kept
        // and (almost) every code is a fixed point; a rounding of map*absmax may move one across
        assert!(
            same as f64 >= 0.999 * c1.len() as f64,
            "{name}: {same}/{}",
            c1.len()
        );
    }
}
