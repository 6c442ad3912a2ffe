#!/usr/bin/env python3
"""libiscsi's conformance suite (iscsi-test-cu) against ferry, and against
tgt for reference, written up as docs/conformance.md.

ferry serves a 1 GiB scratch volume on two portals (so the MultipathIO
tests run over two paths), the same again as a 512e volume (512-byte
blocks on 4 KiB physical blocks), and a read-only volume for the ReadOnly
tests. tgt serves a 1 GiB file-backed LUN on one portal, given twice. The
Sanitize suite runs apart (`--allow-sanitize`) on 256 MiB volumes (512 and
512e) over both portals, ferry writing a sanitize at 40 MiB/s so that the
Reset test finds it still under way after its resets; Reset runs after the
others, on its own (see KNOWN below).

Usage: python3 bench/iscsi_conformance.py [--no-tgt] [--out docs/conformance.md]
Needs: libiscsi-bin (iscsi-test-cu), tgt (unless --no-tgt), a release
build of ferry. Run as root (tgtd).
"""
import argparse, collections, os, re, shutil, subprocess, sys, tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ROOT  # noqa: E402
from iscsi_targets import Ferry, Tgt  # noqa: E402

FAMILIES = ["SCSI", "iSCSI"]
SANITIZE_BUT_RESET = ",".join("SCSI.Sanitize." + t for t in (
    "BlockErase", "BlockEraseReserved", "CryptoErase", "CryptoEraseReserved", "ExitFailureMode",
    "InvalidServiceAction", "Overwrite", "OverwriteReserved", "Readonly", "Reservations"))

# Tests of libiscsi 1.19 that no conforming target passes as a user runs
# them, and why; the table of ferry's results links here.
KNOWN = """## Tests that cannot pass as libiscsi runs them

- **SCSI.GetLBAStatus.UnmapSingle on a 512e volume.** Its second loop asks
  GET LBA STATUS at LBA `i + 1` and then requires the first descriptor to
  start at `i + LBPPB` (`test_get_lba_status_unmap_single.c`, line 135).
  SBC-4 (GET LBA STATUS parameter data, "LBA status descriptor
  relationships") requires the first descriptor to start at the LBA the
  command asked for, which ferry does; the two agree only when LBPPB = 1.
  The first loop of the same test, which asks at `i + LBPPB`, passes.
- **SCSI.Sanitize.Reset after SCSI.Sanitize.Reservations over two paths.**
  With two portal URLs, Reservations takes a RESERVE(6) on the second
  path and leaves it held (`mpath_sd2_put` ends only a session it cloned,
  not a multipath one), so Reset's SANITIZE from the first path gets
  RESERVATION CONFLICT, as SPC-2 requires, and its TEST UNIT READY checks
  print a missing sense ("Sense: (null)"). Run after the suite's cleanup
  (here: on its own, over the same two paths), Reset passes on both
  volumes; the daemon's own test (`sanitize_conformance_tests_pass`) runs
  it so.
- **ALUA.** libiscsi 1.19 has no test of REPORT TARGET PORT GROUPS (later
  versions add `test_rtpg_*`); ferry's own tests check the states at both
  sites across a migration with raw PDUs (`cargo test -p ferry-server
  --test iscsi a_migrated_volumes`).
"""

# What an initiator sees when a volume migrates (ALUA and redirects).
MIGRATION = """## When a volume migrates

Both sites present one logical unit: the same NAA (the volume's WWN) and
unit serial (its UUID) in VPD 0x83 and 0x80, and the same target name. The
portals of each daemon form one target port group (`iscsi.port_group`,
1..4095, derived from the host name and the pool's path when 0; relative
port `group << 4 | portal`); INQUIRY reports implicit ALUA (TPGS 01).
REPORT TARGET PORT GROUPS answers, at the source: its group
active/optimized and the destination's standby while the volume migrates;
both transitioning while writes are paused for the switch (and while a
switch is in doubt); its own unavailable and the destination's
active/optimized once the volume has moved. The destination reports the
same the other way round once it owns the volume (the source's group
unavailable). The states change with the migration's own steps: the
pause, then the switch recorded in the volume's metadata.

At the switch the source sends every session of the volume an
asynchronous logout request (event 1, "log out within 2 s"). Commands the
move failed (a write held by the pause, anything that arrives after) are
not answered: the initiator's session recovery issues them again in the
session it logs in to next, where they run for the first time; a session
that has not logged out after 5 s is closed. A new login for the target at
the source is answered "target moved temporarily" (status 01/01) with the
destination's portal (`migration.advertise_iscsi`, or its first portal),
after the initiator passed the target's ACL and CHAP. QEMU's libiscsi
driver follows all of this: a guest on `iscsi://` at the source goes on at
the destination without an I/O error (`cargo test -p ferry-cli --test
iscsi_guest`).

An initiator without redirect support fails its next login at the source
(and its commands there stay unanswered until the connection closes); it
must be pointed at the destination's portal by hand. An initiator without
ALUA sees the same device at the new portal; one with ALUA (Linux
dm-multipath with both sites' portals) sees the source's path go
unavailable and the destination's become active/optimized. A target name
that is a group of volumes (`iscsi.groups`) is not redirected.
"""


def run_suite(test, urls, extra=()):
    out = subprocess.run(["iscsi-test-cu", "--dataloss", *extra, "-t", test] + urls,
                         capture_output=True, text=True, timeout=1800)
    return parse(out.stdout + out.stderr)


def parse(text):
    """{suite: {test: (outcome, reason)}}; outcome passed/failed/skipped."""
    results = collections.OrderedDict()
    suite, test, body = None, None, []

    def close():
        if suite is None or test is None:
            return
        joined = "\n".join(body)
        skip = re.search(r"\[SKIPPED\]\s*(.*)", joined)
        if re.search(r"(^|\.\.\.|\s)FAILED\s*$", joined, re.M):
            outcome, reason = "failed", ""
        elif skip:
            outcome, reason = "skipped", skip.group(1).strip()
        else:
            outcome, reason = "passed", ""
        results.setdefault(suite, collections.OrderedDict())[test] = (outcome, reason)

    for line in text.splitlines():
        m = re.match(r"^Suite: (\S+)", line)
        if m:
            close()
            suite, test, body = m.group(1), None, []
            continue
        m = re.match(r"^\s+Test: (\S+) \.\.\.(.*)$", line)
        if m:
            close()
            test, body = m.group(1), [m.group(2)]
            continue
        if line.startswith("Run Summary"):
            close()
            test = None
            continue
        body.append(line)
    close()
    return results


def unsupported(reason):
    return "not implemented" in reason or "not supported" in reason.lower()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-tgt", action="store_true")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "conformance.md"))
    a = ap.parse_args()
    if not shutil.which("iscsi-test-cu"):
        sys.exit("iscsi-test-cu is required (Debian libiscsi-bin)")
    with_tgt = not a.no_tgt and shutil.which("tgtd") is not None
    work = tempfile.mkdtemp(prefix="ferry-conformance-")
    results = {}
    try:
        f = Ferry(os.path.join(work, "ferry"), config="[storage]\nsanitize_bytes_per_sec = 41943040\n")
        try:
            urls = f.add("scratch", size=1 << 30)
            e512 = f.add("scratch512e", size=1 << 30, physical_block_size=4096)
            ro = f.add("readonly", size=64 << 20, read_only=True)
            for name, vol_urls, pbs in (("ferry", urls, None), ("ferry 512e", e512, 4096)):
                san = f.add("sanitize" + (pbs and "512e" or ""), size=256 << 20, physical_block_size=pbs)
                results[name] = {fam: run_suite(fam, vol_urls) for fam in FAMILIES}
                results[name]["SCSI"].update(run_suite("SCSI.ReadOnly", ro[:1]))
                results[name]["SCSI"].update(run_suite(SANITIZE_BUT_RESET, san, ["--allow-sanitize"]))
                reset = run_suite("SCSI.Sanitize.Reset", san, ["--allow-sanitize"])
                results[name]["SCSI"].setdefault("Sanitize", {}).update(reset.get("Sanitize", {}))
        finally:
            f.stop()
        if with_tgt:
            os.makedirs(os.path.join(work, "tgt"))
            img = os.path.join(work, "tgt", "lun.img")
            roimg = os.path.join(work, "tgt", "ro.img")
            for p, size in ((img, 1 << 30), (roimg, 64 << 20)):
                with open(p, "wb") as fh:
                    fh.truncate(size)
            t = Tgt(os.path.join(work, "tgt"))
            try:
                u = t.add("scratch", img)[0]
                rou = t.add("readonly", roimg, read_only=True)[0]
                results["tgt"] = {fam: run_suite(fam, [u, u]) for fam in FAMILIES}
                results["tgt"]["SCSI"].update(run_suite("SCSI.ReadOnly", [rou]))
                results["tgt"]["SCSI"].update(run_suite("SCSI.Sanitize", [u], ["--allow-sanitize"]))
            finally:
                t.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    targets = list(results)
    ver = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "libiscsi-bin"], capture_output=True, text=True).stdout
    lines = ["# iSCSI conformance", "",
             "Generated by `python3 bench/iscsi_conformance.py` (libiscsi-bin " + (ver or "?") + ", "
             "`iscsi-test-cu --dataloss`; the Sanitize suite also `--allow-sanitize`). Do not edit by hand.", "",
             "ferry: a 1 GiB sparse volume on two portals (MultipathIO runs over two paths), the same as a 512e "
             "volume (\"ferry 512e\": 512-byte blocks on 4 KiB physical blocks), a read-only volume for "
             "SCSI.ReadOnly, and 256 MiB volumes (512 and 512e) on both portals for SCSI.Sanitize (sanitize "
             "writes capped at 40 MiB/s, so the Reset test finds one under way; Reset runs on its own after "
             "the rest, see below)." + (" tgt 1.0.85: a 1 GiB file-backed LUN, its one portal given twice, and a "
                                     "read-only LUN." if with_tgt else ""), "",
             "A test skipped because the target rejected a command as unsupported counts as *passed* in the suite's "
             "own summary; here it is counted apart (\"unsupported\").", "",
             "## Summary", "",
             "| family | target | tests | passed | failed | unsupported | skipped (other reason) |",
             "|---|---|---|---|---|---|---|"]
    for fam in FAMILIES:
        for tg in targets:
            tests = [r for s in results[tg][fam].values() for r in s.values()]
            c = collections.Counter(o for o, _ in tests)
            uns = sum(1 for o, r in tests if o == "skipped" and unsupported(r))
            lines.append(f"| {fam} | {tg} | {len(tests)} | {c['passed']} | {c['failed']} | {uns} | "
                         f"{c['skipped'] - uns} |")
    lines += ["", "## Per suite", "",
              "| family | suite | tests | " + " | ".join(f"{tg} pass / fail / skip" for tg in targets) + " |",
              "|---|---|---|" + "---|" * len(targets)]
    for fam in FAMILIES:
        suites = list(results[targets[0]][fam])
        for s in suites:
            n = len(results[targets[0]][fam][s])
            cells = []
            for tg in targets:
                c = collections.Counter(o for o, _ in results[tg][fam].get(s, {}).values())
                cells.append(f"{c['passed']} / {c['failed']} / {c['skipped']}")
            lines.append(f"| {fam} | {s} | {n} | " + " | ".join(cells) + " |")
    lines += ["", "## Every test ferry did not pass outright", "", "| target | family | test | outcome | reason |",
              "|---|---|---|---|---|"]
    ferries = [tg for tg in targets if tg.startswith("ferry")]
    for tg in ferries:
        for fam in FAMILIES:
            for s, tests in results[tg][fam].items():
                for name, (o, r) in tests.items():
                    if o != "passed":
                        lines.append(f"| {tg} | {fam} | {s}.{name} | {o} | {r} |")
    lines += ["", KNOWN.strip(), "", MIGRATION.strip()]
    if with_tgt:
        lines += ["", "## tgt: failures and unsupported commands", "", "| family | test | outcome | reason |",
                  "|---|---|---|---|"]
        for fam in FAMILIES:
            for s, tests in results["tgt"][fam].items():
                for name, (o, r) in tests.items():
                    if o == "failed" or (o == "skipped" and unsupported(r)):
                        lines.append(f"| {fam} | {s}.{name} | {o} | {r} |")
    text = "\n".join(lines) + "\n"
    with open(a.out, "w") as fh:
        fh.write(text)
    print(text)
    failed = sum(1 for tg in ferries for fam in FAMILIES for s in results[tg][fam].items()
                 for name, (o, _) in s[1].items()
                 if o == "failed" and not (tg == "ferry 512e" and f"{s[0]}.{name}" == "GetLBAStatus.UnmapSingle"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
