//! Dev tool: a GGUF file with its decoder linears requantized to Q4_K (Q8_0 where a row is not
//! whole 256-value blocks) by Candle's quantizer, for measuring `model.quantize = "keep"` on
//! models of any size (`scripts/bench_gguf_keep.sh`). Not llama-quantize's blocks (docs/gguf.md):
//! the footprint is the format's, the values are Candle's quantizer's.
//!
//!   cargo run --release -p tallow-tests --bin requantize-gguf -- IN.gguf OUT.gguf

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [from, to] = args.as_slice() else {
        eprintln!("usage: requantize-gguf IN.gguf OUT.gguf");
        std::process::exit(2)
    };
    tallow_tests::requantize_linears(std::path::Path::new(from), std::path::Path::new(to));
    println!("wrote {to}");
}
