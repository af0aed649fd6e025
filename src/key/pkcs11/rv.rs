//! The token's return values in words.

use cryptoki::error::Error as CkError;

/// Formats a cryptoki error the way PKCS#11 documentation names it (`CKR_PIN_INCORRECT`).
pub(crate) fn ckr(e: &CkError) -> String {
    match e {
        CkError::Pkcs11(rv, function) => {
            let name = format!("{rv:?}");
            let mut snake = String::from("CKR");
            for ch in name.chars() {
                if ch.is_ascii_uppercase() {
                    snake.push('_');
                }
                snake.push(ch.to_ascii_uppercase());
            }
            format!("{snake} from {function}")
        }
        other => other.to_string(),
    }
}
