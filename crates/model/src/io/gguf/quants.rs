//! llama.cpp's reference quantizers for the block formats of its k-quant files (Q3_K, Q4_K, Q5_K,
//! Q6_K, and the Q4_0 / Q5_0 / Q5_1 / Q8_0 that llama-quantize falls back to for rows that are
//! not whole 256-value blocks), so that `tallow export --outtype q4_k_m` (and the other k-quant
//! mixes) writes `llama-quantize`'s bytes. Candle's own k-quant
//! quantizer is an older algorithm with other blocks (docs/gguf.md).
//!
//! Ported from ggml's `ggml/src/ggml-quants.c` (`nearest_int`, `make_qx_quants`,
//! `make_qkx2_quants`, `make_q3_quants`, `quantize_row_q3_K_ref`, `quantize_row_q4_K_ref`,
//! `quantize_row_q5_K_ref`, `quantize_row_q6_K_ref`, `quantize_row_q4_0_ref`,
//! `quantize_row_q5_0_ref`, `quantize_row_q5_1_ref`, `quantize_row_q8_0_ref`) as vendored by llama-cpp-python 0.3.36 (MIT licence, copyright the
//! ggml authors), the code `llama-quantize` runs without an importance matrix. Every float
//! operation is kept in C's order and in f32, so the blocks are the same bit for bit as those of
//! a build without fused multiply-adds (the x86-64 baseline, `GGML_NATIVE=OFF`; a `-march=native`
//! build may contract some products into FMAs and round differently). tests/tests/gguf.rs
//! compares with llama-quantize's file.

use half::f16;

/// Values per k-quant super-block.
const QK_K: usize = 256;

/// `GROUP_MAX_EPS`: below it a group is all zeros.
const GROUP_MAX_EPS: f32 = 1e-15;

/// Round to nearest (ties to even) through the float's mantissa, as ggml does (|f| < 2^22).
fn nearest_int(f: f32) -> i32 {
    let val = f + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

fn fp16(v: f32) -> f16 {
    f16::from_f32(v)
}

/// The value of largest magnitude in `x` (the first of equal ones) and that magnitude: the
/// `max` / `amax` search ggml's quantizers each open with.
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    (max, amax)
}

/// `make_qx_quants` with `qw` NULL: a scale for `x` and its codes `l` (0..2 nmax), the error
/// weighted as `rmse_type` says (1: x², the only one Q6_K uses).
fn make_qx_quants(x: &[f32], nmax: i32, l: &mut [i8], rmse_type: i32) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.iter_mut().for_each(|q| *q = 0);
        return 0.0;
    }
    let code = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let weight = |v: f32| match rmse_type {
        1 => v * v,
        2 => 1.0,
        3 => v.abs(),
        _ => v.abs().sqrt(),
    };
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (q, &v) in l.iter_mut().zip(x) {
        let c = code(iscale, v);
        *q = (c + nmax) as i8;
        let w = weight(v);
        sumlx += w * v * c as f32;
        suml2 += w * c as f32 * c as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (mut sumlx, mut suml2) = (0f32, 0f32);
        for &v in x {
            let c = code(iscale, v);
            let w = weight(v);
            sumlx += w * v * c as f32;
            suml2 += w * c as f32 * c as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (q, &v) in l.iter_mut().zip(x) {
                *q = (nmax + code(iscale, v)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_qkx2_quants`: a scale and a min for `x` (codes 0..nmax in `l`), searched over `nstep`
/// rescalings; returns (scale, -min).
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    l: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.iter_mut().for_each(|q| *q = 0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * l[i] as f32 + min - x[i];
        best_error += weights[i] * (diff * diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let (w, q) = (weights[i], q as f32);
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// `get_scale_min_k4`: sub-block j's 6-bit scale and min from a Q4_K block's 12 scale bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The scales and codes of one 256-value block of Q4_K or Q5_K (`quantize_row_q{4,5}_K_ref`
/// before packing): each 32-value sub-block's scale and min searched by `make_qkx2_quants` over
/// codes 0..nmax (from `rmin`, `nstep` steps), both quantized to 6 bits against the block's
/// largest (d, dmin: f16), then the codes recomputed with the quantized ones. Returns (d, dmin,
/// the 12 bytes of scales and mins, the codes).
fn k_block(x: &[f32], nmax: i32, rmin: f32, nstep: i32) -> (f16, f16, [u8; 12], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let (mut mins, mut scales) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        let (scale, min) = make_qkx2_quants(
            xs,
            &weights,
            nmax,
            &mut l[32 * j..32 * j + 32],
            &mut laux,
            rmin,
            0.1,
            nstep,
        );
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut sc = [0u8; 12];
    for j in 0..8 {
        // C stores nearest_int's int in a uint8_t (mod 256), then takes MIN(63, ...).
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    let d = fp16(max_scale / 63.0);
    let dmin = fp16(max_min / 63.0);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &sc);
        let dj = d.to_f32() * s as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for ii in 0..32 {
            let q = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax);
            l[32 * j + ii] = q as u8;
        }
    }
    (d, dmin, sc, l)
}

/// `quantize_row_q4_K_ref`: 144 bytes per 256 values (d, dmin: f16; 12 bytes of 6-bit scales
/// and mins for 8 sub-blocks of 32; 128 bytes of 4-bit codes).
pub fn q4_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * 144);
    for x in x.chunks_exact(QK_K) {
        let (d, dmin, sc, l) = k_block(x, 15, -1.0, 20);
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
        out.extend_from_slice(&sc);
        for j in (0..QK_K).step_by(64) {
            for i in 0..32 {
                out.push(l[j + i] | (l[j + i + 32] << 4));
            }
        }
    }
    out
}

/// `quantize_row_q6_K_ref`: 210 bytes per 256 values (128 bytes of low 4 bits, 64 of high 2 bits,
/// 16 int8 scales of sub-blocks of 16, d: f16).
pub fn q6_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * 210);
    let mut l = [0i8; QK_K];
    for x in x.chunks_exact(QK_K) {
        let mut scales = [0f32; 16];
        for ib in 0..16 {
            scales[ib] = make_qx_quants(
                &x[16 * ib..16 * ib + 16],
                32,
                &mut l[16 * ib..16 * ib + 16],
                1,
            );
        }
        let (max_scale, max_abs_scale) = signed_absmax(&scales);
        if max_abs_scale < GROUP_MAX_EPS {
            out.extend_from_slice(&[0u8; 210]);
            continue;
        }
        let iscale = -128.0 / max_scale;
        let d = fp16(1.0 / iscale);
        let mut sc = [0i8; 16];
        for ib in 0..16 {
            sc[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
        }
        for j in 0..16 {
            let dj = d.to_f32() * sc[j] as f32;
            if dj == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / dj).clamp(-32, 31);
                l[16 * j + ii] = (q + 32) as i8;
            }
        }
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        let u = |i: usize| l[i] as u8;
        for (n, j) in (0..QK_K).step_by(128).enumerate() {
            for i in 0..32 {
                let (q1, q2, q3, q4) = (
                    u(j + i) & 0xF,
                    u(j + i + 32) & 0xF,
                    u(j + i + 64) & 0xF,
                    u(j + i + 96) & 0xF,
                );
                ql[64 * n + i] = q1 | (q3 << 4);
                ql[64 * n + i + 32] = q2 | (q4 << 4);
                qh[32 * n + i] = (u(j + i) >> 4)
                    | ((u(j + i + 32) >> 4) << 2)
                    | ((u(j + i + 64) >> 4) << 4)
                    | ((u(j + i + 96) >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|&s| s as u8));
        out.extend_from_slice(&d.to_le_bytes());
    }
    out
}

/// `quantize_row_q5_0_ref`: 22 bytes per 32 values (d: f16, 4 bytes of fifth bits, 16 of 4-bit
/// codes).
pub fn q5_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 22);
    for x in x.chunks_exact(32) {
        let (max, _) = signed_absmax(x);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qh = 0u32;
        let mut qs = [0u8; 16];
        for j in 0..16 {
            // C: MIN(31, (int8_t)(x * id + 16.5f)), the cast truncating toward zero.
            let xi0 = ((x[j] * id + 16.5) as i8 as u8).min(31);
            let xi1 = ((x[j + 16] * id + 16.5) as i8 as u8).min(31);
            qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + 16);
        }
        out.extend_from_slice(&fp16(d).to_le_bytes());
        out.extend_from_slice(&qh.to_le_bytes());
        out.extend_from_slice(&qs);
    }
    out
}

/// `quantize_row_q5_K_ref`: 176 bytes per 256 values (d, dmin: f16; 12 bytes of 6-bit scales
/// and mins; 32 bytes of the codes' fifth bits; 128 bytes of their low nibbles), codes 0..31.
pub fn q5_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * 176);
    for x in x.chunks_exact(QK_K) {
        let (d, dmin, sc, l) = k_block(x, 31, -0.5, 15);
        let mut qh = [0u8; QK_K / 8];
        let mut ql = [0u8; QK_K / 2];
        let (mut m1, mut m2) = (1u8, 2u8);
        for (k, n) in (0..QK_K).step_by(64).enumerate() {
            for j in 0..32 {
                let mut l1 = l[n + j];
                if l1 > 15 {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                let mut l2 = l[n + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql[32 * k + j] = l1 | (l2 << 4);
            }
            m1 <<= 2;
            m2 <<= 2;
        }
        out.extend_from_slice(&d.to_le_bytes());
        out.extend_from_slice(&dmin.to_le_bytes());
        out.extend_from_slice(&sc);
        out.extend_from_slice(&qh);
        out.extend_from_slice(&ql);
    }
    out
}

/// `quantize_row_q5_1_ref`: 24 bytes per 32 values (d, min: f16; the codes' fifth bits; their
/// low nibbles), codes (x - min) / d truncated after + 0.5.
pub fn q5_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 24);
    for x in x.chunks_exact(32) {
        let (mut min, mut max) = (f32::MAX, -f32::MAX);
        for &v in x {
            if v < min {
                min = v;
            }
            if v > max {
                max = v;
            }
        }
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qh = 0u32;
        let mut qs = [0u8; 16];
        for j in 0..16 {
            // C: (uint8_t)(x + 0.5f), the cast truncating toward zero
            let xi0 = ((x[j] - min) * id + 0.5) as u8;
            let xi1 = ((x[j + 16] - min) * id + 0.5) as u8;
            qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
            qh |= (((xi0 & 0x10) >> 4) as u32) << j;
            qh |= (((xi1 & 0x10) >> 4) as u32) << (j + 16);
        }
        out.extend_from_slice(&fp16(d).to_le_bytes());
        out.extend_from_slice(&fp16(min).to_le_bytes());
        out.extend_from_slice(&qh.to_le_bytes());
        out.extend_from_slice(&qs);
    }
    out
}

/// `make_q3_quants` with `do_rmse`: signed codes -nmax..nmax-1 for `x` (stored + nmax in `l`),
/// refined by up to 5 passes of weighted (x^2) least squares; returns the scale.
fn make_q3_quants(x: &[f32], nmax: i32, l: &mut [i8]) -> f32 {
    let (max, amax) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (q, &v) in l.iter_mut().zip(x) {
        let c = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *q = c as i8;
        let w = v * v;
        sumlx += w * v * c as f32;
        suml2 += w * c as f32 * c as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for (q, &v) in l.iter_mut().zip(x) {
            let w = v * v;
            let mut slx = sumlx - w * v * *q as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * *q as f32 * *q as f32;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *q as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *q = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    for q in l.iter_mut() {
        *q += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `quantize_row_q3_K_ref`: 110 bytes per 256 values (32 bytes of the codes' high bits, 64 of
/// their low 2 bits, 12 of 6-bit signed scales for 16 sub-blocks of 16, d: f16), codes -4..3.
pub fn q3_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * 110);
    let mut l = [0i8; QK_K];
    for x in x.chunks_exact(QK_K) {
        let mut scales = [0f32; 16];
        for j in 0..16 {
            scales[j] = make_q3_quants(&x[16 * j..16 * j + 16], 4, &mut l[16 * j..16 * j + 16]);
        }
        let (max_scale, _) = signed_absmax(&scales);
        let mut sc = [0u8; 12];
        let d = if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (j, &s) in scales.iter().enumerate() {
                let q = (nearest_int(iscale * s).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    sc[j] = q & 0xF;
                } else {
                    sc[j - 8] |= (q & 0xF) << 4;
                }
                sc[j % 4 + 8] |= (q >> 4) << (2 * (j / 4));
            }
            fp16(1.0 / iscale)
        } else {
            fp16(0.0)
        };
        for j in 0..16 {
            let low = if j < 8 { sc[j] & 0xF } else { sc[j - 8] >> 4 };
            let s = (low | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32;
            let dj = d.to_f32() * s as f32;
            if dj == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l[16 * j + ii] = (nearest_int(x[16 * j + ii] / dj).clamp(-4, 3) + 4) as i8;
            }
        }
        let mut hmask = [0u8; QK_K / 8];
        let (mut m, mut hm) = (0usize, 1u8);
        for q in l.iter_mut() {
            if *q > 3 {
                hmask[m] |= hm;
                *q -= 4;
            }
            m += 1;
            if m == QK_K / 8 {
                m = 0;
                hm <<= 1;
            }
        }
        let mut qs = [0u8; QK_K / 4];
        for j in (0..QK_K).step_by(128) {
            for i in 0..32 {
                let b = |k: usize| l[j + i + k] as u8;
                qs[j / 4 + i] = b(0) | (b(32) << 2) | (b(64) << 4) | (b(96) << 6);
            }
        }
        out.extend_from_slice(&hmask);
        out.extend_from_slice(&qs);
        out.extend_from_slice(&sc);
        out.extend_from_slice(&d.to_le_bytes());
    }
    out
}

/// `quantize_row_q4_0_ref`: 18 bytes per 32 values (d: f16, 4-bit codes of x / d + 8).
pub fn q4_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 18);
    for x in x.chunks_exact(32) {
        let (max, _) = signed_absmax(x);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&fp16(d).to_le_bytes());
        for j in 0..16 {
            // C: MIN(15, (int8_t)(x * id + 8.5f)), the cast truncating toward zero
            let xi0 = ((x[j] * id + 8.5) as i8 as u8).min(15);
            let xi1 = ((x[j + 16] * id + 8.5) as i8 as u8).min(15);
            out.push(xi0 | (xi1 << 4));
        }
    }
    out
}

/// `quantize_row_q8_0_ref`: 34 bytes per 32 values (d: f16, 32 int8 codes rounded half away
/// from zero).
pub fn q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 34);
    for x in x.chunks_exact(32) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&fp16(d).to_le_bytes());
        out.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QStorage, QTensor};
    use candle_core::{Device, Tensor};

    /// The blocks decode (Candle's decoders, ported from ggml) to values near the input, within
    /// each format's step: each quantizer packs what its decoder reads.
    #[test]
    fn blocks_decode_to_the_values_they_quantize() {
        let n = 4 * QK_K;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        for (format, bytes, tol) in [
            (GgmlDType::Q4K, q4_k(&x), 0.12),
            (GgmlDType::Q6K, q6_k(&x), 0.03),
            (GgmlDType::Q5_0, q5_0(&x), 0.06),
            (GgmlDType::Q5K, q5_k(&x), 0.06),
            (GgmlDType::Q5_1, q5_1(&x), 0.06),
            (GgmlDType::Q3K, q3_k(&x), 0.25),
            (GgmlDType::Q4_0, q4_0(&x), 0.12),
            (GgmlDType::Q8_0, q8_0(&x), 0.01),
        ] {
            let q = QTensor::new(
                QStorage::from_data(std::borrow::Cow::Owned(bytes), &Device::Cpu, format).unwrap(),
                (4, QK_K),
            )
            .unwrap();
            let back = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap();
            let want = Tensor::new(x.as_slice(), &Device::Cpu).unwrap();
            let amax = 13.0;
            let err = (back - want).unwrap().abs().unwrap().max_all().unwrap();
            let err = err.to_scalar::<f32>().unwrap() / amax;
            assert!(err < tol, "{format:?}: {err}");
        }
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(
            [0.5, 1.5, 2.5, -0.5, -1.5, 2.4999, 7.6].map(nearest_int),
            [0, 2, 2, 0, -2, 2, 8]
        );
    }
}
