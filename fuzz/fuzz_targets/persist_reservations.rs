//! The saved persistent-reservation state (`volumes/<name>/reservations`)
//! read back after damage: loading never panics; half the inputs get a
//! valid checksum line, so the fuzzer reaches the records. What loads
//! saves and loads again to the same state.
#![no_main]

use ferry_scsi::pr::Reservations;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut text = String::from_utf8_lossy(data).into_owned();
    if data.first().is_some_and(|b| b & 1 == 1) {
        let sum: String = blake3::hash(text.as_bytes()).as_bytes()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        text.push_str(&format!("sum\t{sum}\n"));
    }
    if let Some(r) = Reservations::load(&text) {
        let saved = r.save();
        let again = Reservations::load(&saved).expect("a saved state loads");
        assert_eq!(again.save(), saved);
    }
});
