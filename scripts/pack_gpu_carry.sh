#!/usr/bin/env bash
# Packs what a lent GPU machine needs beside the tracked tree into target/gpu-carry/ (the `carry`
# of the device tool, docs/cuda.md "First contact"): `tallow-cuda` (scripts/build_cuda.sh's
# release build, stripped), xz-compressed. The machine has no Rust toolchain and no network, and
# a call carries at most 64 MiB in all (tracked tree + untracked files + carry): this checks that
# the three fit and says by how much.
#
#   scripts/build_cuda.sh && scripts/pack_gpu_carry.sh
#
# The first-contact script unpacks it (scripts/gpu_first_contact.sh). The models are made on the
# GPU machine by Python (scripts/bench_peft_reference.py make-model), so no other binary travels.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/tallow-cuda}
LIMIT=$((64 << 20))
if [ ! -x "$BIN" ]; then
  echo "no $BIN: build it first with scripts/build_cuda.sh (15-30 min on 2 cores)" >&2
  exit 1
fi
if ! grep -qa 'tallow-cuda-toolkit:[0-9]' "$BIN"; then
  echo "$BIN is not a CUDA build (no toolkit mark): scripts/build_cuda.sh makes one" >&2
  exit 1
fi
CARRY=target/gpu-carry
STAGE=$CARRY/stage
rm -rf "$CARRY"
mkdir -p "$STAGE"
cp "$BIN" "$STAGE/tallow-cuda"
tar -cf - -C "$STAGE" tallow-cuda | xz -9e -T0 > "$CARRY/tallow-cuda.tar.xz"
rm -rf "$STAGE"
size() { du -cb "$@" 2>/dev/null | tail -1 | cut -f1; }
# bytes of the files a list names (NUL-separated), those that exist (a deleted tracked file
# does not travel)
bytes() { xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }' || true; }
tree=$(git ls-files -z | bytes)
untracked=$(git ls-files -z --others --exclude-standard | bytes)
carry=$(size "$CARRY")
total=$((tree + untracked + carry))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "tallow-cuda: $(mib "$(size "$BIN")") -> $(mib "$carry") xz"
echo "tracked tree $(mib "$tree") + untracked $(mib "$untracked") + carry $(mib "$carry") = $(mib "$total") of $(mib "$LIMIT")"
if [ "$total" -gt "$LIMIT" ]; then
  echo "error: over the device tool's 64 MiB by $(mib $((total - LIMIT)))" >&2
  exit 1
fi
echo "margin $(mib $((LIMIT - total))); carry: [\"$CARRY\"]"
