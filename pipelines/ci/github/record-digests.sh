#!/usr/bin/env bash
# Pin the chart's images to the digests a release pushed: the operator's image.tag becomes "<tag>@<digest>"
# (the Deployment renders repository:tag@digest) and trainer.image "<repository>:<tag>@<digest>", so an
# install runs exactly the signed images, whatever happens to the tags later.
# Usage: OPERATOR_DIGEST=sha256:... TRAINER_DIGEST=sha256:... record-digests.sh helm/kiln/values.yaml
# (release.yaml runs it; tests/unit/test_delivery_release.py runs it on a copy of the chart.)
set -euo pipefail
values="$1"
for digest in "$OPERATOR_DIGEST" "$TRAINER_DIGEST"; do
  [[ "$digest" =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "not an image digest: '$digest'" >&2; exit 1; }
done
app_version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$(dirname "$values")/Chart.yaml")"
# the two lines the chart ships; anything else there is a chart this script does not know
sed -i -E \
  -e "s|^  tag: \"\"$|  tag: \"${app_version}@${OPERATOR_DIGEST}\"|" \
  -e "s|^  image: ([^:@ ]+):([^@ ]+)$|  image: \1:\2@${TRAINER_DIGEST}|" \
  "$values"
grep -q "^  tag: \"${app_version}@${OPERATOR_DIGEST}\"$" "$values" || { echo "$values: no operator image.tag to pin" >&2; exit 1; }
grep -q "^  image: .*@${TRAINER_DIGEST}$" "$values" || { echo "$values: no trainer.image to pin" >&2; exit 1; }
