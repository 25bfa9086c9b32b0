#!/usr/bin/env bash
# Builds .trl-carry/trl-site.tar.xz: TRL 1.16 and what it imports, so that `make bench-gpu`'s GRPO step against TRL can run on
# the GPU machine (no network there). As wheels they do not fit the 64 MiB a device call carries: pyarrow's
# alone is 55 MB. So they are unpacked here, pyarrow's parts that nothing on that path loads are left out
# (Flight, S3, headers, its tests: 55 of its 166 MB), and the tree travels as one xz archive (~31 MB; about
# 47 MB with .gpu-carry's own 16, which every call carries: so it lives beside .gpu-carry, not in it, and the
# calls that carry a vLLM part stay under 64 MiB). scripts/gpu_session.sh unpacks it on the device.
# Run from the project root after ../shared/gpu/prepare_carry.sh (a minute, most of it xz):
#   bash scripts/gpu_trl_carry.sh
set -eu
C=.trl-carry
[ -d .gpu-carry/wheels ] || { echo "no .gpu-carry/wheels: run ../shared/gpu/prepare_carry.sh first"; exit 1; }
mkdir -p "$C"
grep -qx "/$C/" .git/info/exclude 2>/dev/null || echo "/$C/" >> .git/info/exclude
# The versions .venv's `bench` extra resolves to (TRL's pin is setup.py's); cp312 for the device's Python 3.12.
SPECS="trl==1.16.0 datasets==5.2.0 pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0 dill==0.4.1
 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for spec in $SPECS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    -d "$tmp/wheels" "$spec" 2>&1 | grep -v '^WARNING' || true
done
[ "$(ls "$tmp/wheels" | wc -l)" -eq "$(echo $SPECS | wc -w)" ] || { echo "a wheel did not download"; ls "$tmp/wheels"; exit 1; }
# Unpacking a wheel is installing it when it has no scripts to place, and these need none.
for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tmp/site"; done
# What pyarrow's lib, compute, parquet and dataset modules load stays (libarrow_python needs substrait).
(cd "$tmp/site/pyarrow" && rm -rf include tests libarrow_flight* libarrow_python_flight* _flight* libarrow_s3* _s3fs* \
  _pyarrow_cpp_tests* libarrow_python.so libarrow_python.so.*.*.* libarrow_python_parquet_encryption.so \
  libarrow_python_parquet_encryption.so.*.*.*)
rm -rf "$tmp/site/pandas/tests"
find "$tmp/site" -name __pycache__ -prune -exec rm -rf {} +
tar -cJf "$C/trl-site.tar.xz" -C "$tmp/site" .
du -sh "$C/trl-site.tar.xz" .gpu-carry
