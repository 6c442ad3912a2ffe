//! CHAP with MD5 (RFC 1994 as used by RFC 7143 §12.1.3): responses,
//! and the hex/base64 value encodings.

use md5::{Digest, Md5};

/// MD5(id || secret || challenge).
pub fn response(id: u8, secret: &[u8], challenge: &[u8]) -> [u8; 16] {
    let mut h = Md5::new();
    h.update([id]);
    h.update(secret);
    h.update(challenge);
    h.finalize().into()
}

pub fn to_hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(2 + b.len() * 2);
    s.push_str("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// Decode a binary value: `0x` hex or `0b` base64 (RFC 7143 §6.1).
pub fn decode_binary(v: &str) -> Option<Vec<u8>> {
    if let Some(h) = v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        let h = if h.len() % 2 == 1 {
            format!("0{h}")
        } else {
            h.to_string()
        };
        return (0..h.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
            .collect();
    }
    if let Some(b) = v.strip_prefix("0b").or_else(|| v.strip_prefix("0B")) {
        return base64_decode(b);
    }
    None
}

fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits).to_le_bytes()[0]);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodings() {
        assert_eq!(decode_binary("0x0aff").unwrap(), vec![0x0a, 0xff]);
        assert_eq!(decode_binary("0xaff").unwrap(), vec![0x0a, 0xff]);
        assert_eq!(decode_binary("0bAQID").unwrap(), vec![1, 2, 3]);
        assert!(decode_binary("zz").is_none());
        assert!(decode_binary("0xzz").is_none());
        assert_eq!(to_hex(&[1, 0xab]), "0x01ab");
    }

    #[test]
    fn md5_response_is_stable() {
        let r = response(1, b"secret", b"challenge");
        assert_eq!(r.len(), 16);
        assert_ne!(r, response(2, b"secret", b"challenge"));
    }
}
