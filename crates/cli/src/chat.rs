//! `tallow chat`: a multi-turn conversation on the terminal (or through a pipe). Each line read
//! from stdin is a user turn; the reply is streamed to stdout, one reply per line. `/reset` clears
//! the history, `/exit` or end of input quits.
//!
//! Each turn renders the whole history with the chat template and generates with a fresh KV cache
//! (the prompt is prefilled again: simple, and a template may re-render earlier turns
//! differently, e.g. Qwen3 dropping old reasoning).

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Result;
use tallow_text::Message;

use crate::args::ChatArgs;
use crate::generate::{chat_prompt, load, report};

pub fn run(a: ChatArgs) -> Result<()> {
    let s = load(&a.decode)?;
    // Fail before the first line when there is no template.
    chat_prompt(&s.tok, &[Message::new("user", "hi")], "tallow chat")?;
    let start: Vec<Message> = a
        .system
        .iter()
        .map(|t| Message::new("system", t.clone()))
        .collect();
    let mut messages = start.clone();
    let stdin = std::io::stdin();
    let interactive = stdin.is_terminal();
    let prompt = || {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
    };
    if interactive {
        eprintln!("/reset clears the history, /exit or Ctrl-D quits");
    }
    prompt();
    for line in stdin.lock().lines() {
        let line = line?;
        let text = line.trim();
        match text {
            "" => {}
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = start.clone();
                eprintln!("(history cleared)");
            }
            _ => {
                messages.push(Message::new("user", text));
                let ids = chat_prompt(&s.tok, &messages, "tallow chat")?;
                let (g, reply) = s.generate_streamed(&ids, true)?;
                println!();
                report(ids.len(), &g);
                messages.push(Message::new("assistant", reply));
            }
        }
        prompt();
    }
    Ok(())
}
