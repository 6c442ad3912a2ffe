//! A raw NBD client on a plain socket for tests that send what no real
//! client would: each helper is one step of the handshake or one request.
#![allow(dead_code)]

use crate::common::TestServer;
use bytes::BytesMut;
use ferry_nbd::client::{
    decode_option_reply, decode_reply, encode_option, encode_request, go_data, Reply,
};
use ferry_nbd::consts::*;
use ferry_nbd::Command;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub fn connect(s: &TestServer) -> TcpStream {
    connect_to(s.nbd)
}

pub fn connect_to(addr: std::net::SocketAddr) -> TcpStream {
    let t = TcpStream::connect(addr).unwrap();
    t.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut g = [0u8; 18];
    (&t).read_exact(&mut g).unwrap();
    assert_eq!(&g[..8], b"NBDMAGIC");
    t
}

pub fn read_more(t: &mut TcpStream, buf: &mut BytesMut) -> usize {
    let mut b = [0u8; 65536];
    let n = t.read(&mut b).unwrap_or(0);
    buf.extend_from_slice(&b[..n]);
    n
}

pub fn option_reply(t: &mut TcpStream, buf: &mut BytesMut) -> u32 {
    loop {
        if let Some(r) = decode_option_reply(buf).unwrap() {
            return r.reply_type;
        }
        assert!(
            read_more(t, buf) > 0,
            "closed while waiting for an option reply"
        );
    }
}

/// Negotiate `export` with GO; optionally structured replies first.
pub fn go(s: &TestServer, export: &str, structured: bool) -> (TcpStream, BytesMut) {
    go_at(s.nbd, export, structured)
}

pub fn go_at(addr: std::net::SocketAddr, export: &str, structured: bool) -> (TcpStream, BytesMut) {
    let mut t = connect_to(addr);
    let mut buf = BytesMut::new();
    t.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    if structured {
        t.write_all(&encode_option(OPT_STRUCTURED_REPLY, &[]))
            .unwrap();
        assert_eq!(option_reply(&mut t, &mut buf), REP_ACK);
    }
    t.write_all(&encode_option(OPT_GO, &go_data(export, &[])))
        .unwrap();
    loop {
        match option_reply(&mut t, &mut buf) {
            REP_ACK => break,
            REP_INFO => {}
            other => panic!("GO refused: {other:#x}"),
        }
    }
    (t, buf)
}

pub fn request(
    t: &mut TcpStream,
    flags: u16,
    cmd: Command,
    cookie: u64,
    offset: u64,
    len: u32,
    payload: &[u8],
) {
    let mut b = BytesMut::new();
    encode_request(&mut b, flags, cmd, cookie, offset, len);
    b.extend_from_slice(payload);
    t.write_all(&b).unwrap();
}

pub fn reply(t: &mut TcpStream, buf: &mut BytesMut, read_len: u32) -> Reply {
    loop {
        if let Some(r) = decode_reply(buf, |_| read_len).unwrap() {
            return r;
        }
        assert!(
            read_more(t, buf) > 0,
            "connection closed while waiting for a reply"
        );
    }
}

pub fn closed(t: &mut TcpStream) -> bool {
    let mut b = [0u8; 4096];
    loop {
        match t.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// A healthy connection still reads correct data.
pub fn healthy(s: &TestServer, export: &str, offset: u64, expect: &[u8]) {
    healthy_at(s.nbd, export, offset, expect);
}

/// The same against any NBD server at `addr`.
pub fn healthy_at(addr: std::net::SocketAddr, export: &str, offset: u64, expect: &[u8]) {
    let (mut t, mut buf) = go_at(addr, export, false);
    request(
        &mut t,
        0,
        Command::Read,
        99,
        offset,
        expect.len() as u32,
        &[],
    );
    match reply(&mut t, &mut buf, expect.len() as u32) {
        Reply::Simple {
            error: None, data, ..
        } => assert_eq!(&data[..], expect),
        r => panic!("unexpected {r:?}"),
    }
}
