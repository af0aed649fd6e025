//! The PIN prompt of an interactive exec plugin: the terminal stops echoing before the prompt
//! shows.
//!
//! Why not `rpassword::prompt_password` alone: it writes the prompt, then turns echo off, so a
//! PIN typed the moment the prompt appears (a password manager's auto-type; the tests'
//! terminal) was echoed in the clear. It happened in CI: "PIN for token 'kube': 1234".

use std::fs::File;
use std::io::{self, Write};

use rustix::termios::{self, LocalModes, OptionalActions, Termios};

/// Prompts for a PIN on the controlling terminal, with echo off from before the prompt is
/// written until the PIN is read; the terminal's settings are restored however it ends.
pub(super) fn prompt_pin(prompt: &str) -> io::Result<String> {
    let tty = File::options().read(true).write(true).open("/dev/tty")?;
    let quiet = Quiet::on(&tty)?;
    let mut out = &tty;
    out.write_all(prompt.as_bytes())?;
    out.flush()?;
    let pin = rpassword::read_password();
    drop(quiet);
    pin
}

/// The terminal's settings before echo was turned off, put back on drop.
struct Quiet<'a> {
    tty: &'a File,
    saved: Termios,
}

impl<'a> Quiet<'a> {
    fn on(tty: &'a File) -> io::Result<Quiet<'a>> {
        let saved = termios::tcgetattr(tty)?;
        let mut quiet = saved.clone();
        quiet.local_modes.remove(LocalModes::ECHO);
        termios::tcsetattr(tty, OptionalActions::Now, &quiet)?;
        Ok(Quiet { tty, saved })
    }
}

impl Drop for Quiet<'_> {
    fn drop(&mut self) {
        let _ = termios::tcsetattr(self.tty, OptionalActions::Now, &self.saved);
    }
}
