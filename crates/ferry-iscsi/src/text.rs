//! Text keys: `key=value` pairs separated by NUL bytes (RFC 7143 §6).

use thiserror::Error;

/// Longest key name and value accepted (RFC 7143 §6.1: 63 and 8192 bytes;
/// values may be longer only for CHAP, which the caller bounds).
pub const MAX_KEY: usize = 63;
pub const MAX_VALUE: usize = 65536;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TextError {
    #[error("text is not UTF-8")]
    Utf8,
    #[error("pair {0:?} has no '='")]
    NoEquals(String),
    #[error("key or value too long")]
    TooLong,
    #[error("key {0:?} given twice")]
    Duplicate(String),
}

/// Parse a data segment into ordered pairs.
pub fn parse(data: &[u8]) -> Result<Vec<(String, String)>, TextError> {
    let s = std::str::from_utf8(data).map_err(|_| TextError::Utf8)?;
    let mut out: Vec<(String, String)> = Vec::new();
    for item in s.split('\0').filter(|i| !i.is_empty()) {
        let (k, v) = item
            .split_once('=')
            .ok_or_else(|| TextError::NoEquals(item.chars().take(64).collect()))?;
        if k.is_empty() || k.len() > MAX_KEY || v.len() > MAX_VALUE {
            return Err(TextError::TooLong);
        }
        if out.iter().any(|(x, _)| x == k) {
            return Err(TextError::Duplicate(k.to_string()));
        }
        out.push((k.to_string(), v.to_string()));
    }
    Ok(out)
}

/// Encode pairs as a data segment.
pub fn encode(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(b'=');
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_encode() {
        let d = b"InitiatorName=iqn.x\0SessionType=Normal\0";
        let p = parse(d).unwrap();
        assert_eq!(p[1], ("SessionType".into(), "Normal".into()));
        assert_eq!(encode(&p), d.to_vec());
        assert!(parse(b"A=1\0A=2\0").is_err());
        assert!(parse(b"novalue\0").is_err());
        assert!(parse(&[0xff, b'=', 0]).is_err());
    }
}
