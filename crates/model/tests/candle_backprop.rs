//! Candle's backward as tallow patches it (vendor/README.md): a tensor's first gradient is
//! stored as it is when it is contiguous from the start of its storage, else copied into a
//! contiguous buffer of its own, instead of added to a new tensor of zeros; every later one is
//! added as upstream.

use candle_core::{DType, Device, Tensor, Var};

/// The address of a CPU f64 tensor's storage (its first element).
fn storage_ptr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(c) => c.as_slice::<f64>().unwrap().as_ptr() as usize,
        _ => unreachable!("CPU only"),
    }
}

/// f = sum(w ⊙ g(x, y)) for a graph whose gradients take each path of the patch: a tensor
/// used twice (x + x: the second gradient added to the first), the operands of a sum (both
/// given the same gradient as they are), a transpose and a broadcast (non-contiguous
/// gradients, copied), a narrow (a gradient that is a view at an offset), a reshape,
/// a product and a matmul. Every gradient within 1e-6 relative of central differences (step
/// 1e-6, f64). Replacing a gradient instead of adding to it (x + x's second gradient) is off
/// by x's whole first gradient, order 1.
#[test]
fn gradients_match_finite_differences_on_every_path() {
    let dev = Device::Cpu;
    let seq =
        |n: usize, s: f64| -> Vec<f64> { (0..n).map(|i| (i as f64 * 0.37 + s).sin()).collect() };
    let x = Var::from_vec(seq(12, 0.1), (3, 4), &dev).unwrap();
    let y = Var::from_vec(seq(4, 0.7), 4, &dev).unwrap();
    let w = Tensor::from_vec(seq(24, 1.3), (6, 4), &dev).unwrap();
    let f = |x: &Tensor, y: &Tensor| -> Tensor {
        let twice = (x + x).unwrap(); // x used twice
        let b = twice.broadcast_add(y).unwrap(); // y's gradient: a sum over a broadcast
        let t = b.t().unwrap().contiguous().unwrap(); // (4, 3): a transposed gradient back
        let m = t.matmul(&b).unwrap(); // (4, 4)
        let prod = (&m * &m.exp().unwrap()).unwrap();
        let cat = Tensor::cat(&[&prod, &b.sqr().unwrap(), &twice], 0).unwrap(); // (10, 4)
        let part = cat.narrow(0, 4, 6).unwrap(); // a view at an offset
        let r = part.reshape((6, 4)).unwrap();
        (r * &w).unwrap().sum_all().unwrap()
    };
    let grads = f(x.as_tensor(), y.as_tensor()).backward().unwrap();
    let value = |xv: &[f64], yv: &[f64]| -> f64 {
        let xt = Tensor::from_vec(xv.to_vec(), (3, 4), &dev).unwrap();
        let yt = Tensor::from_vec(yv.to_vec(), 4, &dev).unwrap();
        f(&xt, &yt).to_scalar::<f64>().unwrap()
    };
    let (x0, y0) = (seq(12, 0.1), seq(4, 0.7));
    let h = 1e-6;
    for (name, var, n) in [("x", &x, 12), ("y", &y, 4)] {
        let got = grads.get(var.as_tensor()).expect("a gradient");
        let got = got.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        for i in 0..n {
            let (mut up, mut down) = (x0.clone(), y0.clone());
            let (mut up2, mut down2) = (x0.clone(), y0.clone());
            if name == "x" {
                up[i] += h;
                up2[i] -= h;
            } else {
                down[i] += h;
                down2[i] -= h;
            }
            let fd = (value(&up, &down) - value(&up2, &down2)) / (2.0 * h);
            let err = (got[i] - fd).abs() / fd.abs().max(1.0);
            assert!(err < 1e-6, "d{name}[{i}]: {} vs {fd} ({err:e})", got[i]);
        }
    }
}

/// The operands of a sum get its gradient as it is: the same storage as the gradient of the
/// sum, not a copy added to zeros (upstream: two new buffers per operand). A gradient that is
/// not contiguous (a broadcast operand's, summed back; a transpose's) still gets a buffer of its
/// own, and the values are right.
#[test]
fn a_first_contiguous_gradient_is_stored_as_it_is() {
    let dev = Device::Cpu;
    let a = Var::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], (2, 2), &dev).unwrap();
    let b = Var::from_vec(vec![5.0f64, 6.0, 7.0, 8.0], (2, 2), &dev).unwrap();
    let s = (a.as_tensor() + b.as_tensor()).unwrap();
    let out = (s.exp().unwrap()).sum_all().unwrap();
    let grads = out.backward().unwrap();
    let (ga, gb) = (
        grads.get(a.as_tensor()).unwrap(),
        grads.get(b.as_tensor()).unwrap(),
    );
    assert_eq!(
        storage_ptr(ga),
        storage_ptr(gb),
        "a sum's operands share its gradient"
    );
    let want = s
        .exp()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert_eq!(ga.flatten_all().unwrap().to_vec1::<f64>().unwrap(), want);

    // A transposed gradient: contiguous in its own buffer, the values transposed.
    let t = a.as_tensor().t().unwrap();
    let w = Tensor::new(&[[1.0f64, 10.0], [100.0, 1000.0]], &dev).unwrap();
    let grads = (t * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let g = grads.get(a.as_tensor()).unwrap();
    assert!(g.is_contiguous());
    assert_eq!(
        g.to_vec2::<f64>().unwrap(),
        vec![vec![1.0, 100.0], vec![10.0, 1000.0]]
    );
    assert_eq!(g.dtype(), DType::F64);
}
