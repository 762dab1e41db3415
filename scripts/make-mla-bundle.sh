#!/usr/bin/env bash
# The vLLM bundle plus FlashAttention-3, for MLA models on the H200 (issue #18):
#
#   bash scripts/make-mla-bundle.sh [BUNDLE_DIR] [OUT_DIR]     (defaults .vbundle, .vbmla)
#
# vLLM 0.26 prefills MLA attention only with FlashAttention on Hopper, and the bundle
# (../shared/gpu/make-vllm-bundle.sh) leaves flash-attention out.  This takes
# _vllm_fa3_C.abi3.so (153 MB; sm_90 only) from the vLLM wheel the bundle was made from
# (VLLM_WHEEL, default the bundle's download cache), xz-compresses it (10.9 MB, ~2 min on
# 2 cores, kept between runs) and writes OUT_DIR with the bundle's site archive and loader
# (hard links) and that file, without the bundle's tiny model, so that OUT_DIR, .whl and
# the working tree fit one device call's 64 MiB.  scripts/gpu-dataplane.sh unpacks the
# file into vLLM's vllm_flash_attn package when VB_DIR points at OUT_DIR.
set -euo pipefail
bundle=${1:-.vbundle}
out=${2:-.vbmla}
wheel=${VLLM_WHEEL:-$(ls "${VBUNDLE_CACHE:-$HOME/.cache/vllm-bundle}"/wheels/vllm-0.26.0-*.whl | head -1)}
so=vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so
mkdir -p "$out"
grep -qx "/$out/" .git/info/exclude 2>/dev/null || echo "/$out/" >> .git/info/exclude
for f in "$bundle"/vllm-*-site.tar.xz "$bundle"/use-vllm-bundle.sh; do
  ln -f "$f" "$out/" 2>/dev/null || cp -f "$f" "$out/"
done
if [ ! -s "$out/_vllm_fa3_C.abi3.so.xz" ]; then
  tmp=$(mktemp -d)
  unzip -q -o "$wheel" "$so" -d "$tmp"
  xz -T0 -6 -c "$tmp/$so" > "$out/_vllm_fa3_C.abi3.so.xz.part"
  mv "$out/_vllm_fa3_C.abi3.so.xz.part" "$out/_vllm_fa3_C.abi3.so.xz"
  rm -rf "$tmp"
fi
du -b "$out"/*
