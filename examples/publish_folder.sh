#!/usr/bin/env bash
# Publish a compiled artifact to a folder, ready to copy or upload: the artifact's files, a model
# card (README.md) and the runtime wheel that loads it (built offline from runtime/), all listed with
# their sha256 in the published manifest.json; then check the folder with `qcompile verify`.
#
#   bash examples/publish_folder.sh [WORKDIR]      # default /tmp/qcompile-publish
#
# `--to hf://ORG/NAME` uploads to the Hugging Face Hub instead (needs a token). CPU only, ~10 s.
set -euo pipefail
work=${1:-/tmp/qcompile-publish}
mkdir -p "$work"

qcompile synth tiny -o "$work/tiny" --force  # the card names the source after its folder (or --base-model)
qcompile compile "$work/tiny" -o "$work/tiny-fp8" --force -q

# Every file of the artifact is checked against its sha256 first; the folder appears only when
# complete, and publishing it again gives the same bytes (an earlier publish is replaced).
qcompile publish "$work/tiny-fp8" --to "$work/published" --no-progress
qcompile verify "$work/published"

echo "--- what was written"
(cd "$work/published" && find . -type f | sort)
echo "--- the model card (README.md), up to how to run it"
sed -n '/^# /,/^## Run it/p' "$work/published/README.md"
