//! The layers' building blocks: parameters and the one linear layer, the differentiable ops, the
//! LM head's loss, and no-grad evaluation. Built on `crate::kernels`.

pub mod linear;
pub mod lora;
pub mod loss;
pub mod no_grad;
pub mod ops;
