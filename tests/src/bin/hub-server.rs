//! Dev tool: the tests' loopback hub ([`tallow_tests::hub_server`]) as a process, so that another
//! client, the real Python `huggingface_hub`, can be run against it
//! (`scripts/check_hub_server.py`):
//!
//!   cargo run -p tallow-tests --bin hub-server
//!
//! It serves the fixture repos (tests/fixtures/) on two loopback ports, the hub and its CDN,
//! prints `HF_ENDPOINT=<hub url>` and `CDN=<cdn url>` on stdout, then serves until its stdin
//! closes (so it ends with the process that started it).

use std::io::{Read, Write};

use tallow_tests::hub_server::HubServer;

fn main() {
    let hub = HubServer::start();
    let mut out = std::io::stdout().lock();
    writeln!(out, "HF_ENDPOINT={}", hub.url).unwrap();
    writeln!(out, "CDN={}", hub.cdn_url).unwrap();
    out.flush().unwrap();
    drop(out);
    // Serve until stdin reaches its end (or fails).
    let mut sink = [0u8; 1024];
    while matches!(std::io::stdin().read(&mut sink), Ok(n) if n > 0) {}
}
