//! Progress of a long command on stderr: a bar on a terminal, plain lines elsewhere.
//!
//! Off a terminal (Slurm, nohup, CI, `2> train.log`) an indicatif bar hides itself and drops
//! every line printed through it (issue 34). There, and with `--quiet`, notes are plain lines and
//! the position is one line every `every` units and at the end, as HF's Trainer logs when tqdm
//! cannot draw.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// Where progress goes.
enum Out {
    /// stderr is a terminal: a bar, notes printed above it.
    Bar(ProgressBar),
    /// Plain lines on stderr.
    Lines,
    /// Nothing (the ranks of a data-parallel run other than 0).
    Silent,
}

/// A command's progress reporter: `len` units (steps, rows), notes, and a message per update.
pub struct Progress {
    out: Out,
    /// Names the position in a plain line: "step" gives `step 4/10  MSG`.
    label: &'static str,
    len: u64,
    /// A plain line every this many units...
    every: u64,
    /// ...the next one when the position reaches this.
    next_line: u64,
}

impl Progress {
    /// A bar drawn with `template` (indicatif's) when stderr is a terminal and `lines` is false;
    /// plain lines otherwise.
    pub fn new(label: &'static str, template: &'static str, lines: bool) -> Self {
        let out = if lines || !std::io::stderr().is_terminal() {
            Out::Lines
        } else {
            let bar = ProgressBar::new(0);
            bar.set_style(ProgressStyle::with_template(template).expect("static template"));
            Out::Bar(bar)
        };
        Self {
            out,
            label,
            len: 0,
            every: 1,
            next_line: 1,
        }
    }

    /// Reports nothing at all.
    pub fn silent() -> Self {
        Self {
            out: Out::Silent,
            label: "",
            len: 0,
            every: 1,
            next_line: 1,
        }
    }

    /// `len` units in all, `pos` done already (a resumed run), a plain line every `every`.
    pub fn start(&mut self, len: u64, pos: u64, every: u64) {
        self.len = len;
        self.every = every.max(1);
        self.next_line = (pos / self.every + 1) * self.every;
        if let Out::Bar(bar) = &self.out {
            bar.set_length(len);
            bar.set_position(pos);
        }
    }

    /// A line of its own: above the bar, or on stderr.
    pub fn note(&self, msg: &str) {
        match &self.out {
            Out::Bar(bar) => bar.println(msg),
            Out::Lines => eprintln!("{msg}"),
            Out::Silent => {}
        }
    }

    /// At `pos`: the bar moves and shows `msg`; in lines, `LABEL POS/LEN  MSG` once `pos`
    /// reaches the next multiple of `every`, and at the end.
    pub fn update(&mut self, pos: u64, msg: &str) {
        match &self.out {
            Out::Bar(bar) => {
                bar.set_position(pos);
                bar.set_message(msg.to_string());
            }
            Out::Lines if pos >= self.next_line || pos == self.len => {
                self.next_line = (pos / self.every + 1) * self.every;
                let line = format!("{} {pos}/{}  {msg}", self.label, self.len);
                eprintln!("{}", line.trim_end());
            }
            Out::Lines | Out::Silent => {}
        }
    }

    /// Clears the bar (the command's result follows on stdout).
    pub fn finish(&self) {
        if let Out::Bar(bar) = &self.out {
            bar.finish_and_clear();
        }
    }
}
