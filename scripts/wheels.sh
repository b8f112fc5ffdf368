#!/usr/bin/env bash
# The wheels the images install (see Dockerfile), at exactly the versions .venv runs and tests:
#   .cache/wheels/deps      what every service needs
#   .cache/wheels/train     what the `train` extra adds (torch, scikit-learn and their dependencies)
#   .cache/wheels/project   the project and its native core: apart, so that a change to them rebuilds
#                           only the images' last layer
# pip reads its cache and PyPI here, on the host, so that building the images reads no network.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$PWD/.venv/bin/python
dest=.cache/wheels
rm -rf "$dest.partial"
mkdir -p "$dest.partial/deps" "$dest.partial/train" "$dest.partial/project"
# Editable and locally built packages (the project, its native core) are built below, not pinned.
"$py" -m pip freeze --exclude-editable | grep -v -e '^trillium' -e ' @ ' > "$dest.partial/constraints.txt"
"$py" -m pip wheel -q -c "$dest.partial/constraints.txt" -w "$dest.partial/deps" .
mv "$dest.partial"/deps/trillium-*.whl "$dest.partial/project/"
(cd native && "$PWD/../.venv/bin/maturin" build --release -q -o "$PWD/../$dest.partial/project" 2>/dev/null)
"$py" -m pip wheel -q -c "$dest.partial/constraints.txt" -w "$dest.partial/train" '.[train]'
for wheel in "$dest.partial"/train/*.whl; do  # keep only what the others lack
  [ ! -e "$dest.partial/deps/${wheel##*/}" ] && [ ! -e "$dest.partial/project/${wheel##*/}" ] || rm "$wheel"
done
rm -rf "$dest" && mv "$dest.partial" "$dest"
echo "wheels in $dest: deps $(du -sh "$dest/deps" | cut -f1), train $(du -sh "$dest/train" | cut -f1)," \
     "project $(du -sh "$dest/project" | cut -f1)"
