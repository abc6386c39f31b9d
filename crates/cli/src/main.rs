//! `tallow`: fine-tune Llama / Qwen models from the shell.
//!
//! A thin binary: parse arguments, call the command, print errors with their whole chain and exit
//! non-zero (1 for a failed command; clap exits 2 for a usage error).

mod args;
mod device;
mod eval;
mod merge;
mod train;

use clap::Parser;

fn main() {
    let cli = args::Cli::parse();
    let result = match cli.command {
        args::Command::Train(a) => train::run(a),
        args::Command::Eval(a) => eval::run(a),
        args::Command::Merge(a) => merge::run(a),
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
