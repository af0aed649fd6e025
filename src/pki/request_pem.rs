//! The one PEM block of a CertificateSigningRequest, read so that it is exactly the block
//! Kubernetes will sign.
//!
//! kube-apiserver and kube-controller-manager read `spec.request` with Go's `pem.Decode`, which
//! takes the first `-----BEGIN ` that starts a line (or the data) and whose block is well formed,
//! skipping anything before it and any malformed block. A reader that takes a block another way
//! (the first `-----BEGIN ` anywhere, even mid-line) can be shown one request while the signer
//! signs another. So an approver accepts only data that every reader reads the same: exactly one
//! `CERTIFICATE REQUEST` block, its BEGIN at the start of a line, no headers, base64 lines only,
//! and nothing but whitespace before and after it. Whatever this function accepts, Go's
//! `pem.Decode` returns the same bytes for; everything else is refused with what was wrong.

const BEGIN: &str = "-----BEGIN ";
const END: &str = "-----END ";
const TYPE: &str = "CERTIFICATE REQUEST";

/// Why `spec.request` is not one well-formed request block.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotOneBlock(pub String);

fn refuse(reason: impl Into<String>) -> NotOneBlock {
    NotOneBlock(reason.into())
}

/// What Go's `getLine` keeps of a line: one `\r` right before the newline goes, then trailing
/// spaces and tabs (a `\r` before a space stays, and Go then refuses the line).
fn trim_line_end(line: &str) -> &str {
    line.strip_suffix('\r')
        .unwrap_or(line)
        .trim_end_matches([' ', '\t'])
}

/// The DER of the single `CERTIFICATE REQUEST` PEM block `data` consists of.
pub fn single_request_block(data: &[u8]) -> Result<Vec<u8>, NotOneBlock> {
    let text = std::str::from_utf8(data)
        .map_err(|_| refuse("the request is not text (PEM): it holds bytes that are not UTF-8"))?;
    let after_begin = after_the_one_begin(text)?;
    let mut lines = after_begin.split('\n');
    let type_line = lines.next().unwrap_or_default();
    let block_type = trim_line_end(type_line)
        .strip_suffix("-----")
        .ok_or_else(|| refuse("the BEGIN line does not end with -----"))?;
    if block_type != TYPE {
        return Err(refuse(format!(
            "the PEM block is a '{}', not a {TYPE}",
            block_type.escape_debug()
        )));
    }
    let base64 = body_up_to_end(&mut lines)?;
    if !lines.all(|l| l.chars().all(|c| c.is_ascii_whitespace())) {
        return Err(refuse(
            "the request has text after its PEM block: only whitespace may follow -----END",
        ));
    }
    use base64::Engine as _;
    let der = base64::engine::general_purpose::STANDARD
        .decode(base64.as_bytes())
        .map_err(|e| refuse(format!("the PEM block is not base64: {e}")))?;
    if der.is_empty() {
        return Err(refuse("the PEM block is empty"));
    }
    Ok(der)
}

/// What follows the one `-----BEGIN ` of `text`, which must start a line with only whitespace
/// before it (and the text must have exactly one END marker too).
fn after_the_one_begin(text: &str) -> Result<&str, NotOneBlock> {
    match text.matches(BEGIN).count() {
        0 => return Err(refuse("the request holds no PEM block (no -----BEGIN line)")),
        1 => {}
        n => {
            return Err(refuse(format!(
                "the request holds {n} PEM BEGIN markers: exactly one CERTIFICATE REQUEST block is accepted (the signer would read only one of them)"
            )))
        }
    }
    if text.matches(END).count() != 1 {
        return Err(refuse(
            "the request must hold exactly one -----END line (one PEM block)",
        ));
    }
    let start = text.find(BEGIN).unwrap_or(0);
    let before = &text[..start];
    if !before.chars().all(|c| c.is_ascii_whitespace()) {
        return Err(refuse(
            "the request has text before its PEM block: only whitespace may come before -----BEGIN",
        ));
    }
    if !before.is_empty() && !before.ends_with('\n') {
        return Err(refuse("-----BEGIN does not start a line"));
    }
    Ok(&text[start + BEGIN.len()..])
}

/// The base64 of the block's lines up to its END line (which must close a CERTIFICATE
/// REQUEST); no headers, nothing but base64.
fn body_up_to_end<'a>(lines: &mut impl Iterator<Item = &'a str>) -> Result<String, NotOneBlock> {
    let mut base64 = String::new();
    let mut closed = false;
    for line in lines.by_ref() {
        let line = trim_line_end(line);
        if let Some(end) = line.strip_prefix(END) {
            if end != format!("{TYPE}-----") {
                let shown: String = line.chars().take(64).collect();
                return Err(refuse(format!(
                    "the END line '{}' does not close a {TYPE}",
                    shown.escape_debug()
                )));
            }
            closed = true;
            break;
        }
        if line.contains(END.trim_end()) {
            return Err(refuse("-----END does not start a line"));
        }
        if line.contains(':') {
            return Err(refuse(
                "the PEM block has headers (a line with ':'): a request block has none",
            ));
        }
        for c in line.chars() {
            match c {
                'A'..='Z' | 'a'..='z' | '0'..='9' | '+' | '/' | '=' => base64.push(c),
                ' ' | '\t' => {}
                other => {
                    return Err(refuse(format!(
                        "the PEM block holds '{}', which is not base64",
                        other.escape_debug()
                    )))
                }
            }
        }
    }
    if !closed {
        return Err(refuse("the PEM block has no -----END line"));
    }
    Ok(base64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = "MIIBAjCBqAIBADAUMRIwEAYDVQQDDAlzb21lLW5vZGUw";

    fn block(body: &str) -> String {
        format!("-----BEGIN CERTIFICATE REQUEST-----\n{body}\n-----END CERTIFICATE REQUEST-----\n")
    }

    #[test]
    fn one_block_with_whitespace_around_it_is_read() {
        let der = single_request_block(block(BODY).as_bytes()).expect("one block");
        assert!(!der.is_empty());
        let padded = format!("\n \r\n{}\n\n  ", block(BODY).replace('\n', "\r\n"));
        assert_eq!(single_request_block(padded.as_bytes()), Ok(der));
    }

    #[test]
    fn two_blocks_text_before_and_mid_line_markers_are_refused() {
        let one = block(BODY);
        for (data, want) in [
            (format!("{one}{one}"), "2 PEM BEGIN markers"),
            (format!("x{one}"), "text before"),
            (format!("x\n{one}"), "text before"),
            (format!("  {one}"), "does not start a line"),
            (format!("{one}x"), "text after"),
            (
                one.replace("-----END", "x-----END"),
                "does not start a line",
            ),
            (
                one.replacen(
                    "REQUEST-----\n",
                    "REQUEST-----\nProc-Type: 4,ENCRYPTED\n",
                    1,
                ),
                "headers",
            ),
            (
                one.replace("CERTIFICATE REQUEST", "CERTIFICATE"),
                "not a CERTIFICATE REQUEST",
            ),
            (one.replace(BODY, "MIIB*AjCB"), "not base64"),
            (
                one.replace(BODY, "MIIBAjCBqAIBADAUMRIwEAYDVQQDDAlzb21lLW5vZGUw="),
                "not base64",
            ),
            (String::new(), "no PEM block"),
        ] {
            let e = single_request_block(data.as_bytes()).expect_err(&data);
            assert!(e.0.contains(want), "{data:?}: {e}");
        }
    }
}
