//! The QMP wire: one JSON object per line from the server, commands as
//! JSON objects to it. No I/O: [`LineDecoder`] is fed bytes and yields
//! [`ServerMessage`]s.

use bytes::{Buf, BytesMut};
use serde::Deserialize;
use serde_json::Value;
use thiserror::Error;

/// Longest line accepted from QEMU (a `query-*` answer can be large; a
/// line without end is a broken peer).
pub const MAX_LINE: usize = 16 << 20;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum WireError {
    #[error("QMP line of more than {MAX_LINE} bytes")]
    TooLong,
    #[error("QMP line is not JSON: {0}")]
    NotJson(String),
    #[error("QMP message of unknown shape: {0}")]
    Unknown(String),
}

/// QEMU's greeting.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Greeting {
    pub version: Value,
    #[serde(default)]
    pub capabilities: Vec<String>,
}

/// An asynchronous event.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub name: String,
    pub data: Value,
    /// Seconds since the epoch, as QEMU stamped it.
    pub timestamp: f64,
}

/// What the server sends.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerMessage {
    Greeting(Greeting),
    Return {
        id: Option<Value>,
        value: Value,
    },
    Error {
        id: Option<Value>,
        class: String,
        desc: String,
    },
    Event(Event),
}

impl ServerMessage {
    /// Classify one JSON object.
    pub fn parse(v: Value) -> Result<ServerMessage, WireError> {
        let Value::Object(mut m) = v else {
            return Err(WireError::Unknown(v.to_string()));
        };
        if let Some(g) = m.remove("QMP") {
            return serde_json::from_value(g)
                .map(ServerMessage::Greeting)
                .map_err(|e| WireError::Unknown(e.to_string()));
        }
        let id = m.remove("id");
        if let Some(value) = m.remove("return") {
            return Ok(ServerMessage::Return { id, value });
        }
        if let Some(e) = m.remove("error") {
            let class = e["class"].as_str().unwrap_or("GenericError").to_string();
            let desc = e["desc"].as_str().unwrap_or("").to_string();
            return Ok(ServerMessage::Error { id, class, desc });
        }
        if let Some(Value::String(name)) = m.remove("event") {
            let ts = m.remove("timestamp").unwrap_or(Value::Null);
            let secs = ts["seconds"].as_f64().unwrap_or(0.0);
            let micros = ts["microseconds"].as_f64().unwrap_or(0.0);
            return Ok(ServerMessage::Event(Event {
                name,
                data: m.remove("data").unwrap_or(Value::Null),
                timestamp: secs + micros / 1e6,
            }));
        }
        Err(WireError::Unknown(Value::Object(m).to_string()))
    }
}

/// Splits the server's byte stream into messages.
#[derive(Debug, Default)]
pub struct LineDecoder {
    buf: BytesMut,
}

impl LineDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add bytes read from the socket.
    pub fn feed(&mut self, data: &[u8]) {
        self.buf.extend_from_slice(data);
    }

    /// The next whole message, `Ok(None)` when more bytes are needed.
    pub fn next_message(&mut self) -> Result<Option<ServerMessage>, WireError> {
        loop {
            let Some(nl) = self.buf.iter().position(|&b| b == b'\n') else {
                if self.buf.len() > MAX_LINE {
                    return Err(WireError::TooLong);
                }
                return Ok(None);
            };
            if nl > MAX_LINE {
                return Err(WireError::TooLong);
            }
            let line = self.buf.split_to(nl + 1);
            let text = line[..nl].strip_suffix(b"\r").unwrap_or(&line[..nl]);
            if text.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let v: Value =
                serde_json::from_slice(text).map_err(|e| WireError::NotJson(e.to_string()))?;
            return ServerMessage::parse(v).map(Some);
        }
    }

    /// Bytes buffered and not yet a whole line.
    pub fn pending(&self) -> usize {
        self.buf.remaining()
    }
}

/// One command, as a line to send.
pub fn command(execute: &str, arguments: Option<&Value>, id: u64) -> Vec<u8> {
    let mut m = serde_json::Map::new();
    m.insert("execute".into(), Value::String(execute.into()));
    if let Some(a) = arguments {
        m.insert("arguments".into(), a.clone());
    }
    m.insert("id".into(), Value::from(id));
    let mut out = serde_json::to_vec(&Value::Object(m)).unwrap_or_default();
    out.push(b'\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_split_anywhere_decodes_the_same() {
        let text = concat!(
            "{\"QMP\": {\"version\": {\"qemu\": {\"major\": 7}}, \"capabilities\": [\"oob\"]}}\r\n",
            "{\"return\": {}}\r\n",
            "{\"timestamp\": {\"seconds\": 10, \"microseconds\": 500000}, \"event\": \"STOP\"}\r\n",
            "{\"return\": {\"status\": \"paused\"}, \"id\": 7}\r\n",
            "\r\n",
            "{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"nope\"}, \"id\": 8}\r\n",
        );
        for cut in 0..text.len() {
            let mut d = LineDecoder::new();
            let mut got = Vec::new();
            for part in [&text[..cut], &text[cut..]] {
                d.feed(part.as_bytes());
                while let Some(m) = d.next_message().unwrap() {
                    got.push(m);
                }
            }
            assert_eq!(got.len(), 5, "cut at {cut}");
            assert!(matches!(&got[0], ServerMessage::Greeting(g) if g.capabilities == ["oob"]));
            assert!(
                matches!(&got[2], ServerMessage::Event(e) if e.name == "STOP" && e.timestamp == 10.5)
            );
            assert!(matches!(&got[3], ServerMessage::Return { id: Some(i), .. } if i == 7));
            assert!(
                matches!(&got[4], ServerMessage::Error { class, .. } if class == "CommandNotFound")
            );
        }
    }

    #[test]
    fn bad_lines_are_errors_not_panics() {
        let mut d = LineDecoder::new();
        d.feed(b"not json\n");
        assert!(matches!(d.next_message(), Err(WireError::NotJson(_))));
        let mut d = LineDecoder::new();
        d.feed(b"[1,2]\n");
        assert!(matches!(d.next_message(), Err(WireError::Unknown(_))));
        let mut d = LineDecoder::new();
        d.feed(b"{\"what\": 1}\n");
        assert!(matches!(d.next_message(), Err(WireError::Unknown(_))));
        let mut d = LineDecoder::new();
        d.feed(&vec![b' '; MAX_LINE + 1]);
        assert_eq!(d.next_message(), Err(WireError::TooLong));
    }

    #[test]
    fn commands_are_one_line_with_their_id() {
        let c = command("migrate", Some(&serde_json::json!({"uri": "unix:/x"})), 3);
        assert!(c.ends_with(b"\n") && !c[..c.len() - 1].contains(&b'\n'));
        let v: Value = serde_json::from_slice(&c).unwrap();
        assert_eq!(v["execute"], "migrate");
        assert_eq!(v["arguments"]["uri"], "unix:/x");
        assert_eq!(v["id"], 3);
    }
}
