//! A command under a terminal (`script`), answering its prompt when the prompt appears: how a
//! person types a PIN, without guessing how long the command takes to ask.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::require_tool;

/// Runs `command` (a shell command line) under a terminal with `envs`, types `answer` and Enter
/// once `prompt` shows on the terminal, and returns all the terminal showed. A command that ends
/// without prompting returns what it showed; one that neither prompts nor ends within 60 s
/// fails the test.
pub fn answer_prompt(
    command: &str,
    envs: Vec<(String, String)>,
    prompt: &str,
    answer: &str,
) -> String {
    require_tool("script", "bsdutils");
    let mut child = Command::new("script")
        .args(["-qec", command, "/dev/null"])
        .envs(envs)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run script");
    let shown = Arc::new(Mutex::new(Vec::new()));
    let reader = {
        let shown = shown.clone();
        let mut stdout = child.stdout.take().expect("stdout");
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                shown.lock().expect("lock").extend_from_slice(&buf[..n]);
            }
        })
    };
    let text =
        |shown: &Mutex<Vec<u8>>| String::from_utf8_lossy(&shown.lock().expect("lock")).into_owned();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stdin = child.stdin.take().expect("stdin");
    loop {
        if text(&shown).contains(prompt) {
            stdin
                .write_all(format!("{answer}\r").as_bytes())
                .expect("type the answer");
            break;
        }
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "`{command}` neither asked {prompt:?} nor ended: {}",
            text(&shown)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(stdin);
    child.wait().expect("wait for script");
    reader.join().expect("terminal reader");
    text(&shown)
}
