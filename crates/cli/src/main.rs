//! `tallow`: fine-tune decoder-only LLMs (Llama, Mistral, Qwen, Gemma, Phi-3) from the shell.
//!
//! A thin binary: parse arguments, call the command, print errors with their whole chain and exit
//! non-zero (1 for a failed command; clap exits 2 for a usage error).

mod args;
mod bench;
mod card;
mod chat;
mod device;
mod doctor;
mod download;
mod estimate;
mod eval;
mod export;
mod generate;
mod gpu;
mod merge;
mod model;
mod plot;
mod progress;
mod spawn_ranks;
mod train;
mod upload;

use clap::Parser;

/// mimalloc keeps freed memory for reuse: with glibc's malloc every large tensor buffer is an
/// mmap/munmap pair, and re-faulting fresh pages cost ~30% of a CPU training step (perf).
/// Wrapped in a counter of live and peak bytes: the CPU numbers of `tallow train`'s per-phase
/// peak memory (`tallow_trainer::memory`).
#[global_allocator]
static GLOBAL: tallow_trainer::memory::CountingAlloc<mimalloc::MiMalloc> =
    tallow_trainer::memory::CountingAlloc(mimalloc::MiMalloc);

/// mimalloc's `mi_option_purge_delay`: index 15 of `mi_option_e` in the v2 and v3 headers
/// (libmimalloc-sys exports no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() {
    // Never hand freed pages back to the OS: a training step frees and reallocates the same
    // activation-sized buffers, and re-faulting zeroed pages was 46% of a CPU step (perf).
    // SAFETY: sets a global allocator option; called before any other thread exists.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    tallow_trainer::memory::mark_counting_installed();
    let cli = args::Cli::parse();
    let result = match cli.command {
        args::Command::Train(a) => {
            // Development switches: the peak's tensors (`TALLOW_TRACE_PEAK`, docs/memory.md)
            // and the device operations per op name (`TALLOW_LAUNCH_BREAKDOWN`,
            // benchmarks/op-counts.md), printed when the run ends.
            let breakdown = std::env::var("TALLOW_LAUNCH_BREAKDOWN").is_ok_and(|v| v == "1");
            candle_core::launches::set_breakdown(breakdown);
            let r = train::run(a);
            tallow_trainer::memory::trace::report();
            let times = candle_core::launches::timing();
            if !times.is_empty() {
                let total: f64 = times.iter().map(|t| t.2).sum();
                eprintln!(
                    "device time by op, steps after the first (TALLOW_OP_TIMES): {:.1} ms",
                    total * 1e3
                );
                eprintln!("  {:>9}  {:>10}  {:>6}  op", "ops", "ms", "share");
                for (op, n, secs) in times {
                    eprintln!(
                        "  {n:>9}  {:>10.2}  {:>5.1}%  {op}",
                        secs * 1e3,
                        100.0 * secs / total
                    );
                }
            }
            if breakdown {
                eprintln!("device operations by op, whole run:");
                for (op, n) in candle_core::launches::breakdown() {
                    eprintln!("  {n:>9}  {op}");
                }
            }
            r
        }
        args::Command::Eval(a) => eval::run(a),
        args::Command::Merge(a) => merge::run(a),
        args::Command::Export(a) => export::run(a),
        args::Command::Generate(a) => generate::run(a),
        args::Command::Chat(a) => chat::run(a),
        args::Command::Download(a) => download::run(a),
        args::Command::Upload(a) => upload::run(a),
        args::Command::Estimate(a) => estimate::run(a),
        args::Command::Bench(a) => bench::run(a),
        args::Command::Doctor(a) => doctor::run(a),
    };
    if let Err(err) = result {
        // Print the chain, skipping causes whose text the message above already includes
        // (library errors embed their source in their own message).
        let mut shown = err.to_string();
        eprintln!("error: {shown}");
        for cause in err.chain().skip(1) {
            let text = cause.to_string();
            if !shown.contains(&text) {
                eprintln!("  caused by: {text}");
                shown = text;
            }
        }
        std::process::exit(1);
    }
}
