//! Hand-made bad bytes against a real server: each gets the right NBD answer
//! or closes that one connection; other connections and the volume's data
//! are never harmed.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;
#[path = "common/raw_nbd.rs"]
mod raw_nbd;
use bytes::BytesMut;
use common::*;
use ferry_nbd::client::{
    decode_option_reply, encode_extended_request, encode_option, encode_request, go_data,
    meta_context_data, Reply,
};
use ferry_nbd::consts::*;
use ferry_nbd::{Command, ErrorCode};
use raw_nbd::*;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

#[test]
fn bad_client_flags_and_option_magic_close_only_that_connection() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("v", 1 << 20);
    v.write_at(0, b"intact", false).unwrap();
    let (mut keep, mut kbuf) = go(&s, "v", false);

    let mut t = connect(&s);
    t.write_all(&[0xff, 0xff, 0xff, 0xff]).unwrap();
    assert!(closed(&mut t));

    let mut t = connect(&s);
    t.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    t.write_all(&[0x42; 40]).unwrap();
    assert!(closed(&mut t));

    // Unknown export via EXPORT_NAME can only be answered by closing.
    let mut t = connect(&s);
    t.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    t.write_all(&encode_option(OPT_EXPORT_NAME, b"no-such-volume"))
        .unwrap();
    assert!(closed(&mut t));

    request(&mut keep, 0, Command::Read, 1, 0, 6, &[]);
    match reply(&mut keep, &mut kbuf, 6) {
        Reply::Simple {
            error: None, data, ..
        } => assert_eq!(&data[..], b"intact"),
        r => panic!("{r:?}"),
    }
}

#[test]
fn unknown_option_and_unknown_export_get_error_replies() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    s.create("v", 1 << 20);
    let mut t = connect(&s);
    let mut buf = BytesMut::new();
    t.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    t.write_all(&encode_option(0x7777, b"whatever")).unwrap();
    assert_eq!(option_reply(&mut t, &mut buf), REP_ERR_UNSUP);
    t.write_all(&encode_option(OPT_GO, &go_data("nope", &[])))
        .unwrap();
    assert_eq!(option_reply(&mut t, &mut buf), REP_ERR_UNKNOWN);
    t.write_all(&encode_option(OPT_GO, b"\x00\x00\x10\x00short"))
        .unwrap();
    assert_eq!(option_reply(&mut t, &mut buf), REP_ERR_INVALID);
    t.write_all(&encode_option(OPT_STARTTLS, &[])).unwrap();
    assert_eq!(option_reply(&mut t, &mut buf), REP_ERR_UNSUP);
    t.write_all(&encode_option(OPT_GO, &go_data("v", &[])))
        .unwrap();
    loop {
        match option_reply(&mut t, &mut buf) {
            REP_ACK => break,
            REP_INFO => {}
            o => panic!("{o:#x}"),
        }
    }
}

#[test]
fn out_of_range_requests_get_errno_and_change_nothing() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("v", 1 << 20);
    v.write_at((1 << 20) - 4, b"tail", false).unwrap();
    let (mut t, mut buf) = go(&s, "v", false);
    let size = 1u64 << 20;
    request(&mut t, 0, Command::Read, 1, size - 2, 4, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    request(&mut t, 0, Command::Write, 2, size - 2, 4, b"XXXX");
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::NoSpc));
    request(&mut t, 0, Command::Write, 3, u64::MAX - 1, 4, b"XXXX");
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::NoSpc));
    request(&mut t, 0, Command::Trim, 4, size, 512, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    request(&mut t, 0, Command::WriteZeroes, 5, 0, u32::MAX, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::NoSpc));
    request(&mut t, 0, Command::Read, 6, 0, 0, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    drop(t);
    healthy(&s, "v", size - 4, b"tail");
}

#[test]
fn oversized_unknown_and_badly_flagged_requests_keep_the_connection() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("v", 64 << 20);
    v.write_at(0, b"ok", false).unwrap();
    let (mut t, mut buf) = go(&s, "v", false);
    let big = vec![0x55u8; (MAX + 1) as usize];
    request(&mut t, 0, Command::Write, 1, 0, MAX + 1, &big);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    request(&mut t, 0, Command::Read, 2, 0, MAX + 1, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    request(&mut t, 0, Command::Unknown(200), 3, 0, 1, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    request(
        &mut t,
        CMD_FLAG_NO_HOLE | 0x4000,
        Command::Read,
        4,
        0,
        1,
        &[],
    );
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    request(&mut t, 0, Command::BlockStatus, 5, 0, 512, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    request(&mut t, 0, Command::Read, 6, 0, 2, &[]);
    match reply(&mut t, &mut buf, 2) {
        Reply::Simple {
            error: None,
            data,
            cookie: 6,
        } => assert_eq!(&data[..], b"ok"),
        r => panic!("{r:?}"),
    }
    // The oversized write was not applied.
    let mut b = [0u8; 2];
    v.read_at(0, &mut b).unwrap();
    assert_eq!(&b, b"ok");
}

const MAX: u32 = ferry_nbd::MAX_REQUEST_LEN;

#[test]
fn bad_request_magic_closes_only_that_connection() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("v", 1 << 20);
    v.write_at(512, b"still here", false).unwrap();
    let (mut t, _) = go(&s, "v", false);
    t.write_all(&[0xde; 28]).unwrap();
    assert!(closed(&mut t));
    healthy(&s, "v", 512, b"still here");
}

#[test]
fn client_vanishing_mid_write_leaves_the_volume_untouched() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("v", 4 << 20);
    for _ in 0..5 {
        let (mut t, _) = go(&s, "v", false);
        let mut b = BytesMut::new();
        encode_request(&mut b, 0, Command::Write, 1, 0, 1 << 20);
        t.write_all(&b).unwrap();
        t.write_all(&vec![0xee; 100_000]).unwrap();
        drop(t);
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut data = vec![1u8; 1 << 20];
    v.read_at(0, &mut data).unwrap();
    assert!(
        data.iter().all(|&x| x == 0),
        "a partial write reached the volume"
    );
    healthy(&s, "v", 0, &[0u8; 16]);
}

#[test]
fn read_only_volume_refuses_writes() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    s.state
        .pool
        .create(
            "ro",
            &ferry_storage::CreateOptions {
                size: 1 << 20,
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
    let (mut t, mut buf) = go(&s, "ro", false);
    request(&mut t, 0, Command::Write, 1, 0, 4, b"nope");
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Perm));
    request(&mut t, 0, Command::Trim, 2, 0, 4096, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Perm));
    request(&mut t, 0, Command::Read, 3, 0, 4, &[]);
    assert_eq!(reply(&mut t, &mut buf, 4).error(), None);
    // RESIZE is not advertised on it, and not served.
    request(&mut t, 0, Command::Resize, 4, 2 << 20, 0, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::NotSup));
}

#[test]
fn pipelined_requests_are_all_answered_with_structured_reads() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("v", 16 << 20);
    for i in 0..64u64 {
        v.write_at(i * 65536, &[i as u8; 65536], false).unwrap();
    }
    let (mut t, mut buf) = go(&s, "v", true);
    let mut b = BytesMut::new();
    for i in 0..64u64 {
        encode_request(&mut b, 0, Command::Read, 1000 + i, i * 65536, 65536);
    }
    t.write_all(&b).unwrap();
    let mut seen = std::collections::HashSet::new();
    while seen.len() < 64 {
        match reply(&mut t, &mut buf, 0) {
            Reply::Chunk {
                cookie,
                ty,
                payload,
                flags,
            } => {
                assert_eq!(ty, REPLY_TYPE_OFFSET_DATA);
                assert!(flags & REPLY_FLAG_DONE != 0);
                let i = cookie - 1000;
                assert_eq!(
                    u64::from_be_bytes(payload[..8].try_into().unwrap()),
                    i * 65536
                );
                assert!(payload[8..].iter().all(|&x| x == i as u8));
                assert!(seen.insert(cookie));
            }
            r => panic!("{r:?}"),
        }
    }
}

#[test]
fn disc_drains_in_flight_writes_before_closing() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("v", 8 << 20);
    let (mut t, mut buf) = go(&s, "v", false);
    let mut b = BytesMut::new();
    for i in 0..32u64 {
        encode_request(&mut b, 0, Command::Write, i, i * 65536, 65536);
        b.extend_from_slice(&[0x77; 65536]);
    }
    encode_request(&mut b, 0, Command::Disc, 99, 0, 0);
    t.write_all(&b).unwrap();
    let mut answered = 0;
    while answered < 32 {
        assert_eq!(reply(&mut t, &mut buf, 0).error(), None);
        answered += 1;
    }
    assert!(closed(&mut t));
    let mut data = vec![0u8; 32 * 65536];
    v.read_at(0, &mut data).unwrap();
    assert!(data.iter().all(|&x| x == 0x77));
}

/// Negotiate `export` with the given options before GO; returns the
/// socket, what is buffered, and the transmission flags the server sent.
fn go_with(
    addr: std::net::SocketAddr,
    export: &str,
    options: &[(u32, Vec<u8>)],
) -> (TcpStream, BytesMut, u16) {
    let mut t = connect_to(addr);
    let mut buf = BytesMut::new();
    t.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    for (opt, data) in options {
        t.write_all(&encode_option(*opt, data)).unwrap();
        loop {
            match option_reply(&mut t, &mut buf) {
                REP_ACK => break,
                REP_META_CONTEXT => {}
                other => panic!("option {opt} refused: {other:#x}"),
            }
        }
    }
    t.write_all(&encode_option(OPT_GO, &go_data(export, &[])))
        .unwrap();
    let mut flags = 0;
    loop {
        let r = loop {
            if let Some(r) = decode_option_reply(&mut buf).unwrap() {
                break r;
            }
            assert!(read_more(&mut t, &mut buf) > 0, "closed during GO");
        };
        match r.reply_type {
            REP_ACK => return (t, buf, flags),
            REP_INFO if r.data[..2] == INFO_EXPORT.to_be_bytes() => {
                flags = u16::from_be_bytes([r.data[10], r.data[11]]);
            }
            REP_INFO => {}
            other => panic!("GO refused: {other:#x}"),
        }
    }
}

/// Extended headers, negotiated with base:allocation.
fn go_extended(s: &TestServer, export: &str) -> (TcpStream, BytesMut) {
    let (t, buf, _) = go_with(
        s.nbd,
        export,
        &[
            (OPT_EXTENDED_HEADERS, vec![]),
            (
                OPT_SET_META_CONTEXT,
                meta_context_data(export, &["base:allocation"]),
            ),
        ],
    );
    (t, buf)
}

fn ext_request(
    t: &mut TcpStream,
    flags: u16,
    cmd: Command,
    cookie: u64,
    offset: u64,
    len: u64,
    payload: &[u8],
) {
    let mut b = BytesMut::new();
    encode_extended_request(&mut b, flags, cmd, cookie, offset, len);
    b.extend_from_slice(payload);
    t.write_all(&b).unwrap();
}

/// The raw bytes of the next extended reply chunk: (header, payload).
fn ext_chunk(t: &mut TcpStream, buf: &mut BytesMut) -> (Vec<u8>, Vec<u8>) {
    loop {
        if buf.len() >= 32 {
            assert_eq!(buf[..4], EXTENDED_REPLY_MAGIC.to_be_bytes(), "not extended");
            let len = u64::from_be_bytes(buf[24..32].try_into().unwrap()) as usize;
            if buf.len() >= 32 + len {
                let h = buf.split_to(32).to_vec();
                return (h, buf.split_to(len).to_vec());
            }
        }
        assert!(read_more(t, buf) > 0, "closed while waiting for a chunk");
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(b[at..at + 2].try_into().unwrap())
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}
fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

#[test]
fn extended_headers_carry_64_bit_lengths_and_echo_offsets() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    s.create("x", 8 << 30);
    let (mut t, mut buf) = go_extended(&s, "x");
    let at = 5 << 30;
    // A WRITE with the payload flag, and one without (QEMU 10's way).
    ext_request(
        &mut t,
        CMD_FLAG_PAYLOAD_LEN,
        Command::Write,
        1,
        at,
        5,
        b"hello",
    );
    ext_request(&mut t, CMD_FLAG_FUA, Command::Write, 2, at + 5, 3, b"abc");
    for _ in 0..2 {
        let (h, p) = ext_chunk(&mut t, &mut buf);
        assert_eq!(
            (be16(&h, 4), be16(&h, 6)),
            (REPLY_FLAG_DONE, REPLY_TYPE_NONE)
        );
        assert!(p.is_empty());
    }
    ext_request(&mut t, 0, Command::Read, 3, at, 8, &[]);
    let (h, p) = ext_chunk(&mut t, &mut buf);
    assert_eq!(be16(&h, 6), REPLY_TYPE_OFFSET_DATA);
    assert_eq!(
        (be64(&h, 8), be64(&h, 16)),
        (3, at),
        "cookie and offset echoed"
    );
    assert_eq!((be64(&p, 0), &p[8..]), (at, &b"helloabc"[..]));
    // BLOCK_STATUS over all 8 GiB in one request: 64-bit extents.
    ext_request(&mut t, 0, Command::BlockStatus, 4, 0, 8 << 30, &[]);
    let (h, p) = ext_chunk(&mut t, &mut buf);
    assert_eq!(be16(&h, 6), REPLY_TYPE_BLOCK_STATUS_EXT);
    let n = be32(&p, 4) as usize;
    assert_eq!(p.len(), 8 + 16 * n);
    let extents: Vec<(u64, u64)> = (0..n)
        .map(|i| (be64(&p, 8 + 16 * i), be64(&p, 16 + 16 * i)))
        .collect();
    assert_eq!(extents.iter().map(|e| e.0).sum::<u64>(), 8 << 30);
    assert!(extents[0].0 >= 5 << 30 && extents[0].1 == 3, "{extents:?}");
    let (h, _) = ext_chunk(&mut t, &mut buf);
    assert_eq!(be16(&h, 6), REPLY_TYPE_NONE);
    // A 5 GiB WRITE_ZEROES in one request leaves the data right after it.
    ext_request(&mut t, 0, Command::WriteZeroes, 5, 0, 5 << 30, &[]);
    assert_eq!(be16(&ext_chunk(&mut t, &mut buf).0, 6), REPLY_TYPE_NONE);
    // A payload on a command without a payload form: consumed, EINVAL,
    // and the connection goes on. Every error is a chunk with a message.
    ext_request(
        &mut t,
        CMD_FLAG_PAYLOAD_LEN,
        Command::Trim,
        6,
        0,
        8,
        &[9; 8],
    );
    let (h, p) = ext_chunk(&mut t, &mut buf);
    assert_eq!((be16(&h, 6), be32(&p, 0)), (REPLY_TYPE_ERROR, 22));
    ext_request(&mut t, 0, Command::Read, 7, 8 << 30, 1, &[]);
    let (h, p) = ext_chunk(&mut t, &mut buf);
    assert_eq!((be16(&h, 6), be32(&p, 0)), (REPLY_TYPE_ERROR, 22));
    ext_request(&mut t, 0, Command::Flush, 8, 0, 0, &[]);
    assert_eq!(be16(&ext_chunk(&mut t, &mut buf).0, 6), REPLY_TYPE_NONE);
    // A compact header on an extended connection ends it, and only it.
    request(&mut t, 0, Command::Read, 9, 0, 512, &[]);
    t.write_all(&[0; 4]).unwrap();
    assert!(closed(&mut t));
    // So does a payload over the limit on a command that takes none.
    let (mut t, _) = go_extended(&s, "x");
    ext_request(
        &mut t,
        CMD_FLAG_PAYLOAD_LEN,
        Command::Cache,
        10,
        0,
        64 << 20,
        &[],
    );
    assert!(closed(&mut t));
    healthy(&s, "x", at, b"helloabc");
}

#[test]
fn resize_grows_for_anyone_and_shrinks_only_for_the_one_client() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(&d.path().join("pool"));
    let v = s.create("r", 1 << 20);
    let (mut t, mut buf, flags) = go_with(s.nbd, "r", &[]);
    assert!(flags & FLAG_SEND_RESIZE != 0, "resize not advertised");
    // Grow to 4 MiB (the new size is in the offset field); the same
    // connection may then use it.
    request(&mut t, 0, Command::Resize, 1, 4 << 20, 0, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), None);
    assert_eq!(v.size(), 4 << 20);
    request(&mut t, 0, Command::Write, 2, 3 << 20, 4, b"tail");
    assert_eq!(reply(&mut t, &mut buf, 0).error(), None);
    // Not a multiple of the block size: EINVAL, nothing changes.
    request(&mut t, 0, Command::Resize, 3, (4 << 20) + 1, 0, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Inval));
    // Shrinking while another client is connected: EPERM.
    let (mut other, _, _) = go_with(s.nbd, "r", &[]);
    // The server opens the export for a connection just after its GO
    // reply: once a request on it is answered, it is surely open.
    let mut other_buf = BytesMut::new();
    request(&mut other, 0, Command::Flush, 9, 0, 0, &[]);
    assert_eq!(reply(&mut other, &mut other_buf, 0).error(), None);
    request(&mut t, 0, Command::Resize, 4, 2 << 20, 0, &[]);
    assert_eq!(reply(&mut t, &mut buf, 0).error(), Some(ErrorCode::Perm));
    assert_eq!(v.size(), 4 << 20);
    drop(other);
    // Alone, it may: the volume and its file shrink.
    let mut left = Some(());
    for _ in 0..100 {
        request(&mut t, 0, Command::Resize, 5, 2 << 20, 0, &[]);
        if reply(&mut t, &mut buf, 0).error().is_none() {
            left = None;
            break;
        }
        // The other connection's close is seen a moment later.
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(left.is_none(), "shrink refused with no other client");
    assert_eq!(v.size(), 2 << 20);
    request(&mut t, 0, Command::Read, 6, 3 << 20, 4, &[]);
    assert_eq!(reply(&mut t, &mut buf, 4).error(), Some(ErrorCode::Inval));
    // A new client is told the new size.
    let (_t2, _, _) = go_with(s.nbd, "r", &[]);
    assert_eq!(
        run(std::process::Command::new("nbdinfo").args(["--size", &s.uri("r")])).trim(),
        (2u64 << 20).to_string()
    );
}

// ---- the migration listener -------------------------------------------

mod migration_input {
    use super::common::TestServer;
    use bytes::{Bytes, BytesMut};
    use ferry_migration::{Encoding, FrameDecoder, Message, PrintEntry, VolumeDescriptor};
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::time::Duration;

    /// A destination whose loopback listener speaks plaintext, so the tests
    /// can write frames by hand.
    fn plaintext_destination(pool: &std::path::Path) -> TestServer {
        TestServer::start_with(pool, |c| {
            c.migration.listen = "127.0.0.1:0".into();
            c.migration.plaintext = true;
        })
    }

    fn hello(name: &str, size: u64, chunk: u32, id: u8) -> Message {
        Message::Hello {
            min_version: ferry_migration::VERSION,
            max_version: ferry_migration::VERSION,
            migration_id: [id; 16],
            volume: VolumeDescriptor {
                name: name.into(),
                size,
                block_size: 512,
                chunk_size: chunk,
                uuid: [id; 16],
                wwn: "naa.3000000000000001".into(),
                allocated: 0,
                physical_block_size: 512,
            },
            iscsi: ferry_migration::IscsiPort::default(),
            arrived_under: String::new(),
        }
    }

    fn connect(s: &TestServer) -> TcpStream {
        let c = TcpStream::connect(s.migration.unwrap()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c
    }

    fn send(c: &mut TcpStream, m: &Message) {
        let mut b = BytesMut::new();
        m.encode(&mut b);
        c.write_all(&b).unwrap();
    }

    /// Read until one message arrives or the peer closes (`None`).
    fn recv(c: &mut TcpStream) -> Option<Message> {
        let mut buf = BytesMut::new();
        let mut d = FrameDecoder::new();
        let mut tmp = [0u8; 4096];
        loop {
            if let Ok(Some(m)) = d.decode(&mut buf) {
                return Some(m);
            }
            match c.read(&mut tmp) {
                Ok(0) | Err(_) => return None,
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
            }
        }
    }

    /// The destination says why (Abort), then closes the link: bad data
    /// is not a link fault for the source to resume from.
    fn aborted(c: &mut TcpStream) -> String {
        match recv(c) {
            Some(Message::Abort { reason }) => {
                assert!(recv(c).is_none(), "the link ends after Abort");
                reason
            }
            other => panic!("expected Abort, got {other:?}"),
        }
    }

    fn welcomed(c: &mut TcpStream) {
        match recv(c) {
            Some(Message::Welcome { .. }) => {}
            other => panic!("expected Welcome, got {other:?}"),
        }
    }

    #[test]
    fn garbage_and_bad_hellos_are_refused_without_creating_anything() {
        let dir = tempfile::tempdir().unwrap();
        let s = plaintext_destination(dir.path());
        let mut c = connect(&s);
        c.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert!(recv(&mut c).is_none(), "garbage must close the link");

        let mut c = connect(&s);
        send(&mut c, &hello("odd", 1 << 20, 1000, 1));
        assert!(matches!(recv(&mut c), Some(Message::Refuse { .. })));

        // A size whose chunk table would not fit in memory.
        let mut c = connect(&s);
        send(&mut c, &hello("huge", 1 << 60, 4096, 8));
        assert!(matches!(recv(&mut c), Some(Message::Refuse { .. })));

        let mut c = connect(&s);
        send(&mut c, &hello("../escape", 1 << 20, 4096, 2));
        assert!(matches!(recv(&mut c), Some(Message::Refuse { .. })));

        let mut c = connect(&s);
        let mut h = hello("v2", 1 << 20, 4096, 3);
        if let Message::Hello {
            min_version,
            max_version,
            ..
        } = &mut h
        {
            *min_version = ferry_migration::VERSION + 1;
            *max_version = ferry_migration::VERSION + 3;
        }
        send(&mut c, &h);
        assert!(matches!(recv(&mut c), Some(Message::Refuse { .. })));

        // A source of version 7, whose Hello ends before `arrived_under`:
        // refused by its version, by name.
        let mut c = connect(&s);
        let mut h = hello("v7", 1 << 20, 4096, 4);
        if let Message::Hello {
            min_version,
            max_version,
            ..
        } = &mut h
        {
            (*min_version, *max_version) = (7, 7);
        }
        let mut b = BytesMut::new();
        h.encode(&mut b);
        // The empty string's two length bytes.
        b.truncate(b.len() - 2);
        let payload = u32::try_from(b.len() - 12).unwrap();
        b[8..12].copy_from_slice(&payload.to_be_bytes());
        c.write_all(&b).unwrap();
        match recv(&mut c) {
            Some(Message::Refuse { reason }) => {
                assert!(reason.contains("version"), "{reason}");
            }
            other => panic!("expected Refuse, got {other:?}"),
        }
        assert!(s.state.pool.list().is_empty());
    }

    #[test]
    fn buddy_lookups_answer_unknown_blocks_with_nothing_and_refuse_huge_batches() {
        let dir = tempfile::tempdir().unwrap();
        let s = plaintext_destination(dir.path());
        let mut c = connect(&s);
        send(
            &mut c,
            &Message::Lookup {
                block_size: 4096,
                keys: vec![3; 5],
            },
        );
        match recv(&mut c) {
            Some(Message::Found { blocks }) => {
                assert_eq!(blocks.len(), 5);
                assert!(blocks.iter().all(Option::is_none));
            }
            other => panic!("expected Found, got {other:?}"),
        }
        // Another block size than the index's: nothing, not an error.
        send(
            &mut c,
            &Message::Lookup {
                block_size: 512,
                keys: vec![3],
            },
        );
        assert!(matches!(recv(&mut c), Some(Message::Found { .. })));
        send(
            &mut c,
            &Message::Lookup {
                block_size: 4096,
                keys: vec![3; 5000],
            },
        );
        assert!(recv(&mut c).is_none(), "an oversized lookup ends the link");
        // A Hello after lookups is not a migration.
        let mut c = connect(&s);
        send(
            &mut c,
            &Message::Lookup {
                block_size: 4096,
                keys: vec![],
            },
        );
        assert!(matches!(recv(&mut c), Some(Message::Found { .. })));
        send(&mut c, &hello("sneaky", 1 << 20, 4096, 1));
        assert!(recv(&mut c).is_none());
        assert!(s.state.pool.list().is_empty());
    }

    #[test]
    fn bad_frames_mid_migration_drop_the_link_and_leave_the_copy_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let s = plaintext_destination(dir.path());
        let size = 1u64 << 20;

        // Fingerprints past the end.
        let mut c = connect(&s);
        send(&mut c, &hello("a", size, 4096, 4));
        welcomed(&mut c);
        send(
            &mut c,
            &Message::Prints {
                first_chunk: 10_000,
                entries: vec![PrintEntry::Key(1)],
            },
        );
        aborted(&mut c);

        // Data that is not zstd, and data past the end.
        let mut c = connect(&s);
        send(&mut c, &hello("b", size, 4096, 5));
        welcomed(&mut c);
        send(
            &mut c,
            &Message::Data {
                offset: 0,
                encoding: Encoding::Zstd,
                raw_len: 4096,
                bytes: Bytes::from_static(b"not zstd at all"),
            },
        );
        aborted(&mut c);
        let mut c = connect(&s);
        send(&mut c, &hello("c", size, 4096, 6));
        welcomed(&mut c);
        send(
            &mut c,
            &Message::Data {
                offset: size,
                encoding: Encoding::Raw,
                raw_len: 4096,
                bytes: Bytes::from(vec![7u8; 4096]),
            },
        );
        aborted(&mut c);

        // A switch without a matching digest is refused.
        let mut c = connect(&s);
        send(&mut c, &hello("d", size, 4096, 7));
        welcomed(&mut c);
        send(&mut c, &Message::Switch);
        assert!(matches!(recv(&mut c), Some(Message::Abort { .. })));

        // Chunks claimed unchanged since the volume arrived at the source,
        // to a copy that is no tracked return's basis (a new one, though
        // the source names a migration it arrived by).
        let mut c = connect(&s);
        let mut h = hello("e", size, 4096, 8);
        if let Message::Hello { arrived_under, .. } = &mut h {
            *arrived_under = "ab".repeat(16);
        }
        send(&mut c, &h);
        welcomed(&mut c);
        send(
            &mut c,
            &Message::Prints {
                first_chunk: 0,
                entries: vec![PrintEntry::Same(4)],
            },
        );
        aborted(&mut c);

        for name in ["a", "b", "c", "d", "e"] {
            let v = s.state.pool.get(name).unwrap();
            assert!(v.incoming().is_some(), "{name} must stay incomplete");
        }
        // Incomplete copies are not exported.
        let r = s.rt().block_on(ferry_client::NbdClient::connect(
            &s.nbd.to_string(),
            "b",
            &Default::default(),
        ));
        assert!(r.is_err());
        // The same id resumes; another id for the same name is refused.
        let mut c = connect(&s);
        send(&mut c, &hello("b", size, 4096, 5));
        assert!(matches!(
            recv(&mut c),
            Some(Message::Welcome {
                basis: ferry_migration::CopyBasis::Resumed,
                ..
            })
        ));
        // Another volume of that name: refused, saying how to clear it.
        let mut other = connect(&s);
        send(&mut other, &hello("b", size, 4096, 9));
        assert!(matches!(recv(&mut other),
            Some(Message::Refuse { reason }) if reason.contains("ferry volume delete b")));
        // The same volume under another id while the first still fills it.
        let mut again = connect(&s);
        let mut same = hello("b", size, 4096, 9);
        if let Message::Hello { volume, .. } = &mut same {
            volume.uuid = [5; 16];
        }
        send(&mut again, &same);
        assert!(matches!(recv(&mut again),
            Some(Message::Refuse { reason }) if reason.contains("being filled")));
        drop(c);
    }

    #[test]
    fn messages_out_of_order_are_aborted_with_the_reason_and_leave_the_copy_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let s = plaintext_destination(dir.path());
        let size = 1u64 << 20;
        let digest = Message::Digest { digest: [0; 32] };
        let round = |n| Message::RoundEnd {
            round: n,
            dirty_bytes: 0,
        };
        let cases: Vec<(&str, u8, Vec<Message>)> = vec![
            ("p", 20, vec![Message::Pause]),
            ("q", 21, vec![round(0)]),
            ("r", 22, vec![Message::PrintsDone, digest.clone()]),
            ("s", 23, vec![Message::PrintsDone, round(1)]),
            ("t", 24, vec![hello("t", size, 4096, 24)]),
            (
                "u",
                25,
                vec![Message::PrintsDone, Message::Synced { round: 0 }],
            ),
            ("v", 26, vec![Message::Pong { nonce: 1 }]),
        ];
        // A ping in order is answered at once with its nonce.
        let mut c = connect(&s);
        send(&mut c, &hello("ping", size, 4096, 27));
        welcomed(&mut c);
        send(&mut c, &Message::Ping { nonce: 5 });
        assert_eq!(recv(&mut c), Some(Message::Pong { nonce: 5 }));
        drop(c);
        for (name, id, msgs) in cases {
            let mut c = connect(&s);
            send(&mut c, &hello(name, size, 4096, id));
            welcomed(&mut c);
            let (last, init) = msgs.split_last().unwrap();
            for m in init {
                send(&mut c, m);
            }
            if !init.is_empty() {
                // PrintsDone is answered with WantDone.
                assert!(matches!(recv(&mut c), Some(Message::WantDone { .. })));
            }
            send(&mut c, last);
            match recv(&mut c) {
                Some(Message::Abort { reason }) => {
                    assert!(reason.contains("not allowed"), "{name}: {reason}")
                }
                other => panic!("{name}: expected Abort, got {other:?}"),
            }
            assert!(recv(&mut c).is_none(), "{name}: the link ends");
            let v = s.state.pool.get(name).unwrap();
            assert!(v.incoming().is_some(), "{name} must stay incomplete");
        }
    }
}
