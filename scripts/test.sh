#!/usr/bin/env bash
# The test command: installs what the tests need, then runs every test:
# format and lint checks, a short run of every fuzz target, and the whole
# cargo test suite (unit, real-server, real-client and CLI tests). Ends with
# one summary line "N passed, N failed".
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --test || { echo "dependency installation failed"; exit 1; }
export PATH="$HOME/.cargo/bin:$PATH"
export FERRY_REQUIRE_TOOLS=1
export CARGO_TERM_COLOR=never

fail=0
echo "== cargo fmt --check (${SECONDS} s in)"
cargo fmt --all -- --check || fail=1
echo "== cargo clippy (${SECONDS} s in)"
cargo clippy --workspace --all-targets -- -D warnings || fail=1

fuzz_secs="${FERRY_FUZZ_SECONDS:-20}"
if command -v cargo-fuzz >/dev/null 2>&1 && rustup run nightly rustc --version >/dev/null 2>&1; then
  for t in $(cd fuzz && cargo +nightly fuzz list); do
    echo "== fuzz $t for ${fuzz_secs}s"
    (cd fuzz && cargo +nightly fuzz run "$t" -- -max_total_time="$fuzz_secs" 2>&1 | grep -E 'Done|ERROR|panicked|SUMMARY|deadly|^error' ; exit "${PIPESTATUS[0]}")
    rc=$?
    if [ -n "$(ls -A fuzz/artifacts/"$t" 2>/dev/null)" ]; then
      echo "fuzz target $t found a crash: fuzz/artifacts/$t"; fail=1
    elif [ "$rc" != 0 ]; then
      echo "fuzz target $t did not build or run (exit $rc)"; fail=1
    fi
  done
elif [ "${CI:-}" = "true" ]; then
  # CI must fuzz: a missing tool is a failure, not a skip.
  echo "FAIL: fuzz smoke runs cannot run (cargo-fuzz or nightly missing)"; fail=1
else
  echo "SKIP: fuzz smoke runs (cargo-fuzz or nightly missing; CI fails here)"
fi

# Two Ceph clusters (sites A and B) for the RBD tests, shared by every test
# binary, stopped however this script ends.
ceph_dir=$(mktemp -d /tmp/ferry-test-ceph.XXXXXX)
trap 'bash scripts/ceph-cluster.sh stop "$ceph_dir/a"; bash scripts/ceph-cluster.sh stop "$ceph_dir/b"; rm -rf "$ceph_dir"' EXIT
echo "== Ceph clusters in $ceph_dir (${SECONDS} s in)"
if bash scripts/ceph-cluster.sh start "$ceph_dir/a" && bash scripts/ceph-cluster.sh start "$ceph_dir/b"; then
  export FERRY_TEST_CEPH_CONF="$ceph_dir/a/ceph.conf" FERRY_TEST_CEPH_B_CONF="$ceph_dir/b/ceph.conf"
else
  echo "FAIL: the Ceph clusters did not start"; fail=1
fi

echo "== cargo test (${SECONDS} s in)"
log=$(mktemp)
cargo test --workspace --no-fail-fast 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
passed=$(awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i+1) ~ /^passed/) s += $i } END { print s + 0 }' "$log")
failed=$(awk '/^test result:/ { for (i = 1; i < NF; i++) if ($(i+1) ~ /^failed/) s += $i } END { print s + 0 }' "$log")
# The slowest test binaries, to see where CI's time goes.
echo
echo "slowest test binaries (s), ${SECONDS} s in:"
awk '/^ *Running / { name = $2 } /^test result:/ { print $NF, name }' "$log" \
  | sed 's/s / /' | sort -rn | head -8
rm -f "$log"
[ "$rc" = 0 ] || fail=1
if [ "${passed:-0}" = 0 ]; then
  echo "no tests ran"; fail=1
fi
echo
echo "${passed:-0} passed, ${failed:-0} failed"
exit $fail
