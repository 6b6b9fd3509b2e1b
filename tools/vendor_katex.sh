#!/usr/bin/env bash
# Refresh the KaTeX copy under docs/vendor/katex from the npm registry.
# The site loads nothing from the network, so KaTeX is committed. We keep only
# what the site uses: katex.min.js, katex.min.css, contrib/auto-render.min.js and
# the woff2 fonts; the css is rewritten to name only the woff2 files, so the
# browser never looks for the woff/ttf files we leave out.
# Usage: tools/vendor_katex.sh [VERSION]
set -euo pipefail
VERSION=${1:-0.19.1}
DEST=$(cd "$(dirname "$0")/.." && pwd)/docs/vendor/katex
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

(cd "$TMP" && npm pack --silent "katex@$VERSION" >/dev/null && tar xzf "katex-$VERSION.tgz")
SRC=$TMP/package
rm -rf "$DEST"
mkdir -p "$DEST/contrib" "$DEST/fonts"
cp "$SRC/dist/katex.min.js" "$DEST/"
cp "$SRC/dist/contrib/auto-render.min.js" "$DEST/contrib/"
cp "$SRC"/dist/fonts/*.woff2 "$DEST/fonts/"
cp "$SRC/LICENSE" "$DEST/LICENSE"
# drop the ',url(fonts/X.woff) format("woff"),url(fonts/X.ttf) format("truetype")' fallbacks
sed -E 's/,url\(fonts\/[A-Za-z0-9_-]+\.(woff|ttf)\) format\("(woff|truetype)"\)//g' \
    "$SRC/dist/katex.min.css" > "$DEST/katex.min.css"
if grep -Eq '\.(woff|ttf)\)' "$DEST/katex.min.css"; then
    echo "vendor_katex: katex.min.css still names woff/ttf files" >&2
    exit 1
fi
echo "KaTeX $VERSION (npm package katex), trimmed by tools/vendor_katex.sh" > "$DEST/VERSION"
echo "vendored KaTeX $VERSION into $DEST"
