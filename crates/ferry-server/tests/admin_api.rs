//! The admin API over real HTTP, and the metrics endpoint.
// Test fixtures: sizes, offsets and byte patterns the test itself chooses.
#![allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]

mod common;
use common::*;
use serde_json::{json, Value};

fn url(s: &TestServer, p: &str) -> String {
    format!("http://{}{}", s.admin, p)
}

#[test]
fn volume_lifecycle_over_http() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let r = ureq::post(&url(&s, "/v1/volumes"))
        .send_json(json!({"name": "a", "size": "8M"}))
        .unwrap();
    assert_eq!(r.status(), 201);
    let v: Value = r.into_json().unwrap();
    assert_eq!(v["size"], 8 << 20);
    assert!(v["wwn"].as_str().unwrap().starts_with("naa.3"));
    let e = ureq::post(&url(&s, "/v1/volumes"))
        .send_json(json!({"name": "a", "size": 4096}))
        .unwrap_err();
    assert!(matches!(e, ureq::Error::Status(409, _)));
    let e = ureq::post(&url(&s, "/v1/volumes"))
        .send_json(json!({"name": "../x", "size": 4096}))
        .unwrap_err();
    assert!(matches!(e, ureq::Error::Status(400, _)));
    let e = ureq::post(&url(&s, "/v1/volumes"))
        .send_json(json!({"name": "b", "size": "lots"}))
        .unwrap_err();
    assert!(matches!(e, ureq::Error::Status(400, _)));
    ureq::post(&url(&s, "/v1/volumes"))
        .send_json(json!({"name": "p", "size": "1M", "preallocate": true}))
        .unwrap();

    // Import, export, compare.
    let img: Vec<u8> = (0..(6u32 << 20))
        .map(|i| if i < (1 << 20) { 0 } else { (i % 251) as u8 })
        .collect();
    let r: Value = ureq::put(&url(&s, "/v1/volumes/a/data"))
        .set("Content-Type", "application/octet-stream")
        .send_bytes(&img)
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(r["bytes"], 6 << 20);
    assert_eq!(r["zeroed"], 1 << 20);
    let mut out = Vec::new();
    std::io::Read::read_to_end(
        &mut ureq::get(&url(&s, "/v1/volumes/a/data"))
            .call()
            .unwrap()
            .into_reader(),
        &mut out,
    )
    .unwrap();
    assert_eq!(out.len(), 8 << 20);
    assert_eq!(&out[..img.len()], &img[..]);
    let too_big = vec![1u8; 9 << 20];
    assert!(ureq::put(&url(&s, "/v1/volumes/a/data"))
        .set("Content-Type", "application/octet-stream")
        .send_bytes(&too_big)
        .is_err());

    // Bitmaps.
    let r = ureq::post(&url(&s, "/v1/volumes/a/bitmaps"))
        .send_json(json!({"name": "m", "granularity": 65536}))
        .unwrap();
    assert_eq!(r.status(), 201);
    s.state
        .pool
        .get("a")
        .unwrap()
        .write_at(0, &[1; 100], false)
        .unwrap();
    let b: Value = ureq::get(&url(&s, "/v1/volumes/a/bitmaps/m"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(b["dirty_bytes"], 65536);
    let b: Value = ureq::post(&url(&s, "/v1/volumes/a/bitmaps/m/clear"))
        .set("Content-Type", "application/json")
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(b["dirty_bytes"], 0);
    ureq::delete(&url(&s, "/v1/volumes/a/bitmaps/m"))
        .set("Content-Type", "application/json")
        .call()
        .unwrap();
    assert!(matches!(
        ureq::get(&url(&s, "/v1/volumes/a/bitmaps/m")).call(),
        Err(ureq::Error::Status(404, _))
    ));

    // Resize.
    let v: Value = ureq::post(&url(&s, "/v1/volumes/a/resize"))
        .send_json(json!({"size": "16M"}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(v["size"], 16 << 20);
    assert!(ureq::post(&url(&s, "/v1/volumes/a/resize"))
        .send_json(json!({"size": "1M"}))
        .is_err());

    let list: Value = ureq::get(&url(&s, "/v1/volumes"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(list.as_array().unwrap().len(), 2);
    ureq::delete(&url(&s, "/v1/volumes/a"))
        .set("Content-Type", "application/json")
        .call()
        .unwrap();
    assert!(matches!(
        ureq::get(&url(&s, "/v1/volumes/a")).call(),
        Err(ureq::Error::Status(404, _))
    ));
    let srv: Value = ureq::get(&url(&s, "/v1/server"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(srv["nbd"], s.nbd.to_string());
}

#[test]
fn metrics_count_requests_bytes_and_latency() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    s.create("m", 4 << 20);
    let addr = s.nbd.to_string();
    s.rt().block_on(async {
        let c = ferry_client::NbdClient::connect(&addr, "m", &Default::default())
            .await
            .unwrap();
        for i in 0..10u64 {
            c.write(i * 4096, bytes::Bytes::from(vec![1u8; 4096]), false)
                .await
                .unwrap();
        }
        c.read(0, 8192).await.unwrap();
        c.flush().await.unwrap();
        c.disconnect().await;
    });
    let text = ureq::get(&url(&s, "/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    for needle in [
        "ferry_requests_total{volume=\"m\",op=\"write\"} 10",
        "ferry_bytes_total{volume=\"m\",op=\"write\"} 40960",
        "ferry_bytes_total{volume=\"m\",op=\"read\"} 8192",
        "ferry_requests_total{volume=\"m\",op=\"flush\"} 1",
        "ferry_request_latency_seconds_count{volume=\"m\",op=\"write\"} 10",
        "ferry_request_size_bytes_bucket{le=\"4096.0\",volume=\"m\",op=\"write\"} 10",
        "ferry_volume_size_bytes{volume=\"m\"} 4194304",
        "# EOF",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
}

#[test]
fn index_rebuild_status_lookup_and_metrics() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    let v = s.create("base", 16 << 20);
    for i in 0..64u64 {
        v.write_at(i * 65536, &[i as u8 + 1; 4096], false).unwrap();
    }
    s.create("empty", 1 << 20);
    let r: Value = ureq::post(&url(&s, "/v1/index/rebuild"))
        .send_json(json!({}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(r.as_array().unwrap().len(), 2);
    let st: Value = ureq::get(&url(&s, "/v1/index"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(st["entries"], 64);
    assert_eq!(st["block_size"], 4096);
    let fp = ferry_index::Fingerprint::of(&[10u8; 4096]);
    let hits = s.state.index.lookup(&fp, 4).unwrap();
    assert_eq!(hits, vec![("base".to_string(), 9 * 16)]);
    // A candidate is only used once its content verifies.
    let mut block = vec![0u8; 4096];
    v.read_at(9 * 65536, &mut block).unwrap();
    assert!(ferry_index::verify(&block, &fp));
    v.write_at(9 * 65536, &[0xff; 4096], false).unwrap();
    v.read_at(9 * 65536, &mut block).unwrap();
    assert!(
        !ferry_index::verify(&block, &fp),
        "a stale candidate must fail verification"
    );
    let text = ureq::get(&url(&s, "/metrics"))
        .call()
        .unwrap()
        .into_string()
        .unwrap();
    assert!(text.contains("ferry_index_entries 64"), "{text}");
    ureq::delete(&url(&s, "/v1/volumes/base"))
        .set("Content-Type", "application/json")
        .call()
        .unwrap();
    let st: Value = ureq::get(&url(&s, "/v1/index"))
        .call()
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(st["entries"], 0);
    let e = ureq::post(&url(&s, "/v1/index/rebuild"))
        .send_json(json!({"volume": "ghost"}))
        .unwrap_err();
    assert!(matches!(e, ureq::Error::Status(404, _)));
}

/// Until the index finds `fp` first at block `want` (`None`: nowhere),
/// for at most 10 s.
fn wait_for_block(s: &TestServer, fp: &ferry_index::Fingerprint, want: Option<u64>) {
    let t = std::time::Instant::now();
    loop {
        let hits = s.state.index.lookup(fp, 4).unwrap();
        if hits.first().map(|h| h.1) == want {
            return;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "index never showed {want:?}, has {hits:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

#[test]
fn index_follows_imports_and_writes() {
    let d = tempfile::tempdir().unwrap();
    let s = TestServer::start(d.path());
    ureq::post(&url(&s, "/v1/volumes"))
        .send_json(json!({"name": "img", "size": "4M"}))
        .unwrap();
    let mut img = vec![0u8; 4 << 20];
    img[..4096].fill(0x11);
    ureq::put(&url(&s, "/v1/volumes/img/data"))
        .set("Content-Type", "application/octet-stream")
        .send_bytes(&img)
        .unwrap();
    let wait_for = |fp: &ferry_index::Fingerprint, want: Option<u64>| wait_for_block(&s, fp, want);
    // Indexed after the import, without a rebuild request.
    let old = ferry_index::Fingerprint::of(&[0x11; 4096]);
    wait_for(&old, Some(0));
    // A write moves that content; the background refresher notices.
    let v = s.state.pool.get("img").unwrap();
    v.write_at(0, &[0x22; 4096], false).unwrap();
    v.write_at(40960, &[0x11; 4096], false).unwrap();
    wait_for(&old, Some(10));
    wait_for(&ferry_index::Fingerprint::of(&[0x22; 4096]), Some(0));
    assert!(v
        .bitmap(ferry_server::indexer::INDEX_BITMAP)
        .unwrap()
        .persistent());
}

#[test]
fn a_volume_made_of_a_file_is_indexed_without_a_rebuild_request() {
    let d = tempfile::tempdir().unwrap();
    let files = d.path().join("files");
    std::fs::create_dir(&files).unwrap();
    let mut img = vec![0u8; 4 << 20];
    img[8192..12288].fill(0x33);
    let path = files.join("disk.img");
    std::fs::write(&path, &img).unwrap();
    let dir = files.clone();
    let s = TestServer::start_with(&d.path().join("pool"), move |c| {
        c.storage.allowed_paths = vec![dir];
    });
    ureq::post(&url(&s, "/v1/volumes"))
        .send_json(json!({"name": "adopted", "path": path}))
        .unwrap();
    // Its blocks are what a migration's destination rebuilds from, as an
    // imported volume's are: in the index without `ferry index rebuild`.
    wait_for_block(&s, &ferry_index::Fingerprint::of(&[0x33; 4096]), Some(2));
}

/// A volume the index holds without prints in block order (indexed by a
/// daemon from before they existed, or its prints dropped after a failed
/// write) is indexed again in the background, and its prints are current:
/// a move would print it unread again.
#[test]
fn an_index_without_a_volume_s_prints_makes_them_again_in_the_background() {
    let d = tempfile::tempdir().unwrap();
    let with_prints = |s: &TestServer| -> bool {
        let st: Value = ureq::get(&url(s, "/v1/index"))
            .call()
            .unwrap()
            .into_json()
            .unwrap();
        st["volumes"][0]["prints"].as_bool().unwrap()
    };
    let wait_for_prints = |s: &TestServer| {
        // Scans in the background run when a CPU would otherwise idle.
        let t = std::time::Instant::now();
        while !with_prints(s) {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(120),
                "the prints never came back"
            );
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    let data: Vec<u8> = (0..4u32 << 20)
        .map(|i| (i / 4096 % 255 + 1) as u8)
        .collect();
    let s = TestServer::start(d.path());
    let v = s.create("v", 4 << 20);
    v.write_at(0, &data, false).unwrap();
    v.flush().unwrap();
    ferry_server::indexer::rebuild_volume(&s.state.index, &v).unwrap();
    assert!(with_prints(&s));

    // Dropped (as a failed write of them does): made again.
    s.state.index.forget_prints("v");
    wait_for_prints(&s);
    let current = |s: &TestServer, v: &ferry_storage::Volume| {
        s.state
            .index
            .with_prints("v", 4 << 20, |view| {
                let mut e = vec![ferry_index::prints::ZERO_ENTRY; 1024];
                view.read(0, &mut e).unwrap();
                let marks = v.bitmap(ferry_index::INDEX_BITMAP).unwrap();
                (0..1024u64).all(|b| {
                    !marks.is_dirty(b * 4096, 4096)
                        && e[b as usize][..]
                            == blake3::hash(&data[b as usize * 4096..][..4096]).as_bytes()[..16]
                })
            })
            .unwrap()
    };
    assert!(current(&s, &v));

    // A pool indexed before prints existed: no prints file at all.
    drop(v);
    s.stop();
    std::fs::remove_file(d.path().join("index").join("v.fprt")).unwrap();
    let s = TestServer::start(d.path());
    wait_for_prints(&s);
    let v = s.state.pool.get("v").unwrap();
    assert!(current(&s, &v));
}

/// What a disk move to another daemon would send, estimated the way the
/// controller does: a sample of the volume's fingerprints, asked of the
/// other daemon's index.
#[test]
fn a_volume_sample_asked_of_another_index_says_what_it_lacks() {
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (TestServer::start(da.path()), TestServer::start(db.path()));
    // 256 blocks of 4 KiB: the first half zero, then 128 distinct blocks.
    let v = a.create("disk", 1 << 20);
    for i in 128..256u64 {
        v.write_at(i * 4096, &[(i - 127) as u8; 4096], false)
            .unwrap();
    }
    // The other daemon holds half of those blocks (in another volume, at
    // other places).
    let w = b.create("base", 1 << 20);
    for i in 0..64u64 {
        w.write_at(i * 4096, &[(i + 1) as u8; 4096], false).unwrap();
    }
    ureq::post(&url(&b, "/v1/index/rebuild"))
        .send_json(json!({}))
        .unwrap();
    ureq::post(&url(&a, "/v1/index/rebuild"))
        .send_json(json!({}))
        .unwrap();
    let s: Value = ureq::post(&url(&a, "/v1/volumes/disk/sample"))
        .send_json(json!({"blocks": 256}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(
        (s["sampled"].as_u64(), s["zero"].as_u64()),
        (Some(256), Some(128)),
        "{s}"
    );
    let prints = s["fingerprints"].clone();
    assert_eq!(prints.as_array().unwrap().len(), 128);
    // Blocks of one repeated byte compress to almost nothing, together
    // and each in the sample's stream.
    let z = s["nonzero_compressed"].as_u64().unwrap();
    assert!(z > 0 && z < 128 * 4096 / 50, "{s}");
    let alone: Vec<u64> = s["compressed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap())
        .collect();
    assert_eq!(alone.len(), 128, "one size per fingerprint: {s}");
    assert!(alone.iter().all(|&c| c > 0 && c < 100), "{alone:?}");
    let there: Value = ureq::post(&url(&b, "/v1/index/lookup"))
        .send_json(json!({"fingerprints": prints}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(
        (there["asked"].as_u64(), there["found"].as_u64()),
        (Some(128), Some(64)),
        "{there}"
    );
    // Which ones it lacks: the blocks 65.. of the pattern, the sample's
    // second half.
    let lacks: Vec<u64> = there["missing"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_u64().unwrap())
        .collect();
    assert_eq!(lacks, (64..128).collect::<Vec<u64>>(), "{there}");
    // Its own index holds all of them.
    let here: Value = ureq::post(&url(&a, "/v1/index/lookup"))
        .send_json(json!({"fingerprints": prints}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(here["found"].as_u64(), Some(128), "{here}");
    // Random data does not compress.
    let r = a.create("random", 1 << 20);
    let mut noise = vec![0u8; 1 << 20];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut noise);
    r.write_at(0, &noise, false).unwrap();
    let s: Value = ureq::post(&url(&a, "/v1/volumes/random/sample"))
        .send_json(json!({"blocks": 64}))
        .unwrap()
        .into_json()
        .unwrap();
    let z = s["nonzero_compressed"].as_u64().unwrap();
    assert!((64 * 4096 * 99 / 100..=64 * 4096).contains(&z), "{s}");
    let alone = s["compressed"].as_array().unwrap();
    assert!(
        alone.iter().all(|c| c.as_u64() == Some(4096)),
        "a random block costs its whole size, not more: {s}"
    );
    // Fewer blocks than asked for: spread evenly.
    let s: Value = ureq::post(&url(&a, "/v1/volumes/disk/sample"))
        .send_json(json!({"blocks": 16}))
        .unwrap()
        .into_json()
        .unwrap();
    assert_eq!(
        (s["sampled"].as_u64(), s["zero"].as_u64()),
        (Some(16), Some(8)),
        "{s}"
    );

    // Bad input, each with its reason.
    for (path, body, says) in [
        (
            "/v1/volumes/disk/sample",
            json!({"blocks": 0}),
            "blocks must be 1 to 4096",
        ),
        (
            "/v1/volumes/disk/sample",
            json!({"blocks": 5000}),
            "blocks must be 1 to 4096",
        ),
        (
            "/v1/index/lookup",
            json!({"fingerprints": ["zz"]}),
            "not a fingerprint",
        ),
        (
            "/v1/index/lookup",
            json!({"fingerprints": ["é".repeat(32)]}),
            "not a fingerprint",
        ),
    ] {
        match ureq::post(&url(&a, path)).send_json(body.clone()) {
            Err(ureq::Error::Status(400, r)) => {
                let t = r.into_string().unwrap();
                assert!(t.contains(says), "{path} {body}: {t}");
            }
            other => panic!("{path} {body} was not refused: {other:?}"),
        }
    }
    let e = ureq::post(&url(&a, "/v1/volumes/ghost/sample"))
        .send_json(json!({"blocks": 4}))
        .unwrap_err();
    assert!(matches!(e, ureq::Error::Status(404, _)));
}
